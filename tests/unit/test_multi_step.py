"""Multi-step decoding (core/decode_window.py, worker/decode_window.py): the same outputs as one forward a step,
only where no request reads its tokens as they come, and the bookkeeping intact."""

import itertools

import pytest

from llmserve import LLM, SamplingParams
from llmserve.config_scheduler import CPU_SCHEDULER_STEPS, SchedulerConfig
from llmserve.core.decode_window import window_counts
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.request import Request
from llmserve.messages import EngineCoreRequest
from llmserve.testing.maker import make_model


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_model("llama", "tiny", str(tmp_path_factory.mktemp("multi")), seed=11)


def _llm(path: str, num_steps: int, **kwargs) -> LLM:
    """A cache of 512 blocks unless told: the default (a share of free memory) takes seconds to allocate."""
    return LLM(path, dtype="float32", num_scheduler_steps=num_steps,
               **{"max_model_len": 128, "num_kv_blocks": 512, **kwargs})


def _record_steps(llm: LLM) -> list[int]:
    """The forwards of each step the engine schedules from now on."""
    steps: list[int] = []
    schedule = llm.engine.scheduler.schedule

    def recording():
        out = schedule()
        steps.append(out.num_steps)
        return out

    llm.engine.scheduler.schedule = recording
    return steps


def _run(llm: LLM, prompts, params) -> list[tuple[list[int], str, object]]:
    outs = llm.generate(prompts, params)
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks() == llm.engine.scheduler.kv.pool.num_usable_blocks
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outs]


def _workload(stop_token: int | None = None):
    prompts = [[(7 * i + j) % 500 + 3 for j in range(5 + 3 * i)] for i in range(10)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                             stop_token_ids=[stop_token] if stop_token is not None and i % 2 else None)
              for i, n in enumerate((1, 2, 3, 5, 9, 17, 30, 4, 12, 80))]
    return prompts, params


def test_greedy_outputs_match_one_forward_a_step_with_stops_inside_windows(path):
    prompts, params = _workload()
    stop = _run(_llm(path, 1), prompts, params)[9][0][6]  # request 9's 7th token: stops land inside windows
    plain, multi = _llm(path, 1), _llm(path, 4)
    prompts, params = _workload(stop)
    expected = _run(plain, prompts, params)
    steps = _record_steps(multi)
    assert _run(multi, prompts, params) == expected
    assert any(r == "stop" for _, r, _ in expected) and 4 in steps, "stops and 4-forward steps both happened"
    assert multi.engine.runner.times.num_steps > len(steps), "fewer engine steps than forwards"
    # a row that samples its stop id inside a window runs no further forward: no token computed in vain
    assert multi.engine.runner.times.num_tokens == plain.engine.runner.times.num_tokens


def test_a_window_whose_every_row_stops_ends_there(path):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = _run(_llm(path, 1), [[4, 5, 6]], params)[0][0]
    stop = full[3]
    multi = _llm(path, 8)
    out = _run(multi, [[4, 5, 6]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                  stop_token_ids=[stop]))[0]
    assert out == (full[:full.index(stop) + 1], "stop", stop)
    assert multi.engine.runner.times.num_tokens == 3 + full.index(stop), "no forward after the stop"


def test_seeded_sampling_matches_and_seats_stay_full_while_others_wait(path):
    prompts, _ = _workload()
    params = [SamplingParams(temperature=1.0, top_k=50, seed=100 + i, max_tokens=6 + 5 * i, ignore_eos=True)
              for i in range(len(prompts))]
    plain = _llm(path, 1, max_num_seqs=3)
    expected = _run(plain, prompts, params)
    multi = _llm(path, 3, max_num_seqs=3)
    steps = _record_steps(multi)
    assert _run(multi, prompts, params) == expected
    assert 3 in steps
    # while requests wait, a window ends with its first row: the same forwards, none with an idle seat
    assert multi.engine.runner.times.num_steps == plain.engine.runner.times.num_steps


def test_a_window_ended_by_input_rolls_back_the_forwards_it_did_not_run(path):
    """The engine-core process ends a window when input arrives (EngineCore.interrupt_windows_on_input): each row
    reports the ids it got, the scheduler takes the rest of its count back, and nothing else changes."""
    prompts, params = _workload()
    plain = _llm(path, 1)
    expected = _run(plain, prompts, params)
    multi = _llm(path, 8)
    num_asked = itertools.count(1)
    multi.engine.interrupt_windows_on_input(lambda: next(num_asked) % 3 == 0)  # every third forward of the run
    steps = _record_steps(multi)
    assert _run(multi, prompts, params) == expected
    assert 8 in steps and multi.engine.runner.times.num_steps == plain.engine.runner.times.num_steps
    assert len(steps) > multi.engine.runner.times.num_steps / 3, "windows ended after 3 forwards at most"


