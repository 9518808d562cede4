"""The fused Mixture-of-Experts layer (model/moe.py) against a float64 per-token loop of the same math; routing's
tie-breaking and batch invariance; config fields and checkpoint names."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from llmserve.model.moe import (MoeSpec, SparseMoeBlock, expert_counts, fused_moe, moe_spec_from_config, route,
                                router_logits)
from llmserve.model.moe_load import ExpertLoadReader
from llmserve.model.moe_names import expert_shard_view, map_expert_name
from llmserve.model.moe_parallel import expert_slice_of, shard_stacked

HIDDEN, INTER, EXPERTS = 32, 16, 8


def _experts(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.2  # [E, 2I, H]
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.2  # [E, H, I]
    return gate_up, down


def reference_moe(x, gate_up, down, logits, top_k: int, is_renormalized: bool) -> torch.Tensor:
    """One token at a time in float64: softmax, the k best experts (lower id first on ties), their MLPs."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t].double(), dim=-1)
        ids = sorted(range(logits.shape[1]), key=lambda e: (-logits[t, e].item(), e))[:top_k]
        weights = probs[ids] / (probs[ids].sum() if is_renormalized else 1.0)
        for e, w in zip(ids, weights):
            gate, up = (gate_up[e].double() @ x[t].double()).chunk(2)
            out[t] += w * (down[e].double() @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("num_tokens, top_k, is_renormalized", [(1, 2, True), (13, 2, False), (40, 3, True),
                                                                (6, EXPERTS, False)])
def test_fused_layer_equals_the_per_token_reference(num_tokens, top_k, is_renormalized):
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)  # [T, H]
    logits = torch.randn(num_tokens, EXPERTS, generator=gen)  # [T, E]
    gate_up, down = _experts(1)
    got = fused_moe(x, gate_up, down, *route(logits, top_k, is_renormalized))
    torch.testing.assert_close(got.double(), reference_moe(x, gate_up, down, logits, top_k, is_renormalized),
                               atol=1e-5, rtol=0)


def test_tied_logits_pick_the_lower_expert_ids():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0, 2.0, 0.0, 0.0, 0.0],
                           [1.0] * EXPERTS,
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0, 3.0]])
    weights, ids = route(logits, 2, is_renormalized=True)
    assert ids.tolist() == [[1, 2], [0, 1], [6, 7]]
    assert torch.equal(weights, torch.full((3, 2), 0.5))
    gate_up, down = _experts(2)
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fused_moe(x, gate_up, down, weights, ids).double(),
                               reference_moe(x, gate_up, down, logits, 2, True), atol=1e-5, rtol=0)


def test_all_tokens_on_one_expert_and_experts_without_tokens():
    logits = torch.zeros(5, EXPERTS)
    logits[:, 3] = 4.0
    logits[:, 5] = 2.0
    gate_up, down = _experts(3)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(fused_moe(x, gate_up, down, *route(logits, 2, False)).double(),
                               reference_moe(x, gate_up, down, logits, 2, False), atol=1e-5, rtol=0)


def _block(seed: int) -> SparseMoeBlock:
    block = SparseMoeBlock(HIDDEN, MoeSpec(EXPERTS, 2, INTER, is_renormalized=True))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return block


def test_a_tokens_routing_is_the_same_alone_and_in_a_batch():
    """Experts and weights bit for bit; the output up to the expert GEMMs' rounding, whose row results may
    change with the number of rows an expert gets."""
    block = _block(4)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(5))  # [T, H]
    batch_logits = router_logits(x, block.gate.weight)
    batch_weights, batch_ids = route(batch_logits, 2, True)
    with torch.no_grad():
        batch_out = block(x)
    for t in (0, 7, 36):
        alone_logits = router_logits(x[t:t + 1], block.gate.weight)
        assert torch.equal(alone_logits[0], batch_logits[t])
        weights, ids = route(alone_logits, 2, True)
        assert torch.equal(ids[0], batch_ids[t]) and torch.equal(weights[0], batch_weights[t])
        with torch.no_grad():
            torch.testing.assert_close(block(x[t:t + 1])[0], batch_out[t], atol=1e-6, rtol=0)


def test_load_balance_is_max_over_mean_tokens_per_expert_of_each_layer_averaged_over_layers():
    ids = torch.tensor([[0, 1], [0, 2], [0, 3]])  # 6 pairs over 8 experts: mean 0.75, max 3
    assert expert_counts(ids, EXPERTS) == [3, 1, 1, 1, 0, 0, 0, 0]
    first, second, reader = _block(6), _block(7), ExpertLoadReader()
    assert reader.take([first.load, second.load]) is None
    first.load.record(ids)  # 4.0
    second.load.record(torch.arange(EXPERTS).view(4, 2))  # one pair each: 1.0 (even) ...
    second.load.record(torch.arange(EXPERTS).view(4, 2))  # ... over the step's two forwards too
    assert reader.take([first.load, second.load]) == pytest.approx((4.0 + 1.0) / 2)
    assert reader.take([first.load, second.load]) is None  # taken: the counts start again from zero
    with torch.no_grad():
        first(torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(8)))
    assert 1.0 <= reader.take([first.load]) <= EXPERTS / 2


