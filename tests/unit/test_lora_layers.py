"""LoRA's grouped products against a per-row reference, and PEFT adapters read or refused."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from lora_helpers import float64_lora_delta, make_adapter

from llmserve.model import lora_cpu
from llmserve.model.lora_adapter import AdapterError, BaseShapes, adapter_scale, read_adapter, read_adapter_config
from llmserve.model.lora_layers import LoRAContext, LoRALinear, add_lora_segmented, lora_step
from llmserve.testing.maker import make_model

NUM_SLOTS, MAX_RANK, IN, OUT_SIZES = 3, 8, 24, [16, 8, 8]


def _pool(seed: int) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """A [S, 3R, in] and B^T_j [S, R, out_j] with slot s of rank ranks[s] (zeros past it, as set_slot writes)."""
    gen = torch.Generator().manual_seed(seed)
    ranks = [2, 8, 5]
    linear = LoRALinear(torch.nn.Identity(), IN, OUT_SIZES, NUM_SLOTS, MAX_RANK, LoRAContext(), torch.float32,
                        torch.device("cpu"))
    for slot, rank in enumerate(ranks):
        pairs = [(torch.randn(rank, IN, generator=gen), torch.randn(size, rank, generator=gen)) for size in OUT_SIZES]
        linear.set_slot(slot, pairs)
    return linear.lora_a, linear.lora_bs, ranks


def _per_row_reference(x: torch.Tensor, a, bs, token_slots: np.ndarray) -> torch.Tensor:
    """Each token alone: x_t @ A_s^T @ B_s^T per sub-projection (zero for base tokens)."""
    rows = []
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            rows.append(torch.zeros(sum(OUT_SIZES)))
            continue
        parts = [(x[t] @ a[slot, j * MAX_RANK:(j + 1) * MAX_RANK].T) @ b[slot] for j, b in enumerate(bs)]
        rows.append(torch.cat(parts))
    return torch.stack(rows)


@pytest.mark.parametrize("token_slots", [[1, -1, 0, 2, 1, 1, -1, 2, 0, 1], [2, 0, 1], [-1, 0]],
                         ids=["mixed", "one-token-each", "one-adapter-token"])
def test_segmented_products_equal_the_per_row_reference(token_slots):
    a, bs, _ = _pool(0)
    token_slots = np.array(token_slots)  # adapters mixed with base-model tokens
    x = torch.randn(len(token_slots), IN, generator=torch.Generator().manual_seed(1))
    out = torch.ones(len(token_slots), sum(OUT_SIZES))  # the base projection's output, added to
    step = lora_step(token_slots, torch.device("cpu"))
    add_lora_segmented(out, x, a, bs, step)
    torch.testing.assert_close(out, 1 + _per_row_reference(x, a, bs, token_slots), atol=1e-5, rtol=1e-5)



@pytest.mark.skipif(not lora_cpu.available(), reason="the CPU LoRA kernel does not build here")
@pytest.mark.parametrize("token_slots", [[1, -1, 0, 2, 1, 1, -1, 2, 0, 1, 1, 1, 1, 3, 3], [2, 0, 1, 3], [-1, 3]],
                         ids=["mixed", "one-token-each", "one-adapter-token"])
def test_the_one_call_kernel_equals_thefloat64_lora_delta(token_slots):
    """Slots of ranks 2, 8 and 5 (one with no k_proj and no LoRA in v_proj), base tokens between, tiles of
    several tokens of one slot; sizes that leave tails past the kernel's vector widths."""
    gen = torch.Generator().manual_seed(5)
    in_features, out_sizes = 45, [70, 33, 8]
    linear = LoRALinear(torch.nn.Linear(in_features, sum(out_sizes), dtype=torch.float32), in_features, out_sizes, 4,
                        MAX_RANK, LoRAContext(), torch.float32, torch.device("cpu"))
    for slot, (rank, present) in enumerate([(2, [1, 1, 1]), (8, [1, 0, 1]), (5, [1, 1, 1]), (8, [1, 1, 0])]):
        linear.set_slot(slot, [(torch.randn(rank, in_features, generator=gen), torch.randn(size, rank, generator=gen))
                               if is_present else None for size, is_present in zip(out_sizes, present)])
    token_slots = np.array(token_slots)
    x = torch.randn(len(token_slots), in_features, generator=gen)
    linear.context.step = lora_step(token_slots, torch.device("cpu"))
    with torch.no_grad():
        out = linear(x)  # the kernel's path (float32 on CPU)
        expected = linear.base(x).double() + float64_lora_delta(x, linear, token_slots)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-5)
    assert linear.lora_ranks.tolist() == [[2, 2, 2], [8, 0, 8], [5, 5, 5], [8, 8, 0]]


