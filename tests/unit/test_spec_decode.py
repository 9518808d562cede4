"""Speculative decoding through the engine: exact greedy outputs, seeds, preemption, prefix hits, n > 1,
aborts, opt-out; KV accounting after rejected drafts."""

import json
import warnings

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.bench.spec import SpecCounter

from greedy_check import check_greedy_against_hf
from spec_cases import draft, record_proposals, repeating_prompts, target  # noqa: F401 (fixtures)


def _spec_llm(target: str, draft: str, kind: str, **kwargs) -> LLM:
    extra = {"draft_model": draft} if kind == "draft" else {}
    # the default cache (a share of free memory) takes seconds; every request speculates (the CPU's cap is 2)
    kwargs = {"num_kv_blocks": 1024, "speculative_max_batch": 8, **kwargs}
    return LLM(target, dtype="float32", max_model_len=256, speculative=kind, num_speculative_tokens=3,
               speculative_dynamic=False, **extra, **kwargs)  # every step speculates: the mechanism under test


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [list(c.token_ids) for o in llm.generate(prompts, params) for c in o.outputs]


def _assert_all_free(llm: LLM) -> None:
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks() == llm.engine.scheduler.kv.pool.num_usable_blocks


def _assert_same_greedy(target: str, prompts, got, want) -> None:
    hf = None
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:  # only a logit near-tie may explain it (k + 1 tokens per forward change the float sums)
            if hf is None:
                from transformers import AutoModelForCausalLM

                hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
            assert check_greedy_against_hf(hf, prompts[i % len(prompts)], a) is not None, f"output {i} differs"
            warnings.warn(f"output {i}: speculative and plain differ at a near-tie")


@pytest.fixture(scope="module")
def plain(target):
    return LLM(target, dtype="float32", max_model_len=256, num_kv_blocks=400)


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_greedy_identical_with_preemption_prefix_hits_and_n2(target, draft, plain, kind):
    prompts = repeating_prompts(12, seed=3)
    prompts += [prompts[0][:40] + [7, 8, 9], prompts[0][:40] + [9, 8, 7]]  # prefix hits on prompt 0's blocks
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2)
    want = _tokens(plain, prompts, params)
    llm = _spec_llm(target, draft, kind, num_kv_blocks=24, max_num_batched_tokens=64, speculative_max_batch=16)
    counts = SpecCounter(llm)
    got = _tokens(llm, prompts, params)
    assert llm.num_preemptions > 0, "the small pool was meant to force preemption"
    assert counts.num_accepted > 0 and counts.num_accepted < counts.num_draft_tokens
    _assert_same_greedy(target, [p for p in prompts for _ in range(2)], got, want)
    _assert_all_free(llm)


def test_target_as_its_own_draft_accepts_everything(target, plain):
    llm = _spec_llm(target, target, "draft", num_kv_blocks=200)
    counts = SpecCounter(llm)
    prompts = repeating_prompts(4, seed=5)
    for params in (SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                   SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)):
        llm.generate(prompts, params)
    assert counts.num_draft_tokens > 0 and counts.num_accepted == counts.num_draft_tokens
    _assert_all_free(llm)


def test_a_reduced_draft_vocabulary_drafts_only_its_ids_and_keeps_outputs_exact(target, plain):
    """--draft-vocab-size 256: the target as its own draft with its head cut to the first 256 of 512 ids.
    It drafts only among those (sampled drafts' q is zero elsewhere), so where the target's token lies
    past them the draft is rejected; greedy outputs stay plain decoding's."""
    llm = _spec_llm(target, target, "draft", num_kv_blocks=200, draft_vocab_size=256)
    counts, calls = SpecCounter(llm), record_proposals(llm)
    prompts = repeating_prompts(6, seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    got = _tokens(llm, prompts, greedy)
    assert got == _tokens(plain, prompts, greedy)  # the target as its draft: no float sums differ
    assert max(t for drafts, _ in calls for row in drafts for t in row) < 256
    assert 0 < counts.num_accepted < counts.num_draft_tokens  # the whole head accepts everything (above)
    assert any(t >= 256 for row in got for t in row)
    calls.clear()
    llm.generate(prompts, SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True))
    q = [p for _, probs in calls for p in probs if p is not None]  # [k, V] each
    assert q and all(p[:, 256:].sum() == 0 and torch.allclose(p.sum(dim=1), torch.ones(len(p))) for p in q)
    _assert_all_free(llm)