def _config(**fields):
    base = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=False,
                decoder_sparse_step=2, mlp_only_layers=[3], hidden_act="silu")
    return types.SimpleNamespace(**{**base, **fields})


def test_qwen3_moe_spec_and_its_sparse_layers():
    spec = moe_spec_from_config(_config(), "Qwen3MoeForCausalLM")
    assert (spec.num_experts, spec.top_k, spec.intermediate_size, spec.is_renormalized) == (8, 2, 16, False)
    assert [spec.is_sparse_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert moe_spec_from_config(_config(), "Qwen3ForCausalLM") is None


def test_mixtral_always_renormalises():
    config = types.SimpleNamespace(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                   hidden_act="silu", router_jitter_noise=0.1, output_router_logits=True)
    spec = moe_spec_from_config(config, "MixtralForCausalLM")
    assert (spec.num_experts, spec.intermediate_size, spec.is_renormalized) == (4, 32, True)
    assert all(spec.is_sparse_layer(i) for i in range(4))


@pytest.mark.parametrize("field, value", [("hidden_act", "gelu"), ("scoring_func", "sigmoid"),
                                          ("routed_scaling_factor", 2.5), ("shared_expert_intermediate_size", 64),
                                          ("num_experts_per_tok", 9), ("decoder_sparse_step", 0)])
def test_fields_that_change_the_math_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        moe_spec_from_config(_config(**{field: value}), "Qwen3MoeForCausalLM")


@pytest.mark.parametrize("hf_name, target", [
    ("model.layers.1.mlp.experts.3.gate_proj.weight", ("model.layers.1.mlp.experts.gate_up_proj", "e3:gate")),
    ("model.layers.1.mlp.experts.3.up_proj.weight", ("model.layers.1.mlp.experts.gate_up_proj", "e3:up")),
    ("model.layers.1.mlp.experts.12.down_proj.weight", ("model.layers.1.mlp.experts.down_proj", "e12:down")),
    ("model.layers.0.block_sparse_moe.experts.0.w1.weight", ("model.layers.0.mlp.experts.gate_up_proj", "e0:gate")),
    ("model.layers.0.block_sparse_moe.experts.0.w3.weight", ("model.layers.0.mlp.experts.gate_up_proj", "e0:up")),
    ("model.layers.0.block_sparse_moe.experts.0.w2.weight", ("model.layers.0.mlp.experts.down_proj", "e0:down")),
    ("model.layers.0.block_sparse_moe.gate.weight", ("model.layers.0.mlp.gate.weight", None)),
    ("model.layers.0.mlp.experts.gate_up_proj", ("model.layers.0.mlp.experts.gate_up_proj", None)),
    ("model.layers.0.mlp.gate.weight", None),
    ("model.layers.0.mlp.gate_proj.weight", None),
])
def test_checkpoint_names_map_onto_the_stacked_experts(hf_name, target):
    assert map_expert_name(hf_name) == target


def test_expert_shards_view_their_rows():
    gate_up = torch.arange(2 * 6 * 2, dtype=torch.float32).view(2, 6, 2)  # [E=2, 2I=6, H=2]
    assert torch.equal(expert_shard_view(gate_up, "e1:gate"), gate_up[1, :3])
    assert torch.equal(expert_shard_view(gate_up, "e1:up"), gate_up[1, 3:])
    assert torch.equal(expert_shard_view(gate_up, "e0:down"), gate_up[0])


def test_a_ranks_share_of_the_experts_is_the_same_from_per_expert_and_stacked_tensors():
    """Features [2, 5) of every expert: read from per-expert tensors (expert_slice_of) or cut from stacked ones."""
    gate_up, down = _experts(9)  # [E, 2I, H], [E, H, I]
    assert expert_slice_of("model.layers.0.mlp.experts.4.up_proj.weight", (2, 3), None) == (0, 2, 3)
    assert expert_slice_of("model.layers.0.block_sparse_moe.experts.4.w2.weight", (2, 3), None) == (1, 2, 3)
    assert expert_slice_of("model.layers.0.mlp.experts.gate_up_proj", (2, 3), None) is None  # read whole
    share = shard_stacked("model.layers.0.mlp.experts.gate_up_proj", gate_up, 2, 3)  # [E, 6, H]
    assert torch.equal(share[4, :3], gate_up[4, 2:5]) and torch.equal(share[4, 3:], gate_up[4, INTER + 2:INTER + 5])
    assert torch.equal(shard_stacked("model.layers.0.mlp.experts.down_proj", down, 2, 3), down[:, :, 2:5])


def test_the_grouped_gemm_path_counts_the_expert_load_as_the_loop_does(monkeypatch):
    """The CUDA graphs' path (torch's grouped GEMM, run here on CPU) counts each layer's tokens per expert on
    the device, as the loop path does: the same balance, and the same output."""
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(10))
    loop, grouped = _block(11), _block(11)
    monkeypatch.setattr(grouped, "runs_grouped_gemm", lambda _: True)
    with torch.no_grad():
        torch.testing.assert_close(grouped(x), loop(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(grouped.load.counts, loop.load.counts) and int(loop.load.counts.sum()) == 9 * 2
    balance = ExpertLoadReader().take([grouped.load])
    assert balance == pytest.approx(float(loop.load.counts.max()) / (9 * 2 / EXPERTS))
