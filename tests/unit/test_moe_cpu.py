"""Float32 experts packed for the dense layers' CPU kernels (model/moe_cpu.py): the packed block, through each
expert's layers and through the one op a layer, against a float64 per-token reference; the one op equal to the
per-expert layers bit for bit, and a token's output the same alone as in any batch; biases on tensor-parallel
ranks; and whole checkpoints written by transformers, greedy tokens equal to its `generate` with the experts
packed."""

from __future__ import annotations

import types

import pytest
import torch

from llmserve import LLM
from llmserve.model import cpu_kernels
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


def _block(has_bias: bool = False, tp=None, hidden: int = HIDDEN, held=None) -> SparseMoeBlock:
    gen = torch.Generator().manual_seed(3)
    spec = MoeSpec(EXPERTS, 2, INTER, is_renormalized=True, has_bias=has_bias)
    block = SparseMoeBlock(hidden, spec, tp=tp, held_experts=held)
    for param in block.parameters():
        param.data = torch.randn(param.shape, generator=gen) * 0.05
    return block.eval().requires_grad_(False)


def _tied_logits(num_tokens: int, gen: torch.Generator) -> torch.Tensor:
    """[T, E] router logits, every third row with ties at the top (the lower expert ids win)."""
    logits = torch.randn(num_tokens, EXPERTS, generator=gen)  # [T, E]
    logits[::3, 1:] = logits[::3, :1]  # expert 0 ties with all others
    return logits


def _runs_in_one_op(experts: PackedExperts) -> bool:
    with torch.inference_mode():
        return experts.runs_in_one_op(torch.zeros(1, 1), None)


@pytest.mark.parametrize("is_one_op", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 5, 16, 64])
def test_packed_experts_equal_the_float64_per_token_reference(num_tokens, is_one_op):
    block = _block()
    gate_up, down = block.experts.gate_up_proj.clone(), block.experts.down_proj.clone()  # [E, 2I, H], [E, H, I]
    packed = pack_experts(block)
    assert all(layer.packed_weight is not None for layer in [*packed.gate_up_proj, *packed.down_proj])
    if is_one_op and not _runs_in_one_op(packed):
        pytest.skip("experts packed in oneDNN's layout: no panels to stack")
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)  # [T, H]
    logits = _tied_logits(num_tokens, gen)
    weights, ids = route(logits, 2, True)
    with torch.inference_mode():
        if is_one_op:
            got = packed.run_in_one_op(x, weights, ids)
        else:
            got = fused_moe(x, packed.gate_up_proj, packed.down_proj, weights, ids)
    torch.testing.assert_close(got.double(), reference_moe(x, gate_up, down, logits, 2, True), atol=1e-5, rtol=1e-4)


def _one_op_experts(block: SparseMoeBlock) -> PackedExperts:
    packed = pack_experts(block)
    if not _runs_in_one_op(packed):
        pytest.skip("experts packed in oneDNN's layout: no panels to stack")
    return packed


@pytest.mark.parametrize("has_bias, hidden", [(False, HIDDEN), (True, HIDDEN), (True, HIDDEN + 8)])
@pytest.mark.parametrize("num_tokens", [1, 5, 16, 64])
def test_the_one_op_equals_the_per_expert_layers_bit_for_bit(num_tokens, has_bias, hidden):
    """The same sums in the same order: the per-expert path's greedy tokens (equal to transformers') stay; a
    hidden size off the 16-column panels and biases (the last panel's zero-padded) included."""
    packed = _one_op_experts(_block(has_bias, hidden=hidden))
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen)
    weights, ids = route(_tied_logits(num_tokens, gen), 2, True)
    with torch.inference_mode():
        assert torch.equal(packed.run_in_one_op(x, weights, ids),
                           fused_moe(x, packed.gate_up_proj, packed.down_proj, weights, ids))


def test_a_tokens_output_from_the_one_op_is_the_same_alone_and_in_any_batch():
    packed = _one_op_experts(_block())
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(64, HIDDEN, generator=gen)
    weights, ids = route(torch.randn(64, EXPERTS, generator=gen), 2, True)
    with torch.inference_mode():
        whole = packed.run_in_one_op(x, weights, ids)
        for rows in (slice(0, 1), slice(5, 21), slice(30, 31), slice(40, 64)):
            assert torch.equal(packed.run_in_one_op(x[rows], weights[rows], ids[rows]), whole[rows])


def test_pairs_of_other_ranks_experts_count_zero_in_the_one_op():
    """Expert parallelism: ids past the rank's experts are other ranks' pairs (model/moe_parallel.py)."""
    packed = _one_op_experts(_block(held=(2, 2)))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, HIDDEN, generator=gen)
    weights, ids = route(torch.randn(16, EXPERTS, generator=gen), 2, True)
    ids = torch.where((ids >= 2) & (ids < 4), ids - 2, 2)  # local ids of experts 2, 3; the others: 2
    with torch.inference_mode():
        assert torch.equal(packed.run_in_one_op(x, weights, ids),
                           fused_moe(x, packed.gate_up_proj, packed.down_proj, weights, ids))


def test_the_stacked_panels_are_the_layers_panels_not_a_copy():
    packed = _one_op_experts(_block())
    for e, layer in enumerate(packed.down_proj):
        assert layer.packed_weight.data_ptr() == packed.down_panels[e].data_ptr()


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
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert all(isinstance(m.experts, PackedExperts) for m in blocks)
    assert all(_runs_in_one_op(m.experts) for m in blocks) == cpu_kernels.has_avx2_kernels()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [random_prompt(n, i, 512) for i, n in enumerate((3, 17, 1, 9))]
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=4)
    outs = engine_greedy(llm, prompts, 6)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]
    llm.engine.check_integrity()