def _record_finishes(llm: LLM) -> dict[str, int]:
    """Per request from now on, the forwards run when its final output left the engine."""
    finished_at: dict[str, int] = {}
    step = llm.engine.step

    def recording():
        outputs = step()
        for out in outputs.outputs:
            if out.finish_reason is not None:
                finished_at[out.request_id] = llm.engine.runner.times.num_steps
        return outputs

    llm.engine.step = recording
    return finished_at


def test_an_engine_read_as_it_goes_ends_windows_where_a_row_finishes(path):
    """In the engine-core process (EngineCore.interrupt_windows_on_input) a finished request's output leaves after
    the forward of its last token, as with one forward a step, not at the end of its window."""
    prompt_stop = _run(_llm(path, 1), *_workload())[9][0][6]
    prompts, params = _workload(prompt_stop)
    plain, multi = _llm(path, 1), _llm(path, 8)
    plain_finishes, multi_finishes = _record_finishes(plain), _record_finishes(multi)
    multi.engine.interrupt_windows_on_input(lambda: False)  # no input comes: finishes alone end the windows
    steps = _record_steps(multi)
    assert _run(multi, prompts, params) == _run(plain, prompts, params)
    assert multi_finishes == plain_finishes and len(multi_finishes) == len(prompts)
    assert 8 in steps and len(steps) < multi.engine.runner.times.num_steps, "windows ran"


def test_preemption_falls_back_to_single_forwards(path):
    prompts = [[i + 3] * 20 for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    small = {"num_kv_blocks": 14, "block_size": 8, "max_model_len": 64}
    plain = _llm(path, 1, **small)
    expected = _run(plain, prompts, params)
    multi = _llm(path, 4, **small)
    steps = _record_steps(multi)
    assert _run(multi, prompts, params) == expected
    assert multi.num_preemptions > 0 and 4 in steps


def test_prefix_cache_keeps_the_blocks_the_last_window_filled(path):
    """A finished request's full blocks are cached as with one forward a step: a follow-up prompt made of
    its prompt and output hits the same number of tokens."""
    hits = []
    for num_steps in (1, 4):
        llm = _llm(path, num_steps, block_size=4)
        prompt = [5] * 9
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=13, ignore_eos=True))[0]
        follow = llm.generate([prompt + list(out.outputs[0].token_ids) + [9]],
                              SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0]
        hits.append(follow.num_cached_tokens)
    assert hits[0] == hits[1] == 20  # 21 tokens computed (the last window 17-21): 5 full blocks of 4


def test_streamed_requests_run_one_forward_a_step(path):
    llm = _llm(path, 4)
    steps = _record_steps(llm)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.engine.add_request(EngineCoreRequest("s", [3, 4, 5], params, [], 0.0, is_final_only=False))
    num_tokens = 0
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step().outputs:
            assert len(out.new_token_ids) <= 1
            num_tokens += len(out.new_token_ids)
    assert num_tokens == 12 and set(steps) == {1}


def _request(req_id: str, num_prompt: int, max_tokens: int) -> Request:
    return Request(req_id, list(range(3, 3 + num_prompt)), SamplingParams(max_tokens=max_tokens), [], 0.0, max_tokens,
                   is_final_only=True)


def _decoding(kv: KVCacheManager, request: Request, num_output: int) -> Request:
    """`request` in plain decode: its prompt and `num_output` - 1 outputs computed, one more sampled."""
    request.all_token_ids += [9] * num_output
    assert kv.allocate_slots(request, request.num_tokens - 1) is not None
    request.num_computed_tokens = request.num_tokens - 1
    return request


