"""The sampler's CPU ops (model/csrc/sampling_ops.cpp): penalties bit for bit the torch ops' result, top-k the k
largest in torch.topk's order with ties by the lower id."""

import random

import pytest
import torch

from llmserve.model import cpu_kernels
from llmserve.sample import build_sampling_metadata, ops
from llmserve.sample.metadata import PositionRow as Row
from llmserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernels not built")


def _rows(rng: random.Random, vocab: int) -> list[Row]:
    def ids(max_len: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(rng.randint(0, max_len))]
    choices = [SamplingParams(repetition_penalty=rng.choice([1.0, 1.05, 1.3, 0.8]),
                              frequency_penalty=rng.choice([0.0, 0.4, -0.2]),
                              presence_penalty=rng.choice([0.0, 0.3, 1.0])) for _ in range(8)]
    return [Row(p, prompt_token_ids=ids(300) or [1], output_token_ids=ids(200) + [7] * rng.randint(0, 3))
            for p in choices]


@pytest.mark.parametrize("seed", range(6))
def test_penalties_op_gives_the_torch_ops_bits(seed):
    rng, vocab = random.Random(seed), [50, 1000, 49152][seed % 3]
    rows = _rows(rng, vocab)
    meta = build_sampling_metadata(rows, vocab, "cpu")
    assert meta.penalties is not None
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed)) * 4
    logits[0, :5] = torch.tensor([float("-inf"), float("inf"), 0.0, -0.0, float("nan")])
    ours, theirs = logits.clone(), logits.clone()
    ops.apply_penalties(ours, meta.penalties)  # the C++ op on CPU
    ops.apply_penalties_torch(theirs, meta.penalties)
    assert torch.equal(ours.nan_to_num(nan=123.0), theirs.nan_to_num(nan=123.0))
    assert not torch.equal(ours, logits.nan_to_num(nan=123.0))  # it did penalise


def test_penalties_op_reads_a_view_of_the_buffers_rows():
    """Output ids as the runner keeps them: a view of some rows of a wider padded buffer."""
    vocab = 30
    buffer = torch.full((4, 16), vocab, dtype=torch.int64)
    buffer[1, :3] = torch.tensor([4, 4, 9])
    buffer[2, :1] = torch.tensor([5])
    rows = [Row(SamplingParams(frequency_penalty=0.5), output_token_ids=[4, 4, 9]),
            Row(SamplingParams(presence_penalty=0.25), output_token_ids=[5])]
    meta = build_sampling_metadata(rows, vocab, "cpu").penalties
    meta.output_token_ids = buffer[1:3]
    logits = torch.randn(2, vocab)
    ours, theirs = logits.clone(), logits.clone()
    ops.apply_penalties(ours, meta)
    ops.apply_penalties_torch(theirs, meta)
    assert torch.equal(ours, theirs)
    assert ours[0, 4] == logits[0, 4] - 1.0 and ours[1, 5] == logits[1, 5] - 0.25


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("k", [1, 20, 333])
def test_top_k_rows_match_torch_topk(k, num_threads):
    logits = torch.randn(7, 4099, generator=torch.Generator().manual_seed(k))  # not a multiple of 8
    logits[3] = float("-inf")
    logits[3, 100:100 + k // 2] = 1.0
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        values, ids = cpu_kernels.top_k_rows(logits, k)
    finally:
        torch.set_num_threads(previous)
    expected_values, expected_ids = logits.topk(k, dim=-1)
    assert torch.equal(values, expected_values)
    distinct = [r for r in range(7) if r != 3]
    assert torch.equal(ids[distinct], expected_ids[distinct])  # no ties there: the same ids
    assert torch.equal(logits.gather(1, ids), values)


def test_top_k_rows_break_ties_by_the_lower_id_and_rank_nan_first():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, float("nan"), 3.0, 0.0, 3.0, 3.0, -1.0]])
    values, ids = cpu_kernels.top_k_rows(logits, 4)
    assert ids.tolist() == [[5, 1, 2, 4]]
    assert values[0, 0].isnan() and values[0, 1:].tolist() == [3.0, 3.0, 3.0]
    values, ids = cpu_kernels.top_k_rows(logits, 11)  # k == V: the whole row in order
    assert ids.tolist() == [[5, 1, 2, 4, 6, 8, 9, 3, 0, 7, 10]]


