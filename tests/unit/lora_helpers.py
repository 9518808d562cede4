"""Random PEFT LoRA adapters for a random-weight base checkpoint, and transformers + peft as the reference."""

from __future__ import annotations

import torch

from hf_parity import hf_greedy

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_base(path: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def make_adapter(base_path: str, out_dir: str, seed: int, rank: int = 8, alpha: int = 16,
                 targets: list[str] | None = None, use_rslora: bool = False, dtype: torch.dtype | None = None) -> str:
    """A PEFT adapter with random (non-zero) A and B, saved to out_dir (in `dtype`: default float32);
    returns out_dir."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL_MODULES, init_lora_weights=False,
                        use_rslora=use_rslora, lora_dropout=0.0)
    model = get_peft_model(hf_base(base_path), config)
    with torch.no_grad():  # PEFT's random init is small; larger B makes each adapter change the greedy tokens
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(4.0)
            if dtype is not None and "lora_" in name:
                param.data = param.data.to(dtype)
    model.save_pretrained(out_dir)
    return out_dir


def peft_greedy(base_path: str, adapter_dir: str | None, prompt: list[int], num_out: int,
                is_merged: bool = False, dtype: torch.dtype = torch.float32) -> list[int]:
    """transformers + peft greedy tokens (adapter_dir None: the base model; is_merged: merge_and_unload first;
    dtype: the base model's, the adapter upcast to float32 by peft as it does by default)."""
    from peft import PeftModel

    from transformers import GenerationConfig

    model = hf_base(base_path, dtype)
    model.generation_config = GenerationConfig(do_sample=False, pad_token_id=0)  # what PeftModel.generate reads
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
        if is_merged:
            model = model.merge_and_unload()
    return hf_greedy(model, prompt, num_out)


def float64_lora_delta(x: torch.Tensor, linear, token_slots) -> torch.Tensor:
    """Each token alone in float64: x_t @ A_s^T @ B_s^T per sub-projection of a LoRALinear (zero for base
    tokens, slot < 0)."""
    rank, rows = linear.max_rank, []
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            rows.append(torch.zeros(sum(linear.out_sizes), dtype=torch.float64))
            continue
        a = linear.lora_a[slot].double()
        rows.append(torch.cat([(x[t].double() @ a[j * rank:(j + 1) * rank].T) @ b[slot].double()
                               for j, b in enumerate(linear.lora_bs)]))
    return torch.stack(rows)
