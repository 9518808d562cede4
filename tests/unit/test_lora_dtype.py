"""--lora-dtype: adapter slots in bfloat16 on a float32 model (the CPU kernel's mixed build against a float64
reference and against the float32 kernel on the same values; greedy tokens equal transformers + peft's), and the
kernel's tiles split over threads giving the bits of one thread."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_parity import random_prompt
from lora_helpers import float64_lora_delta, make_adapter, peft_greedy

from llmserve import LLM, LoRARequest, SamplingParams
from llmserve.config import LoRAConfig
from llmserve.model import lora_cpu
from llmserve.model.lora_layers import LoRAContext, LoRALinear, lora_step

needs_kernel = pytest.mark.skipif(not lora_cpu.available(), reason="the CPU LoRA kernel does not build here")
# mixed slots and ranks, base-model tokens, runs of one slot longer than a tile (4 tokens)
TOKEN_SLOTS = np.array([1, -1, 0, 2, 1, 1, -1, 2, 0, 1, 1, 1, 1, 3, 3, 1, 1, 0, 0, 0, 0, 0])


def _linear(slot_dtype: torch.dtype, in_features: int = 45, out_sizes: tuple[int, ...] = (70, 33, 8)) -> LoRALinear:
    """Four slots of ranks 2, 8, 5, 8 (some sub-projections without LoRA) over a float32 base projection."""
    gen = torch.Generator().manual_seed(7)
    base = torch.nn.Linear(in_features, sum(out_sizes), bias=False)
    base.weight.data = torch.randn(sum(out_sizes), in_features, generator=gen)
    linear = LoRALinear(base, in_features, list(out_sizes), 4, 8, LoRAContext(), slot_dtype, torch.device("cpu"))
    for slot, (rank, present) in enumerate([(2, [1, 1, 1]), (8, [1, 0, 1]), (5, [1, 1, 1]), (8, [1, 1, 0])]):
        linear.set_slot(slot, [(torch.randn(rank, in_features, generator=gen), torch.randn(size, rank, generator=gen))
                               if is_present else None for size, is_present in zip(out_sizes, present)])
    return linear


def _run(linear: LoRALinear, x: torch.Tensor, num_threads: int = 1) -> torch.Tensor:
    linear.context.step = lora_step(TOKEN_SLOTS, torch.device("cpu"))
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        with torch.no_grad():
            return linear(x)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_float32_rows_on_bf16_slots_equal_the_float64_reference():
    """Sizes that leave tails past the vector widths (in 45, out 70, 33, 8)."""
    linear = _linear(torch.bfloat16)
    assert linear.lora_a.dtype == torch.bfloat16 and lora_cpu.can_run(torch.ones(1, 45), torch.ones(1, 111),
                                                                        torch.bfloat16)
    x = torch.randn(len(TOKEN_SLOTS), 45, generator=torch.Generator().manual_seed(3))
    out = _run(linear, x)
    assert out.dtype == torch.float32
    expected = linear.base(x).double() + float64_lora_delta(x, linear, TOKEN_SLOTS)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_bf16_slots_match_float32_slots_holding_the_same_values():
    """Widening bfloat16 is exact and the sums run in the same order: within float32 rounding (the scalar
    tails may be contracted into FMAs differently by the two builds)."""
    mixed, wide = _linear(torch.bfloat16), _linear(torch.float32)
    with torch.no_grad():
        for name in ["lora_a", "lora_b0", "lora_b1", "lora_b2"]:
            getattr(wide, name).copy_(getattr(mixed, name).float())
    x = torch.randn(len(TOKEN_SLOTS), 45, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(_run(mixed, x), _run(wide, x), rtol=1e-6, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("slot_dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_on_two_threads_gives_the_bits_of_one(slot_dtype):
    """Each tile (one slot's run of up to 4 tokens) is computed whole by one thread."""
    linear = _linear(slot_dtype, in_features=576, out_sizes=(576, 192, 192))
    x = torch.randn(len(TOKEN_SLOTS), 576, generator=torch.Generator().manual_seed(5))
    assert torch.equal(_run(linear, x, num_threads=2), _run(linear, x, num_threads=1))


def test_lora_dtype_refuses_what_it_does_not_know():
    LoRAConfig(enable_lora=True, lora_dtype="bfloat16").validate()
    with pytest.raises(ValueError, match="--lora-dtype"):
        LoRAConfig(enable_lora=True, lora_dtype="int8").validate()


@pytest.mark.parametrize("form", [pytest.param("kernel", marks=needs_kernel), "segmented"])
def test_bf16_slots_on_a_float32_model_match_peft(form, tmp_path, monkeypatch):
    """Adapters saved in bfloat16 (peft upcasts them onto the float32 base: the values the slots hold), a batch
    of two adapters and the base model; scales of powers of two, so folding them into B rounds nothing."""
    if form == "segmented":
        monkeypatch.setattr(lora_cpu, "can_run", lambda *args: False)
    from llmserve.testing.maker import make_model

    base = make_model("llama", "tiny", str(tmp_path / "base"), seed=1)
    loras = [LoRARequest("all", 1, make_adapter(base, str(tmp_path / "a0"), seed=50, rank=8, alpha=16,
                                                dtype=torch.bfloat16)),
             LoRARequest("some", 2, make_adapter(base, str(tmp_path / "a1"), seed=51, rank=16, alpha=16,
                                                 dtype=torch.bfloat16, targets=["q_proj", "v_proj", "up_proj"]))]
    prompts = [random_prompt(15 + 6 * i, seed=60 + i, vocab_size=512) for i in range(3)]
    requests = [*loras, None]
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, lora_dtype="bfloat16",
              block_size=4, max_num_batched_tokens=16, max_model_len=64, num_kv_blocks=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), lora_request=requests)
    expected = [peft_greedy(base, None if lora is None else lora.lora_path, prompt, 8)
                for prompt, lora in zip(prompts, requests)]
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    llm.engine.check_integrity()