def test_top_k_rows_refuse_what_they_cannot_take():
    with pytest.raises(RuntimeError, match="k must be"):
        cpu_kernels.top_k_rows(torch.randn(2, 5), 6)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.top_k_rows(torch.randn(2, 5).double(), 2)


def _torch_candidates_draw(cand_logits, cand_ids, noise, temperature, top_k, top_p, min_p):
    """The sampler's torch candidates path after its top-k (sample/sampler.py)."""
    x = cand_logits.clone().div_(temperature.unsqueeze(1))
    if top_k is not None:
        ops.apply_top_k_sorted(x, top_k)
    if top_p is not None:
        ops.apply_top_p_sorted(x, top_p)
    if min_p is not None:
        ops.apply_min_p(x, min_p)
    return ops.exponential_race_on_candidates(x.softmax(dim=-1), cand_ids, noise.clone())


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("filters", ["top_k", "top_k+top_p", "top_k+min_p", "all"])
def test_candidates_op_draws_what_the_torch_ops_draw(seed, filters):
    """Same candidates, same noise: the same tokens, row by row (rounding apart, which no case here is near)."""
    gen = torch.Generator().manual_seed(seed)
    num_rows, vocab, k = 64, 3000, 40
    logits = torch.randn(num_rows, vocab, generator=gen) * [0.5, 2.0, 6.0, 12.0][seed]
    cand_logits, cand_ids = cpu_kernels.top_k_rows(logits, k)
    noise = torch.empty(num_rows, k).uniform_(torch.finfo(torch.float32).tiny, 1.0, generator=gen)
    temperature = torch.rand(num_rows, generator=gen) * 1.5 + 0.1
    top_k = torch.randint(1, k + 1, (num_rows,), generator=gen)
    top_p = torch.where(torch.rand(num_rows, generator=gen) < 0.2, 1.0, torch.rand(num_rows, generator=gen))
    min_p = torch.where(torch.rand(num_rows, generator=gen) < 0.3, 0.0, torch.rand(num_rows, generator=gen) * 0.3)
    args = (temperature, top_k, top_p if "top_p" in filters or filters == "all" else None,
            min_p if "min_p" in filters or filters == "all" else None)
    ours = cpu_kernels.sample_candidates(cand_logits, cand_ids, noise, *args)
    assert torch.equal(ours, _torch_candidates_draw(cand_logits, cand_ids, noise, *args))
    assert len(set(ours.tolist())) > 1


def test_candidates_op_keeps_ties_at_the_kth_value_and_the_best_token():
    cand_logits, cand_ids, one = torch.tensor([[4.0, 3.0, 3.0, 1.0]]), torch.tensor([[10, 11, 12, 13]]), torch.ones(1)
    top_2 = torch.tensor([2])
    noise = torch.tensor([[0.01, 0.01, 0.9999, 0.01]])  # the tie at the 2nd value wins where it is kept
    assert int(cpu_kernels.sample_candidates(cand_logits, cand_ids, noise, one, top_2, None, None)) == 12
    noise = torch.tensor([[0.01, 0.01, 0.01, 0.9999]])  # the token below it would win, were it kept
    assert int(cpu_kernels.sample_candidates(cand_logits, cand_ids, noise, one, top_2, None, None)) == 10
    noise = torch.tensor([[0.01, 0.9999, 0.9999, 0.9999]])
    assert int(cpu_kernels.sample_candidates(cand_logits, cand_ids, noise, one, None, torch.tensor([1e-6]),
                                             None)) == 10  # a tiny top_p: the best token alone
