"""The sync-free experts (model/moe_grouped.py) against the per-expert loop they replace on CUDA, run on CPU
(torch's grouped GEMM runs there too): plain SwiGLU experts, and gpt-oss's biases with its clamped SwiGLU."""

from __future__ import annotations

import pytest
import torch

from llmserve.model.moe import ClampedSwiglu, _silu_mul, fused_moe, route
from llmserve.model.moe_grouped import can_group, grouped_moe

pytest.importorskip("torch", minversion="2.8")  # torch._grouped_mm


def _case(num_tokens: int, num_experts: int, top_k: int, seed: int, has_bias: bool):
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = 32, 16
    x = torch.randn(num_tokens, hidden, generator=gen)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2
    down = torch.randn(num_experts, hidden, inter, generator=gen) * 0.2
    weights, ids = route(torch.randn(num_tokens, num_experts, generator=gen), top_k, is_renormalized=True)
    biases = (torch.randn(num_experts, 2 * inter, generator=gen), torch.randn(num_experts, hidden, generator=gen)) \
        if has_bias else None
    return x, gate_up, down, weights, ids, biases


@pytest.mark.parametrize("num_tokens", [1, 7, 64])
@pytest.mark.parametrize("has_bias", [False, True])
def test_grouped_experts_equal_the_per_expert_loop(num_tokens, has_bias):
    x, gate_up, down, weights, ids, biases = _case(num_tokens, 8, 2, num_tokens, has_bias)
    activation = ClampedSwiglu(alpha=1.702, limit=0.5) if has_bias else _silu_mul
    want = fused_moe(x, gate_up, down, weights, ids, biases, activation if has_bias else None)
    got = grouped_moe(x, gate_up, down, weights, ids, activation, biases)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_experts_without_tokens_and_one_expert_for_all():
    x, gate_up, down, weights, _, _ = _case(5, 4, 1, 3, False)
    ids = torch.full((5, 1), 2)  # experts 0, 1 and 3 get nothing
    torch.testing.assert_close(grouped_moe(x, gate_up, down, weights, ids, _silu_mul),
                               fused_moe(x, gate_up, down, weights, ids), rtol=1e-5, atol=1e-5)


def test_only_cuda_bfloat16_takes_the_grouped_path_in_the_engine():
    x, gate_up, down, *_ = _case(2, 4, 1, 0, False)
    assert not can_group(x, gate_up, down) and not can_group(x.bfloat16(), gate_up.bfloat16(), down.bfloat16())


@pytest.mark.parametrize("has_bias", [False, True])
def test_pairs_of_other_ranks_experts_are_skipped_as_in_the_loop(has_bias):
    """Expert parallelism: a rank holding experts 4..7 of 8 sees ids 0..3 as 4 (local_expert_ids)."""
    from llmserve.model.moe_parallel import local_expert_ids

    x, gate_up, down, weights, ids, biases = _case(9, 8, 2, 5, has_bias)
    local = local_expert_ids(ids, (4, 4))
    held = (gate_up[4:], down[4:])
    held_biases = None if biases is None else (biases[0][4:], biases[1][4:])
    activation = ClampedSwiglu(alpha=1.702, limit=0.5) if has_bias else _silu_mul
    want = fused_moe(x, *held, weights, local, held_biases, activation if has_bias else None)
    got = grouped_moe(x, *held, weights, local, activation, held_biases)
    assert bool((local == 4).any()) and bool((local < 4).any())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
