"""Sampler: exact effects of each parameter on a small vocabulary, metadata fast paths, logprobs."""

import pytest
import torch

from llmserve.sample.metadata import PositionRow as Row
from llmserve.sampling_params import SamplingParams
from llmserve.sample import Sampler, build_sampling_metadata
from llmserve.sample.sampler import process_logits

V = 12


def sample(logits: torch.Tensor, rows: list[Row], seed: int = 0):
    meta = build_sampling_metadata(rows, logits.shape[1], "cpu")
    return Sampler(torch.Generator().manual_seed(seed))(logits.clone(), meta)


def random_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, V, generator=torch.Generator().manual_seed(seed)) * 3  # [B, V]


def test_greedy_is_argmax():
    logits = random_logits(16)
    out = sample(logits, [Row(SamplingParams(temperature=0.0)) for _ in range(16)])
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids.dtype == torch.int64 and out.logprobs is None


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    logits = random_logits(8)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_p=0.9)] * 4
    out = sample(logits, [Row(p) for p in params])
    assert torch.equal(out.sampled_token_ids[0::2], logits[0::2].argmax(dim=-1))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=2.0, top_k=1, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=1e-6),
    SamplingParams(temperature=1.0, min_p=1.0),
    SamplingParams(temperature=1e-4),
], ids=["top_k=1", "top_k=1+top_p", "top_p=tiny", "min_p=1", "temperature=tiny"])
def test_filters_that_keep_one_token_equal_greedy(params):
    logits = random_logits(32)
    rows = [Row(params) for _ in range(16)] + [Row(SamplingParams(top_k=5)) for _ in range(16)]
    out = sample(logits, rows)
    assert torch.equal(out.sampled_token_ids[:16], logits[:16].argmax(dim=-1))


def many_draws(probs: list[float], params: SamplingParams, num_rows: int = 2000) -> torch.Tensor:
    """Sample num_rows rows sharing one distribution; returns the token counts [len(probs)]."""
    logits = torch.tensor(probs).log().repeat(num_rows, 1)  # [num_rows, V]
    out = sample(logits, [Row(params) for _ in range(num_rows)])
    return torch.bincount(out.sampled_token_ids, minlength=len(probs))


PROBS = [0.5, 0.3, 0.15, 0.05]


@pytest.mark.parametrize(("params", "kept"), [
    (SamplingParams(top_k=2), {0, 1}),
    (SamplingParams(top_k=3, top_p=0.99), {0, 1, 2}),
    (SamplingParams(top_p=0.7), {0, 1}),  # the tokens above 0.15 hold 0.8 >= 0.7
    (SamplingParams(top_p=0.85), {0, 1, 2}),
    (SamplingParams(min_p=0.35), {0, 1}),  # threshold 0.175
    (SamplingParams(top_p=0.99, min_p=0.2), {0, 1, 2}),  # min_p is relative: threshold 0.1
])
def test_filters_keep_exactly_the_expected_tokens(params, kept):
    counts = many_draws(PROBS, params)
    assert {i for i, c in enumerate(counts.tolist()) if c > 0} == kept


def test_logit_bias_forces_or_bans_a_token():
    logits = random_logits(4)
    weakest = logits.argmin(dim=-1).tolist()
    rows = [Row(SamplingParams(temperature=t, logit_bias={w: 100.0})) for t, w in zip([0, 1, 0, 1], weakest)]
    assert sample(logits, rows).sampled_token_ids.tolist() == weakest
    best = logits.argmax(dim=-1).tolist()
    rows = [Row(SamplingParams(temperature=0, logit_bias={b: -100.0})) for b in best]
    second = logits.topk(2, dim=-1).indices[:, 1]
    assert torch.equal(sample(logits, rows).sampled_token_ids, second)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masks_stop_ids_until_reached(temperature):
    logits = torch.zeros(1, V)
    logits[0, 3] = 50.0  # eos: by far the most likely
    logits[0, 5] = 40.0  # a stop token id
    def row(num_output):
        return Row(SamplingParams(temperature=temperature, min_tokens=3), output_token_ids=[7] * num_output,
                   stop_token_ids_for_min_tokens=[3, 5])
    for num_output in range(3):
        token = sample(logits, [row(num_output)]).sampled_token_ids.item()
        assert token not in (3, 5)
    assert sample(logits, [row(3)]).sampled_token_ids.item() == 3


def test_penalties_match_a_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0, 3.0]])  # [1, 6]
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    row = Row(params, prompt_token_ids=[0, 1], output_token_ids=[2, 3, 3, 0])
    expected = [
        2.0 / 2 - 0.5 * 1 - 0.25,  # prompt and output once: repetition divides the positive logit
        -1.0 * 2,  # prompt only: repetition multiplies the negative logit, no frequency/presence
        0.5 / 2 - 0.5 * 1 - 0.25,
        -0.5 * 2 - 0.5 * 2 - 0.25,  # twice in the output
        1.0,
        3.0,
    ]
    plain = Row(SamplingParams())
    batch = torch.cat([logits, logits])  # row 1 has no penalties and stays as is
    process_logits(batch, build_sampling_metadata([plain, row], 6, "cpu"))
    assert torch.allclose(batch[1], torch.tensor(expected))
    assert torch.equal(batch[0], logits[0])


