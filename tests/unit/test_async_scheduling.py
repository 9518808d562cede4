"""Async scheduling on CPU: the engine launches step N+1 before it finishes step N, and every output is
the one the in-order engine gives (greedy and seeded sampling, stops, preemption, n > 1, logprobs,
penalties, min_tokens, speculative decoding, aborts)."""

import pytest

from llmserve import LLM, SamplingParams
from llmserve.testing.maker import make_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    make_model("llama", "tiny", path, seed=3)
    return path


def _llm(path, is_async: bool, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 512)  # on CUDA too: no profile of a device other engines still hold
    return LLM(path, dtype="float32", async_scheduling=is_async, **kwargs)


def _prompts(num: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 400 + 3 for j in range(5 + (11 * i) % 40)] for i in range(num)]


def _tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outputs]


def _run_both(path, prompts, params, min_preemptions: int = 0, can_overlap: bool = True, **kwargs):
    outs = []
    for is_async in (False, True):
        llm = _llm(path, is_async, **kwargs)
        outs.append(llm.generate(prompts, params))
        llm.engine.check_integrity()
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.num_free_blocks() == llm.engine.scheduler.kv.pool.num_usable_blocks
        assert (llm.engine.runner.times.num_device_inputs > 0) == (is_async and can_overlap)  # fed on the device
        assert llm.num_preemptions >= min_preemptions
    return outs


def test_greedy_tokens_equal_with_and_without_overlap(tiny):
    prompts = _prompts(24)
    params = [SamplingParams(temperature=0, max_tokens=3 + i % 17, ignore_eos=True) for i in range(24)]
    in_order, overlapped = _run_both(tiny, prompts, params, max_num_seqs=8)
    assert _tokens(overlapped) == _tokens(in_order)
    assert [len(o.outputs[0].token_ids) for o in overlapped] == [3 + i % 17 for i in range(24)]


def test_stop_tokens_finish_at_the_same_place(tiny):
    prompts = _prompts(12)
    free_run = _llm(tiny, False).generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[o.outputs[0].token_ids[5]])
              for o in free_run]
    in_order, overlapped = _run_both(tiny, prompts, params)
    assert _tokens(overlapped) == _tokens(in_order)
    assert all(o.outputs[0].finish_reason == "stop" for o in overlapped)
    assert all(len(o.outputs[0].token_ids) <= 6 for o in overlapped)


def test_preemption_under_a_small_cache(tiny):
    prompts = _prompts(16)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    in_order, overlapped = _run_both(tiny, prompts, params, min_preemptions=1, num_kv_blocks=24, max_num_seqs=16, max_model_len=256)
    assert _tokens(overlapped) == _tokens(in_order)


def _assert_same_samples(in_order, overlapped):
    assert _tokens(overlapped) == _tokens(in_order)
    for a, b in zip(in_order, overlapped):
        for ca, cb in zip(a.outputs, b.outputs):
            assert [lp.logprob for lp in ca.logprobs] == pytest.approx([lp.logprob for lp in cb.logprobs])


def test_seeded_sampling_n_logprobs_min_tokens(tiny):
    prompts = _prompts(10)
    params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=100 + i, n=1 + i % 2, logprobs=2,
                             max_tokens=12, min_tokens=4 if i % 3 == 0 else 0) for i in range(10)]
    _assert_same_samples(*_run_both(tiny, prompts, params, max_num_seqs=6))


def test_penalties_read_their_tokens_on_the_device(tiny):
    """Penalised rows' output ids are appended on the device: their steps overlap too."""
    prompts = _prompts(6)
    params = [SamplingParams(temperature=0.8, seed=7 + i, logprobs=1, max_tokens=10,
                             presence_penalty=0.5 * (i % 2), repetition_penalty=1.0 + 0.2 * (i % 3 == 2))
              for i in range(6)]
    _assert_same_samples(*_run_both(tiny, prompts, params))


def test_speculative_ngram_turns_overlap_off_per_step(tiny):
    prompts = [[5, 6, 7, 8] * 6 + [5, 6]] * 3 + _prompts(12)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    in_order, overlapped = _run_both(tiny, prompts, params, speculative="ngram", speculative_max_batch=4,
                                     max_num_seqs=8)
    assert _tokens(overlapped) == _tokens(in_order)


def test_abort_while_a_step_is_in_flight(tiny):
    llm = _llm(tiny, True)
    engine = llm.engine
    for i, prompt in enumerate(_prompts(6)):
        for request in llm.processor.process(str(i), prompt, SamplingParams(max_tokens=50, ignore_eos=True), 0):
            engine.add_request(request)
    num_outputs = 0
    for step in range(12):
        if step == 5:
            assert engine.in_flight is not None
            engine.abort_requests(["1", "4"])
        num_outputs += len(engine.step().outputs)
        engine.check_integrity()
    assert "1" not in engine.scheduler.requests and "4" not in engine.scheduler.requests
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    assert engine.num_free_blocks() == engine.scheduler.kv.pool.num_usable_blocks
    assert set(engine.runner.states) <= engine.scheduler.finished_req_ids  # dropped with the next step


def test_steps_that_find_no_drafts_back_off_into_overlap(tiny):
    """Every row may speculate (cap above the batch), but 4-gram lookup finds no drafts here: the steps
    after one that found none overlap (fed on the device; without the back-off every step would run in
    order) and the tokens stay the in-order ones."""
    prompts = _prompts(6)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    in_order, overlapped = _run_both(tiny, prompts, params, speculative="ngram", speculative_max_batch=16,
                                     ngram_min=4, ngram_max=4)
    assert _tokens(overlapped) == _tokens(in_order)


def test_draft_backoff_doubles_up_to_its_cap_and_resets_on_drafts():
    from llmserve.core.spec_stats import MAX_SKIPPED_STEPS, DraftBackoff

    backoff = DraftBackoff(is_enabled=True)
    runs = []
    for _ in range(7):
        backoff.observe(0)
        run = 0
        while backoff.is_skipping:
            backoff.on_scheduled()
            run += 1
        runs.append(run)
    assert runs == [1, 2, 4, 8, 16, MAX_SKIPPED_STEPS, MAX_SKIPPED_STEPS]
    backoff.observe(3)
    backoff.observe(0)
    assert backoff.num_skips_left == 1
    off = DraftBackoff(is_enabled=False)
    off.observe(0)
    assert not off.is_skipping
