"""Top-p without a sort (sample/triton_nucleus.py): the same tokens as the sorted path from the same noise, and
the nucleus kept when the whole vocabulary's race is won outside it. On CUDA the kernel runs compiled;
elsewhere through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # without CUDA, conftest.py set TRITON_INTERPRET=1 before anything imported it

from llmserve.sample import Sampler, build_sampling_metadata, ops  # noqa: E402
from llmserve.sample.metadata import PositionRow as Row  # noqa: E402
from llmserve.sample.triton_nucleus import nucleus_race  # noqa: E402
from llmserve.sampling_params import SamplingParams  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROWS = [Row(SamplingParams(temperature=0.6, top_p=0.9)),
        Row(SamplingParams(temperature=1.0, top_p=0.5), generator=torch.Generator()),
        Row(SamplingParams(temperature=0.0)),  # greedy rows ride along
        Row(SamplingParams(temperature=1.3, top_p=0.97, min_p=0.02)),
        Row(SamplingParams(temperature=2.0, top_p=0.3)),  # flat: the first race is often won outside
        Row(SamplingParams(temperature=1.0)),  # no top-p in a batch that has it
        Row(SamplingParams(temperature=0.8, top_p=0.8, min_p=0.1), generator=torch.Generator())]


def _seed(rows: list[Row], seed: int) -> None:
    for i, row in enumerate(rows):
        if row.generator is not None:
            row.generator = torch.Generator(DEVICE).manual_seed(seed + i)


def _kernel_draw(logits: torch.Tensor, rows: list[Row], seed: int) -> list[int]:
    _seed(rows, seed)
    meta = build_sampling_metadata(rows, logits.shape[1], DEVICE)
    sampler = Sampler(torch.Generator(DEVICE).manual_seed(seed), nucleus_kernel=True)
    return sampler(logits.clone(), meta).sampled_token_ids.tolist()


def _sorted_draw(logits: torch.Tensor, rows: list[Row], seed: int) -> list[int]:
    """The top-p mask and the race over the whole vocabulary, in torch, from the same generator states."""
    _seed(rows, seed)
    meta = build_sampling_metadata(rows, logits.shape[1], DEVICE)
    probs = Sampler.probs(logits.clone(), meta)
    sampled = ops.exponential_race(probs, meta.generators, torch.Generator(DEVICE).manual_seed(seed))
    return torch.where(meta.is_greedy, logits.argmax(dim=-1), sampled).tolist()


@pytest.mark.parametrize("seed", range(3))
def test_the_kernel_draws_the_sorted_paths_tokens_from_the_same_noise(seed):
    gen = torch.Generator().manual_seed(seed)
    rows = ROWS * 3
    logits = (torch.randn(len(rows), 3000, generator=gen) * 3).to(DEVICE)
    logits[0, :1500] = float("-inf")  # a logit_bias or grammar mask
    kernel, sorted_path = _kernel_draw(logits, rows, seed), _sorted_draw(logits, rows, seed)
    assert kernel == sorted_path
    assert kernel[2] == int(logits[2].argmax())


def test_a_race_won_outside_the_nucleus_runs_again_above_the_winner():
    logits = torch.zeros(3, 100, device=DEVICE)
    logits[:, 0], logits[:, 1] = 8.0, 7.5  # the nucleus at top_p 0.5 is token 0; at 0.9, tokens 0 and 1
    noise = torch.full((3, 100), 0.5, device=DEVICE)
    noise[:, 37] = 1 - 1e-7  # E ~ 1e-7: token 37 wins the whole vocabulary's race by far
    noise[2, 1] = 1 - 1e-6  # row 2: then token 1, in the nucleus at 0.9
    top_p = torch.tensor([0.5, 1.0, 0.9], device=DEVICE)
    assert nucleus_race(logits, noise, top_p, block=64).tolist() == [0, 37, 1]


def test_min_p_filters_the_nucleus_of_the_whole_distribution():
    # Token 2 has 0.61 above it: in the nucleus at top_p 0.65. Min-p 0.9 keeps it (0.29 >= 0.9 x 0.31), and it
    # stays drawn: the nucleus is not taken again over the 0.9 that min-p leaves (0.61 / 0.9 >= 0.65).
    logits = torch.tensor([0.31, 0.30, 0.29, 0.10], device=DEVICE).log().repeat(3, 1)
    noise = torch.full((3, 4), 0.5, device=DEVICE)
    noise[:, 2] = 1 - 1e-7  # token 2 wins unless filtered
    top_p = torch.full((3,), 0.65, device=DEVICE)
    min_p = torch.tensor([0.0, 0.9, 0.95], device=DEVICE)  # row 2 keeps tokens 0 and 1 alone
    assert nucleus_race(logits, noise, top_p, min_p, block=16).tolist() == [2, 2, 0]


def test_a_row_with_one_token_left_draws_it():
    logits = torch.full((4, 200), float("-inf"), device=DEVICE)
    logits[:, 123] = 0.0
    noise = torch.rand(4, 200, device=DEVICE).clamp_(min=1e-30)
    assert nucleus_race(logits, noise, torch.full((4,), 0.2, device=DEVICE), block=64).tolist() == [123] * 4


def test_the_sampler_takes_the_kernel_on_cuda_alone():
    logits = torch.zeros(1, 8, device=DEVICE)
    assert Sampler()._has_nucleus_kernel(logits) == (DEVICE.type == "cuda")