def _dense_penalties(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """The penalties by definition, one row and one vocabulary entry at a time."""
    out = logits.clone()
    for i, row in enumerate(rows):
        p = row.params
        for token in range(logits.shape[1]):
            value = float(out[i, token])
            if token in row.prompt_token_ids or token in row.output_token_ids:
                value = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
            count = row.output_token_ids.count(token)
            out[i, token] = value - p.frequency_penalty * count - p.presence_penalty * (count > 0)
    return out


@pytest.mark.parametrize("seed", range(3))
def test_penalties_on_seen_tokens_match_the_definition(seed):
    rng = torch.Generator().manual_seed(seed)
    vocab = 40

    def ids(max_len):
        return torch.randint(0, vocab, (int(torch.randint(0, max_len, (1,), generator=rng)),), generator=rng).tolist()
    rows = [Row(SamplingParams(repetition_penalty=1.3), prompt_token_ids=ids(12) or [1], output_token_ids=ids(9)),
            Row(SamplingParams(), prompt_token_ids=[1, 2], output_token_ids=[2]),  # no penalties
            Row(SamplingParams(frequency_penalty=0.4, presence_penalty=0.3), prompt_token_ids=[5], output_token_ids=[]),
            Row(SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.2), prompt_token_ids=ids(12) or [3],
                output_token_ids=ids(20) + [7, 7, 7]),
            Row(SamplingParams(presence_penalty=1.0), prompt_token_ids=[0], output_token_ids=ids(5) + [0])]
    logits = torch.randn(len(rows), vocab, generator=rng) * 3
    batch = logits.clone()
    process_logits(batch, build_sampling_metadata(rows, vocab, "cpu"))
    assert torch.allclose(batch, _dense_penalties(logits, rows))


def test_repetition_penalty_below_one_boosts_seen_tokens():
    logits = torch.tensor([[2.0, -1.0, 1.9]])
    row = Row(SamplingParams(temperature=0, repetition_penalty=0.5), output_token_ids=[2])
    assert sample(logits, [row]).sampled_token_ids.item() == 2  # 1.9 / 0.5 = 3.8 > 2


def test_logprobs_are_from_the_raw_distribution():
    logits = random_logits(6)
    params = [SamplingParams(temperature=0.7, top_k=3, logprobs=4, repetition_penalty=1.5, logit_bias={1: 5.0}),
              SamplingParams(temperature=0, logprobs=1), SamplingParams()] * 2
    rows = [Row(p, prompt_token_ids=[1, 2]) for p in params]
    out = sample(logits, rows)
    raw = logits.log_softmax(dim=-1)
    lp = out.logprobs
    assert lp.token_ids.shape == (6, 5) and lp.logprobs.shape == (6, 5)
    assert torch.equal(lp.token_ids[:, 0], out.sampled_token_ids)
    assert torch.allclose(lp.logprobs, raw.gather(1, lp.token_ids))
    assert torch.equal(lp.token_ids[:, 1:], raw.topk(4, dim=-1).indices)
    order = raw.argsort(dim=-1, descending=True)  # [B, V]
    ranks = (order == out.sampled_token_ids.unsqueeze(1)).int().argmax(dim=-1) + 1
    assert torch.equal(lp.sampled_ranks, ranks)


def test_logprobs_zero_returns_only_the_sampled_token():
    logits = random_logits(2)
    out = sample(logits, [Row(SamplingParams(temperature=0, logprobs=0))] * 2)
    assert out.logprobs.token_ids.shape == (2, 1)
    assert torch.equal(out.logprobs.sampled_ranks, torch.ones(2, dtype=torch.int64))


def test_metadata_of_plain_batches_has_nothing_to_do():
    greedy = build_sampling_metadata([Row(SamplingParams(temperature=0, top_p=0.5, top_k=3))] * 4, V, "cpu")
    assert greedy.all_greedy and greedy.temperature is None and greedy.no_top_k and greedy.no_top_p
    assert greedy.no_min_p and greedy.no_penalties and greedy.sparse_bias_indices is None
    assert greedy.max_num_logprobs is None and not greedy.generators
    rows = [Row(SamplingParams(temperature=0.8, top_p=0.95, top_k=-1), generator=torch.Generator())] * 2
    plain = build_sampling_metadata(rows + [Row(SamplingParams(min_tokens=2), output_token_ids=[1, 2])], V, "cpu")
    assert plain.all_random and plain.is_greedy is None and plain.no_top_k and not plain.no_top_p
    assert plain.sparse_bias_indices is None and plain.no_penalties and set(plain.generators) == {0, 1}


def test_metadata_top_k_uses_vocab_size_where_off():
    params = [SamplingParams(top_k=3), SamplingParams(top_k=0), SamplingParams(top_k=V + 5),
              SamplingParams(temperature=0, top_k=2)]
    meta = build_sampling_metadata([Row(p) for p in params], V, "cpu")
    assert meta.top_k.tolist() == [3, V, V, V] and meta.max_top_k == 3
    assert meta.is_greedy.tolist() == [False, False, False, True]