def test_step_groups_tokens_by_slot_and_leaves_base_tokens_out():
    step = lora_step(np.array([2, -1, 0, 2, 0]), torch.device("cpu"))
    assert step.token_indices.tolist() == [2, 4, 0, 3]
    assert step.token_slots.tolist() == [0, 0, 2, 2]
    assert step.segments == [(0, 0, 2), (2, 2, 4)]
    assert lora_step(np.array([-1, -1]), torch.device("cpu")) is None



@pytest.fixture(scope="module")
def base_path(tmp_path_factory) -> str:
    return make_model("llama", "tiny", str(tmp_path_factory.mktemp("base")), seed=1)


def _shapes(path: str) -> BaseShapes:
    from transformers import AutoConfig

    from llmserve.model.lora_adapter import base_shapes

    return base_shapes(AutoConfig.from_pretrained(path))


def test_an_adapter_reads_with_its_scale_folded_into_b(base_path, tmp_path):
    from safetensors.torch import load_file

    path = make_adapter(base_path, str(tmp_path / "a"), seed=2, rank=4, alpha=32, targets=["q_proj", "down_proj"])
    weights = read_adapter(path, _shapes(base_path), max_rank=8)
    raw = load_file(os.path.join(path, "adapter_model.safetensors"))
    assert weights.rank == 4 and {module for _, module in weights.modules} == {"q_proj", "down_proj"}
    a, b = weights.modules[(0, "q_proj")]
    torch.testing.assert_close(a, raw["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"])
    torch.testing.assert_close(b, raw["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"] * 8.0)


def test_rslora_scales_by_the_square_root_of_the_rank():
    assert adapter_scale({"r": 16, "lora_alpha": 32}) == 2.0
    assert adapter_scale({"r": 16, "lora_alpha": 32, "use_rslora": True}) == 8.0


def _edit_config(path: str, **fields) -> None:
    config_path = os.path.join(path, "adapter_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(fields)
    with open(config_path, "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize("fields, message", [
    ({"r": 32}, "rank r=32 is over --max-lora-rank 16"),
    ({"target_modules": ["q_proj", "lm_head"]}, "target_modules ['lm_head'] not supported"),
    ({"bias": "all"}, "bias='all' is not supported"),
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save=['lm_head'] is not supported"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not LORA"),
])
def test_a_bad_adapter_config_is_refused_naming_the_problem(base_path, tmp_path, fields, message):
    path = make_adapter(base_path, str(tmp_path / "a"), seed=3, rank=8, targets=["q_proj"])
    _edit_config(path, **fields)
    with pytest.raises(AdapterError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_adapter_config(path, max_rank=16)


def test_an_adapter_of_another_base_shape_is_refused(base_path, tmp_path):
    other = make_model("llama", "demo", str(tmp_path / "other"), seed=1)  # wider, and 4 layers
    path = make_adapter(other, str(tmp_path / "a"), seed=4, rank=8, targets=["v_proj"])
    with pytest.raises(AdapterError, match=r"v_proj has lora_A \(8, 256\) .* the base model \(rank 8\) needs "
                       r"\(8, 64\)|is for layer [23]; the base model has 2"):
        read_adapter(path, _shapes(base_path), max_rank=16)


def test_a_directory_without_an_adapter_is_refused(tmp_path):
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        read_adapter_config(str(tmp_path), max_rank=16)


def test_an_adapter_on_an_moe_layers_mlp_is_refused_before_any_slot_is_written(tmp_path):
    """Its image (built on the reader thread) raises, naming the layer; the slot is never touched."""
    from llmserve.model.loader import load_model
    from llmserve.model.lora_adapter import LoRAWeights
    from llmserve.model.lora_layers import adapter_image, attach_lora
    from llmserve.testing.maker import make_model

    model = load_model(make_model("qwen3_moe", "tiny-moe", str(tmp_path / "moe"), seed=1), torch.float32, "cpu", 64)
    _, wrapped = attach_lora(model, 2, 4)
    assert wrapped["gate_up_proj"][0] is None and wrapped["qkv_proj"][0] is not None
    hidden, inter = model.config.hidden_size, model.config.moe_intermediate_size
    attention_only = LoRAWeights(4, {(0, "q_proj"): (torch.randn(4, hidden), torch.randn(hidden, 4))})
    assert set(adapter_image(wrapped, attention_only)) == {(fused, layer) for fused, linears in wrapped.items()
                                                           for layer, linear in enumerate(linears) if linear is not None}
    on_experts = LoRAWeights(4, {(0, "gate_proj"): (torch.randn(4, hidden), torch.randn(inter, 4))})
    with pytest.raises(ValueError, match="layer 0's gate_up_proj takes no LoRA"):
        adapter_image(wrapped, on_experts)
