"""The sampler's CPU draw over whole rows (model/csrc/sampling_rows.cpp): the race on the same noise draws what the
torch ops draw; inverse CDF follows the filtered distribution, top-p redrawing above a token outside the nucleus
and min-p applied after the nucleus of the whole distribution."""

import pytest
import torch
from sampler_stats import chi2

from llmserve.model import cpu_kernels
from llmserve.sample import Sampler, build_sampling_metadata, ops
from llmserve.sample.metadata import PositionRow as Row
from llmserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernels not built")

CHI2_BOUND = 20.0  # at most 4 degrees of freedom below: exceeded with probability < 5e-4 by a correct sampler


def _uniforms(num_rows: int, *values: float) -> torch.Tensor:
    """[B, 64] uniforms: the given first ones, then 0.5."""
    u = torch.full((num_rows, 64), 0.5)
    u[:, :len(values)] = torch.tensor(values)
    return u


@pytest.mark.parametrize("seed", range(3))
def test_the_race_on_seeded_noise_draws_what_the_torch_ops_draw(seed):
    gen = torch.Generator().manual_seed(seed)
    num_rows, vocab = 48, 3000
    logits = torch.randn(num_rows, vocab, generator=gen) * [1.0, 3.0, 8.0][seed]
    logits[0, 100:] = float("-inf")
    temperature = torch.rand(num_rows, generator=gen) * 1.5 + 0.1
    top_p = torch.where(torch.rand(num_rows, generator=gen) < 0.2, 1.0, torch.rand(num_rows, generator=gen))
    min_p = torch.where(torch.rand(num_rows, generator=gen) < 0.5, 0.0, torch.rand(num_rows, generator=gen) * 0.3)
    noise = torch.empty(num_rows, vocab).uniform_(torch.finfo(torch.float32).tiny, 1.0, generator=gen)
    x = logits.clone().div_(temperature.unsqueeze(1))
    ops.apply_top_k_top_p_sorted(x, None, top_p)
    ops.apply_min_p(x, min_p)
    expected = x.softmax(dim=-1).div_(noise.log()).argmin(dim=-1)  # ops.exponential_race on this noise
    ours = cpu_kernels.sample_rows(logits.clone(), temperature, top_p, min_p, _uniforms(num_rows), noise,
                                   torch.ones(num_rows, dtype=torch.bool), None)
    assert torch.equal(ours, expected)
    assert len(set(ours.tolist())) > 1


def test_inverse_cdf_redraws_above_a_token_outside_the_nucleus():
    # weights [0.3, 0.25, 0.2, 0.15, 0.1]: at top_p 0.5 the nucleus is tokens 0 and 1
    logits = torch.tensor([[0.3, 0.25, 0.2, 0.15, 0.1]]).log().repeat(3, 1)
    one = torch.ones(3)
    top_p = torch.tensor([0.5, 0.5, 1.0])
    # row 0: 0.95 draws token 4 (outside the nucleus), then 0.95 of tokens 0-3 token 3, of tokens 0-2 token 2 (all
    # outside), then 0.95 of tokens 0-1: token 1. Row 1: 0.2 draws token 0 at once; row 2 (no top-p): 0.95, token 4
    u = torch.cat([_uniforms(1, 0.95, 0.95, 0.95, 0.95), _uniforms(1, 0.2), _uniforms(1, 0.95)])
    assert cpu_kernels.sample_rows(logits, one, top_p, None, u, None, None, None).tolist() == [1, 0, 4]


def test_min_p_filters_the_nucleus_of_the_whole_distribution():
    # token 2 has 0.61 above it: in the nucleus at 0.65; min-p 0.9 keeps it (0.29 >= 0.9 x 0.31); 0.95 does not
    logits = torch.tensor([[0.31, 0.30, 0.29, 0.10]]).log().repeat(3, 1)
    u = _uniforms(3, 0.99, 0.99)  # row 0 draws token 3 first (outside the nucleus), then token 2
    min_p = torch.tensor([0.0, 0.9, 0.95])
    drawn = cpu_kernels.sample_rows(logits, torch.ones(3), torch.full((3,), 0.65), min_p, u, None, None, None)
    assert drawn.tolist() == [2, 2, 1]


def test_greedy_rows_are_left_to_the_argmax_and_a_masked_row_draws_token_0():
    logits = torch.randn(3, 50)
    logits[2] = float("-inf")
    is_greedy = torch.tensor([True, False, False])
    drawn = cpu_kernels.sample_rows(logits, torch.ones(3), None, None, _uniforms(3), None, None, is_greedy)
    assert drawn[0] == 0 and drawn[2] == 0


@pytest.mark.parametrize(("params", "expected"), [
    (SamplingParams(top_p=0.5), [0.3, 0.25, 0, 0, 0]),
    (SamplingParams(top_p=0.7, temperature=2.0), None),
    (SamplingParams(top_p=0.8, min_p=0.6), [0.3, 0.25, 0.2, 0, 0]),
], ids=["top_p", "t2+top_p", "top_p+min_p"])
def test_a_batch_through_the_sampler_follows_the_filtered_distribution(params, expected):
    probs = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1])
    if expected is None:  # temperature 2: weights sqrt(p), nucleus from their normalisation
        w = probs.sqrt() / probs.sqrt().sum()
        mass_above = torch.cat([torch.zeros(1), w.cumsum(0)[:-1]])
        expected = torch.where(mass_above < 0.7, w, 0.0)
    num_rows = 4000
    # one greedy row and one top-k row ride along: not every random row has a top-k, so the rows path draws
    rows = [Row(params)] * num_rows + [Row(SamplingParams(temperature=0.0)), Row(SamplingParams(top_k=1))]
    logits = probs.log().repeat(num_rows + 2, 1)
    meta = build_sampling_metadata(rows, 5, "cpu")
    tokens = Sampler(torch.Generator().manual_seed(3))(logits, meta).sampled_token_ids
    assert tokens[-2:].tolist() == [0, 0]
    assert chi2(torch.bincount(tokens[:num_rows], minlength=5), torch.as_tensor(expected)) < CHI2_BOUND