def test_a_draft_token_map_drafts_only_its_ids(target, plain, tmp_path):
    """--draft-token-map: the head keeps the listed ids (here the upper half of the vocabulary, reversed)."""
    token_map = tmp_path / "map.json"
    token_map.write_text(json.dumps(list(range(511, 255, -1))))
    llm = _spec_llm(target, target, "draft", num_kv_blocks=200, draft_token_map=str(token_map))
    counts, calls = SpecCounter(llm), record_proposals(llm)
    prompts = repeating_prompts(6, seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert _tokens(llm, prompts, greedy) == _tokens(plain, prompts, greedy)
    assert min(t for drafts, _ in calls for row in drafts for t in row) >= 256
    assert 0 < counts.num_accepted < counts.num_draft_tokens
    _assert_all_free(llm)


def test_draft_vocab_size_past_the_vocabulary_is_refused(target):
    with pytest.raises(ValueError, match="--draft-vocab-size: 513 is more than"):
        _spec_llm(target, target, "draft", num_kv_blocks=200, draft_vocab_size=513)
    with pytest.raises(ValueError, match="--draft-vocab-size: only with --speculative draft"):
        _spec_llm(target, target, "ngram", num_kv_blocks=200, draft_vocab_size=64)


def test_seeded_sampling_with_ngram_equals_plain_sampling(target, plain):
    """Point-mass drafts are verified against the sample the target draws anyway: same tokens."""
    llm = _spec_llm(target, None, "ngram", num_kv_blocks=200)
    counts = SpecCounter(llm)
    prompts = repeating_prompts(6, seed=7)
    params = SamplingParams(temperature=0.2, top_p=0.9, max_tokens=30, ignore_eos=True, seed=11,
                            repetition_penalty=1.1, min_tokens=5)
    assert _tokens(llm, prompts, params) == _tokens(plain, prompts, params)
    assert counts.num_accepted > 0
    _assert_all_free(llm)


def test_seeded_sampling_with_a_draft_model_is_reproducible(target, draft):
    prompts = repeating_prompts(4, seed=9)
    params = SamplingParams(temperature=0.9, max_tokens=25, ignore_eos=True, seed=3)
    first = _tokens(_spec_llm(target, draft, "draft", num_kv_blocks=200), prompts, params)
    llm = _spec_llm(target, draft, "draft", num_kv_blocks=200)
    llm.generate(repeating_prompts(3, seed=10), SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True))
    assert _tokens(llm, prompts, params) == first
    _assert_all_free(llm)


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_aborts_during_speculation_free_every_block(target, draft, kind):
    llm = _spec_llm(target, draft, kind, num_kv_blocks=60)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(repeating_prompts(6, seed=13)):
        for request in llm.processor.process(f"r{i}", prompt, params, 0):
            llm.engine.add_request(request)
    for _ in range(6):
        llm.engine.step()
        llm.engine.check_integrity()
    llm.engine.abort_requests(["r0", "r3", "r4"])
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    _assert_all_free(llm)


def test_opt_out_requests_get_no_drafts_and_logprobs_match(target, plain):
    llm = _spec_llm(target, None, "ngram", num_kv_blocks=200)
    counts = SpecCounter(llm)
    prompts = repeating_prompts(4, seed=15)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, speculative=False))
    assert counts.num_draft_tokens == 0
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    got, want = llm.generate(prompts, params), plain.generate(prompts, params)
    assert counts.num_accepted > 0
    for a, b in zip(got, want):
        if a.outputs[0].token_ids != b.outputs[0].token_ids:
            continue  # a near-tie flip; covered by the greedy tests
        assert len(a.outputs[0].logprobs) == 16
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert (la.token_id, la.rank, [t for t, _ in la.top]) == (lb.token_id, lb.rank, [t for t, _ in lb.top])
            assert [la.logprob] + [v for _, v in la.top] == pytest.approx([lb.logprob] + [v for _, v in lb.top],
                                                                          abs=1e-4)


# Chi-square critical values at p = 0.001 for 1..3 degrees of freedom.
_CHI2_CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27}


def test_sampled_tokens_through_a_draft_model_follow_the_targets_distribution(target, draft, plain):
    """Many unseeded samples of token 2 (verified against one draft by rejection sampling) per value of
    token 1, against the target's own top-4 distribution at temperature 1.5."""
    prompt = repeating_prompts(1, seed=17)[0]
    params = SamplingParams(temperature=1.5, top_k=4, max_tokens=3, ignore_eos=True)
    llm = _spec_llm(target, draft, "draft", num_kv_blocks=2000, max_num_seqs=256, speculative_max_batch=1000)
    counts = SpecCounter(llm)
    samples = [o.outputs[0].token_ids[:2] for o in llm.generate([prompt] * 1500, params)]
    assert counts.num_draft_tokens >= 1500 and 0 < counts.num_accepted < counts.num_draft_tokens
    by_first: dict[int, list[int]] = {}
    for first, second in samples:
        by_first.setdefault(first, []).append(second)
    num_tested = 0
    for first, seconds in by_first.items():
        if len(seconds) < 200:
            continue
        expected = _top4_distribution(plain, prompt + [first], temperature=1.5)
        assert set(seconds) <= set(expected), "a token outside the target's top-4"
        stat = sum((seconds.count(t) - len(seconds) * p) ** 2 / (len(seconds) * p) for t, p in expected.items())
        assert stat < _CHI2_CRITICAL[len(expected) - 1], (first, stat, expected)
        num_tested += 1
    assert num_tested >= 1
    _assert_all_free(llm)


def _top4_distribution(llm: LLM, prefix: list[int], temperature: float) -> dict[int, float]:
    out = llm.generate([prefix], SamplingParams(temperature=0, max_tokens=1, logprobs=4))[0]
    top = out.outputs[0].logprobs[0].top[:4]  # (token, raw logprob), best first
    weights = torch.tensor([lp for _, lp in top]).div(temperature).softmax(dim=0).tolist()
    return {token: w for (token, _), w in zip(top, weights)}


def test_dynamic_rule_measures_both_costs_and_keeps_greedy_outputs(target, plain):
    """The dynamic rule: a plain decode step measures plain_s, the next speculates to measure row_s (and fixed_s),
    then it decides per request; whatever it decides, greedy outputs stay those of plain decoding."""
    llm = LLM(target, dtype="float32", max_model_len=256, speculative="ngram", num_speculative_tokens=3,
              num_kv_blocks=200, speculative_dynamic=True)
    counts = SpecCounter(llm)
    prompts = repeating_prompts(4, seed=19)[::2]  # two prompts that repeat a span: n-gram lookup proposes
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    _assert_same_greedy(target, prompts, _tokens(llm, prompts, params), _tokens(plain, prompts, params))
    cost = llm.engine.runner.speculator.rule.buckets[2]
    assert cost.plain_s > 0 and cost.row_s is not None and cost.num_decisions > 2
    assert counts.num_draft_tokens > 0
    _assert_all_free(llm)