def test_window_counts_caps_rows_and_refuses_what_cannot_run():
    kv = KVCacheManager(num_blocks=40, block_size=4, enable_caching=True)
    rows = [_decoding(kv, _request("a", 5, 10), 1), _decoding(kv, _request("b", 3, 3), 1)]
    assert window_counts(rows, 4, kv) == [4, 2]  # b has 2 tokens left to max_tokens
    assert window_counts(rows[1:], 4, kv) == [2]
    assert window_counts(rows, 4, kv, is_even=True) == [2, 2]  # requests wait: all end with b
    assert window_counts([_decoding(kv, _request("c", 3, 2), 1)], 4, kv) is None, "no row with 2 to go"
    prompt = _request("d", 9, 5)
    assert kv.allocate_slots(prompt, 4) is not None
    prompt.num_computed_tokens = 4
    assert window_counts(rows + [prompt], 4, kv) is None, "a prompt chunk"
    tight = KVCacheManager(num_blocks=3, block_size=4, enable_caching=False)  # 2 usable blocks
    row = _decoding(tight, _request("f", 4, 20), 1)  # 1 block held, 1 free: 4 more tokens fit
    assert window_counts([row], 4, tight) == [4]
    assert window_counts([row], 8, tight) is None, "8 more tokens need 2 free blocks"


def test_scheduler_config_defaults_and_validation():
    cpu = SchedulerConfig().for_device("cpu")
    assert cpu.num_scheduler_steps == CPU_SCHEDULER_STEPS and cpu.async_scheduling is False
    cuda = SchedulerConfig().for_device("cuda")
    assert cuda.num_scheduler_steps == 1 and cuda.async_scheduling is True
    assert SchedulerConfig(num_scheduler_steps=4).for_device("cuda").async_scheduling is False
    assert SchedulerConfig(async_scheduling=True).for_device("cpu").num_scheduler_steps == 1
    with pytest.raises(ValueError, match="num-scheduler-steps"):
        SchedulerConfig(num_scheduler_steps=0).validate()
    with pytest.raises(ValueError, match="no-async-scheduling"):
        SchedulerConfig(num_scheduler_steps=2, async_scheduling=True).validate()


def _windows_of_spec_engine(path: str, prompts, params, **spec) -> tuple[list, list[int], list]:
    llm = _llm(path, 8, speculative="ngram", speculative_max_batch=16, ngram_min=4, ngram_max=4, **spec)
    steps = _record_steps(llm)
    return _run(llm, prompts, params), steps, llm


def test_a_speculating_engine_runs_windows_while_it_backs_off_from_steps_without_drafts(path):
    """4-gram lookup finds nothing in these prompts: after a step that looked and found nothing, the
    back-off's skipped forwards run as windows (1, 2, 4, 8 forwards: capped by the skips left and by
    num_scheduler_steps), and the greedy tokens stay those of one forward a step without speculation."""
    prompts = [[(7 * i + j) % 500 + 3 for j in range(5 + 3 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = _run(_llm(path, 1), prompts, params)
    got, steps, llm = _windows_of_spec_engine(path, prompts, params)
    assert got == expected
    assert max(steps) == 8 and set(steps) >= {1, 2, 4}



def test_a_window_uses_as_many_skips_as_it_runs_forwards():
    from llmserve.core.spec_stats import DraftBackoff

    backoff = DraftBackoff(is_enabled=True)
    for _ in range(4):
        backoff.observe(0)  # runs of 1, 2, 4, 8
        backoff.on_scheduled(backoff.num_skips_left)
    backoff.observe(0)
    assert backoff.num_skips_left == 16
    backoff.on_scheduled(5)
    assert backoff.num_skips_left == 11 and backoff.is_skipping
    backoff.on_scheduled(64)
    assert backoff.num_skips_left == 0 and not backoff.is_skipping
    backoff.observe(0)
    backoff.reset()  # a new request that may speculate
    assert not backoff.is_skipping
    backoff.observe(0)
    assert backoff.num_skips_left == 1


def test_the_dynamic_rule_prices_plain_decoding_by_the_windows_it_backs_off_into(path):
    """Each back-off window whose rows all run its forwards is reported to the rule (rows, forwards), and
    the bucket of its rows then prices plain decoding by it (`window_s`)."""
    prompts = [[(7 * i + j) % 500 + 3 for j in range(5 + 3 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = _llm(path, 8, speculative="ngram", speculative_max_batch=16, ngram_min=4, ngram_max=4,
               speculative_dynamic=True)
    rule = llm.engine.runner.speculator.rule
    windows: list[tuple[int, int]] = []
    observe = rule.observe_window
    rule.observe_window = lambda rows, forwards, seconds: (windows.append((rows, forwards)),
                                                           observe(rows, forwards, seconds))
    steps = _record_steps(llm)
    _run(llm, prompts, params)
    assert windows and sorted(windows) == sorted((6, n) for n in steps if n > 1)  # the rows run in lockstep
    assert rule.buckets[8].window_s is not None and rule.buckets[8].window_s > 0
