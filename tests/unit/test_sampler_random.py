"""Sampler randomness: drawn frequencies match the processed distribution; seeds reproduce."""

import pytest
import torch
from sampler_stats import chi2

from llmserve.sample.metadata import PositionRow as Row
from llmserve.sampling_params import SamplingParams
from llmserve.sample import Sampler, build_sampling_metadata

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
CHI2_BOUND = 20.0  # 3 degrees of freedom: exceeded with probability ~2e-4 by a correct sampler


def draw(logits: torch.Tensor, rows: list[Row], sampler: Sampler) -> torch.Tensor:
    meta = build_sampling_metadata(rows, logits.shape[1], "cpu")
    return sampler(logits.clone(), meta).sampled_token_ids


@pytest.mark.parametrize(("params", "expected"), [
    (SamplingParams(temperature=1.0), PROBS),
    (SamplingParams(temperature=0.5), PROBS**2),
    (SamplingParams(temperature=2.0), PROBS**0.5),
    (SamplingParams(top_k=2), torch.tensor([0.5, 0.3, 0, 0])),
    (SamplingParams(top_p=0.85), torch.tensor([0.5, 0.3, 0.15, 0])),
    (SamplingParams(temperature=0.5, top_k=3, top_p=0.9), torch.tensor([0.25, 0.09, 0, 0])),
    (SamplingParams(min_p=0.2), torch.tensor([0.5, 0.3, 0.15, 0])),
], ids=["t1", "t0.5", "t2", "top_k", "top_p", "t+top_k+top_p", "min_p"])
def test_unseeded_draws_follow_the_processed_distribution(params, expected):
    num_rows = 4000
    logits = PROBS.log().repeat(num_rows, 1)  # [num_rows, 4]
    tokens = draw(logits, [Row(params)] * num_rows, Sampler(torch.Generator().manual_seed(1)))
    assert chi2(torch.bincount(tokens, minlength=4), expected) < CHI2_BOUND


def test_seeded_draws_follow_the_distribution():
    num_rows = 2000
    logits = PROBS.log().repeat(num_rows, 1)
    rows = [Row(SamplingParams(seed=i), generator=torch.Generator().manual_seed(i)) for i in range(num_rows)]
    tokens = draw(logits, rows, Sampler())
    assert chi2(torch.bincount(tokens, minlength=4), PROBS) < CHI2_BOUND


def seeded_row(seed: int, params: SamplingParams) -> Row:
    return Row(params, generator=torch.Generator().manual_seed(seed))


def run_steps(position: int, mates: list[Row], row: Row, num_steps: int = 6) -> list[int]:
    """Sample `row` at `position` among `mates` for several steps; its logits are the same each run."""
    row_logits = torch.randn(num_steps, 50, generator=torch.Generator().manual_seed(123))  # [steps, 50]
    sampler = Sampler(torch.Generator().manual_seed(len(mates)))
    tokens = []
    for step in range(num_steps):
        rows = mates[:position] + [row] + mates[position:]
        logits = torch.randn(len(rows), 50) * 4  # [B, 50], mates' logits differ from run to run
        logits[position] = row_logits[step]
        tokens.append(draw(logits, rows, sampler)[position].item())
    return tokens


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9), SamplingParams(top_k=20, min_p=0.01)])
def test_same_seed_same_tokens_whatever_the_batch(params):
    alone = run_steps(0, [], seeded_row(42, params))
    mates = [Row(SamplingParams()), seeded_row(7, params), Row(SamplingParams(temperature=0)),
             Row(SamplingParams(top_p=0.9, top_k=5, repetition_penalty=1.2), output_token_ids=[1, 2])]
    assert run_steps(3, mates, seeded_row(42, params)) == alone
    assert run_steps(1, mates[:2], seeded_row(42, params)) == alone


def test_different_seeds_give_different_tokens():
    logits = torch.zeros(2, 1000)  # uniform: two seeds agree 8 times running with probability 1e-24
    rows = [seeded_row(1, SamplingParams()), seeded_row(2, SamplingParams())]
    tokens = torch.stack([draw(logits, rows, Sampler()) for _ in range(8)])  # [8, 2]
    assert not torch.equal(tokens[:, 0], tokens[:, 1])


def test_unseeded_rows_use_the_sampler_generator():
    logits = torch.zeros(16, 1000)
    rows = [Row(SamplingParams())] * 16
    first = draw(logits, rows, Sampler(torch.Generator().manual_seed(5)))
    again = draw(logits, rows, Sampler(torch.Generator().manual_seed(5)))
    other = draw(logits, rows, Sampler(torch.Generator().manual_seed(6)))
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_a_single_remaining_token_is_always_drawn():
    logits = torch.full((3000, 8), float("-inf"))
    logits[:, 5] = 0.0
    tokens = draw(logits, [Row(SamplingParams(top_k=3))] * 3000, Sampler())
    assert torch.all(tokens == 5)


def _draw_both_paths(logits: torch.Tensor, rows: list[Row], seed: int) -> tuple[list[int], list[int]]:
    """Tokens of the candidate-only path and of the full-vocabulary path from the same generator states."""
    results = []
    for is_candidate_path in (True, False):
        for i, row in enumerate(rows):
            if row.generator is not None:
                row.generator.manual_seed(seed + i)
        meta = build_sampling_metadata(rows, logits.shape[1], "cpu")
        assert meta.is_top_k_everywhere
        meta.is_top_k_everywhere = is_candidate_path
        results.append(Sampler(torch.Generator().manual_seed(seed))(logits.clone(), meta).sampled_token_ids.tolist())
    return results[0], results[1]


@pytest.mark.parametrize("seed", range(3))
def test_candidate_path_gives_seeded_rows_the_same_tokens_as_the_full_path(seed):
    """With top-k on every random row, seeded rows draw the same tokens on the candidates as on the whole
    vocabulary (same noise); unseeded rows draw fresh noise for their candidates alone."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(12, 5000, generator=gen) * 3
    rows = [Row(SamplingParams(temperature=0.7, top_k=20, top_p=0.8)),
            Row(SamplingParams(temperature=1.3, top_k=50), generator=torch.Generator()),
            Row(SamplingParams(temperature=0.0)),  # greedy rows ride along
            Row(SamplingParams(temperature=1.0, top_k=7, min_p=0.05), generator=torch.Generator())] * 3
    candidate, full = _draw_both_paths(logits, rows, seed)
    is_seeded_or_greedy = [row.generator is not None or row.params.temperature == 0 for row in rows]
    assert [t for t, keep in zip(candidate, is_seeded_or_greedy) if keep] == \
        [t for t, keep in zip(full, is_seeded_or_greedy) if keep]
    assert candidate[2] == int(logits[2].argmax())
    assert candidate[0] in logits[0].topk(20).indices.tolist()  # unseeded: one of its candidates


def test_candidate_path_only_when_every_random_row_has_top_k():
    rows = [Row(SamplingParams(temperature=0.7, top_k=20)), Row(SamplingParams(temperature=0.7))]
    assert not build_sampling_metadata(rows, 100, "cpu").is_top_k_everywhere
    rows = [Row(SamplingParams(temperature=0.7, top_k=20)), Row(SamplingParams(temperature=0.0))]
    assert build_sampling_metadata(rows, 100, "cpu").is_top_k_everywhere
