"""All-to-all dispatch for expert parallelism (model/moe_dispatch.py): which rank owns which tokens and
experts, and 3 gloo ranks' MoE blocks (uneven experts 3/3/2) giving the whole block's output for step sizes
with fewer tokens than ranks, uneven token shares, and expert biases."""


import pytest
import torch
from gloo_ranks import run_ranks

from llmserve.model.moe import MoeSpec, SparseMoeBlock
from llmserve.model.moe_dispatch import owner_ranks, token_slice
from llmserve.model.moe_parallel import expert_range

HIDDEN, INTER, EXPERTS, RANKS = 32, 16, 8, 3
TOKEN_COUNTS = (1, 2, 11)


def test_tokens_and_experts_go_to_ranks_in_contiguous_runs():
    assert [token_slice(7, 3, r) for r in range(3)] == [(0, 3), (3, 2), (5, 2)]
    assert [token_slice(1, 3, r) for r in range(3)] == [(0, 1), (1, 0), (1, 0)]  # ranks without tokens
    ids = torch.arange(8)
    assert owner_ranks(ids, 8, 3).tolist() == [0, 0, 0, 1, 1, 1, 2, 2]  # expert_range's 3, 3, 2


def _whole_block(has_bias: bool) -> SparseMoeBlock:
    spec = MoeSpec(EXPERTS, 2, INTER, is_renormalized=True, has_bias=has_bias)
    block = SparseMoeBlock(HIDDEN, spec)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return block


def _inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(n, HIDDEN, generator=gen) for n in TOKEN_COUNTS]


def _rank_main(rank: int, port: int, bias_cases: tuple[bool, ...], results) -> None:
    """This rank's outputs for each has_bias case, one after another in one process group."""
    import torch.distributed as dist

    from llmserve.model.parallel import TensorParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    try:
        got = []
        for has_bias in bias_cases:
            whole = _whole_block(has_bias)
            tp = TensorParallel(rank, RANKS, is_expert_parallel=True, all2all_backend="all2allv")
            first, count = held = expert_range(EXPERTS, RANKS, rank)
            part = SparseMoeBlock(HIDDEN, whole.spec, tp, held_experts=held)
            assert part.is_all_to_all
            with torch.no_grad():
                part.gate.load_state_dict(whole.gate.state_dict())
                for name, param in part.experts.named_parameters():
                    param.copy_(getattr(whole.experts, name)[first:first + count])
                got.append([part(x).tolist() for x in _inputs()])
        results.put((rank, got))
    finally:
        dist.destroy_process_group()


BIAS_CASES = (False, True)


@pytest.fixture(scope="module")
def ranked() -> dict[bool, dict[int, list]]:
    """Both cases on one set of spawned gloo ranks (a spawn costs each rank a torch import):
    has_bias -> rank -> outputs."""
    got = dict(run_ranks(_rank_main, RANKS, lambda rank, port, results: (rank, port, BIAS_CASES, results),
                         timeout=120))
    return {has_bias: {rank: got[rank][i] for rank in range(RANKS)} for i, has_bias in enumerate(BIAS_CASES)}


@pytest.mark.parametrize("has_bias", BIAS_CASES)
def test_three_ranks_dispatching_rows_give_the_whole_blocks_output(ranked, has_bias):
    got = ranked[has_bias]
    whole = _whole_block(has_bias)
    with torch.no_grad():
        expected = [whole(x) for x in _inputs()]
    for rank in range(RANKS):
        for out, want in zip(got[rank], expected, strict=True):
            torch.testing.assert_close(torch.tensor(out), want, atol=1e-5, rtol=1e-5)
