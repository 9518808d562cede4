"""Float32 experts packed for the dense layers' CPU kernels (model/moe_cpu.py): the packed block against a float64
per-token reference, biases on tensor-parallel ranks, and whole checkpoints written by transformers, greedy
tokens equal to its `generate` with the experts packed."""

from __future__ import annotations

import types

import pytest
import torch

from llmserve import LLM
from llmserve.model.linear import can_pack
from llmserve.model.loader import load_model
from llmserve.model.moe import MoeSpec, SparseMoeBlock, fused_moe, route
from llmserve.model.moe_cpu import PackedExperts, can_pack_experts, pack_experts, pack_model_experts

from hf_parity import engine_greedy, hf_greedy, random_prompt
from test_moe_layer import reference_moe
from test_moe_models import write_checkpoint

# Each expert's matrices at least model/linear.py's MIN_ONEDNN_WEIGHT elements: both are packed
HIDDEN, INTER, EXPERTS = 256, 512, 4

pytestmark = pytest.mark.skipif(not can_pack(torch.zeros(2 * INTER, HIDDEN)),
                                reason="no float32 weight packing on this CPU (oneDNN or our kernels)")


def _block(has_bias: bool = False, tp=None) -> SparseMoeBlock:
    gen = torch.Generator().manual_seed(3)
    block = SparseMoeBlock(HIDDEN, MoeSpec(EXPERTS, 2, INTER, is_renormalized=True, has_bias=has_bias), tp=tp)
    for param in block.parameters():
        param.data = torch.randn(param.shape, generator=gen) * 0.05
    return block.eval().requires_grad_(False)


@pytest.mark.parametrize("num_tokens", [1, 5, 16, 64])
def test_packed_experts_equal_the_float64_per_token_reference(num_tokens):
    block = _block()
    gate_up, down = block.experts.gate_up_proj.clone(), block.experts.down_proj.clone()  # [E, 2I, H], [E, H, I]
    packed = pack_experts(block)
    assert all(layer.packed_weight is not None for layer in [*packed.gate_up_proj, *packed.down_proj])
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)  # [T, H]
    logits = torch.randn(num_tokens, EXPERTS, generator=gen)  # [T, E]
    got = fused_moe(x, packed.gate_up_proj, packed.down_proj, *route(logits, 2, True))
    torch.testing.assert_close(got.double(), reference_moe(x, gate_up, down, logits, 2, True), atol=1e-5, rtol=1e-4)


def test_a_packed_block_gives_the_stacked_blocks_output_with_biases():
    block = _block(has_bias=True)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = block(x)
        assert pack_model_experts(block) == 1 and isinstance(block.experts, PackedExperts)
        torch.testing.assert_close(block(x), expected, atol=1e-5, rtol=1e-4)
    assert not can_pack_experts(block)  # packed once


def test_a_tensor_parallel_rank_after_the_first_leaves_the_down_bias_to_rank_0():
    rank1 = types.SimpleNamespace(rank=1, all_reduce=lambda out: out)
    packed = pack_experts(_block(has_bias=True, tp=rank1))
    assert all(layer.bias is not None for layer in packed.gate_up_proj)
    assert all(layer.bias is None for layer in packed.down_proj)


@pytest.mark.parametrize("arch, fields", [
    ("qwen3_moe", dict(moe_intermediate_size=INTER)),
    ("mixtral", dict(intermediate_size=INTER)),
])
def test_checkpoints_with_packed_experts_decode_as_transformers(arch, fields, tmp_path):
    from transformers import AutoModelForCausalLM

    path = write_checkpoint(arch, str(tmp_path), seed=2, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                            head_dim=64, initializer_range=0.05, **fields)
    model = load_model(path, torch.float32, "cpu", 128)
    assert all(isinstance(m.experts, PackedExperts) for m in model.modules() if isinstance(m, SparseMoeBlock))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [random_prompt(n, i, 512) for i, n in enumerate((3, 17, 1, 9))]
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=4)
    outs = engine_greedy(llm, prompts, 6)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]
    llm.engine.check_integrity()
