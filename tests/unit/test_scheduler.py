from llmserve.core.request import RequestStatus
from llmserve.messages import FinishReason

from core_helpers import EOS, make_request, make_scheduler, step


def test_chunked_prefill_under_one_budget_then_decode():
    sched = make_scheduler(budget=8, block_size=4)
    sched.add_request(make_request("a", list(range(1, 13)), max_tokens=2))  # 12 prompt tokens
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 8}
    assert [r.block_ids for r in out.new_reqs] == [[1, 2]]
    sched.update_from_output(out, __import__("core_helpers").fake_runner_output(sched, out))
    out, res = step(sched)  # remaining 4 prompt tokens -> first token
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.cached_reqs[0].new_block_ids == [3]
    assert res.outputs[0].new_token_ids == [7]
    out, res = step(sched)  # one decode token, needs block 4 (token 13)
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.cached_reqs[0].new_block_ids == [4]
    assert res.outputs[0].finish_reason == FinishReason.LENGTH
    assert not sched.has_unfinished_requests()
    assert sched.kv.pool.get_num_free_blocks() == sched.kv.pool.num_usable_blocks
    sched.check_integrity()


def test_running_first_then_waiting_share_budget():
    sched = make_scheduler(budget=10, block_size=4)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=5))
    step(sched)
    sched.add_request(make_request("b", list(range(20, 40)), max_tokens=5))
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 9)]
    sched.check_integrity()


def test_eos_and_stop_token_and_min_tokens():
    sched = make_scheduler()
    sched.add_request(make_request("eos", [1, 2], max_tokens=8))
    sched.add_request(make_request("stop", [1, 2], max_tokens=8, stop_token_ids=[EOS]))
    sched.add_request(make_request("min", [1, 2], max_tokens=8, min_tokens=2))
    sched.add_request(make_request("ign", [1, 2], max_tokens=3, ignore_eos=True))
    _, res = step(sched, token=EOS)
    reasons = {o.request_id: o.finish_reason for o in res.outputs}
    assert reasons == {"eos": FinishReason.STOP, "stop": FinishReason.STOP, "min": None, "ign": None}
    _, res = step(sched, token=EOS)
    assert {o.request_id: o.finish_reason for o in res.outputs} == {"min": FinishReason.STOP, "ign": None}
    _, res = step(sched, token=EOS)
    assert {o.request_id: o.finish_reason for o in res.outputs} == {"ign": FinishReason.LENGTH}
    sched.check_integrity()


def test_preemption_by_recompute_loses_nothing():
    # 6 usable blocks of 4 tokens: two requests of 8 prompt tokens each fill 4; growing needs more.
    sched = make_scheduler(num_blocks=7, block_size=4, budget=64, caching=False)
    sched.add_request(make_request("a", list(range(1, 9)), max_tokens=12, arrival=0))
    sched.add_request(make_request("b", list(range(11, 19)), max_tokens=12, arrival=1))
    finished = {}
    preempted = False
    for _ in range(60):
        out, res = step(sched)
        preempted |= bool(res.stats.num_preemptions)
        for o in res.outputs:
            finished.setdefault(o.request_id, []).extend(o.new_token_ids)
        sched.check_integrity()
        if not sched.has_unfinished_requests():
            break
    assert preempted
    assert {k: len(v) for k, v in finished.items()} == {"a": 12, "b": 12}
    assert sched.kv.pool.get_num_free_blocks() == 6


def test_preempted_request_goes_to_the_front_and_runner_forgets_it():
    sched = make_scheduler(num_blocks=5, block_size=4, budget=64, caching=False)
    sched.add_request(make_request("a", [1, 2, 3, 4], max_tokens=8))
    sched.add_request(make_request("b", [5, 6, 7, 8], max_tokens=8))
    for _ in range(5):  # positions 0..7 computed: two blocks each, all 4 usable blocks taken
        step(sched)
    out = sched.schedule()  # position 8 needs a 3rd block each: b (newest) is preempted for a
    assert sched.requests["b"].status == RequestStatus.PREEMPTED
    assert list(out.num_scheduled_tokens) == ["a"]
    assert "b" in sched.finished_req_ids or "b" in out.finished_req_ids
    assert sched.waiting.peek().request_id == "b"
    sched.check_integrity()


def test_priority_policy_preempts_lowest_priority():
    sched = make_scheduler(num_blocks=5, block_size=4, budget=64, caching=False, policy="priority")
    sched.add_request(make_request("low", [1, 2, 3, 4], max_tokens=8, priority=5, arrival=0))
    sched.add_request(make_request("high", [5, 6, 7, 8], max_tokens=8, priority=0, arrival=1))
    for _ in range(5):
        step(sched)
    sched.schedule()
    assert sched.requests["low"].status == RequestStatus.PREEMPTED
    assert sched.requests["high"].status == RequestStatus.RUNNING


def test_priority_queue_admits_by_priority():
    sched = make_scheduler(policy="priority", max_num_seqs=1)
    sched.add_request(make_request("late-important", [1], priority=0, arrival=2))
    sched.add_request(make_request("early", [2], priority=3, arrival=1))
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["late-important"]


def test_max_num_seqs_caps_running():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_request(str(i), [1, 2]))
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["0", "1"]


def test_abort_waiting_running_and_output_reports_it():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("run", [1, 2], max_tokens=10))
    sched.add_request(make_request("wait", [3, 4], max_tokens=10))
    step(sched)
    sched.abort_requests(["run", "wait", "unknown"])
    out, res = step(sched)
    assert {o.request_id: o.finish_reason for o in res.outputs} == {"run": FinishReason.ABORT,
                                                                     "wait": FinishReason.ABORT}
    assert "run" in out.finished_req_ids
    assert not sched.has_unfinished_requests()
    assert sched.kv.pool.get_num_free_blocks() == sched.kv.pool.num_usable_blocks
    sched.check_integrity()


def test_context_length_finishes_with_length():
    sched = make_scheduler(max_model_len=6)
    request = make_request("a", [1, 2, 3, 4], max_tokens=100)
    request.max_tokens = 2  # what the front resolves for this context
    sched.add_request(request)
    step(sched)
    _, res = step(sched)
    assert res.outputs[0].finish_reason == FinishReason.LENGTH


def test_prefill_tokens_are_capped_while_requests_decode():
    from llmserve.config import CacheConfig, SchedulerConfig
    from llmserve.core.scheduler import Scheduler

    sched = Scheduler(SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=64, max_prefill_tokens_while_decoding=6),
                      CacheConfig(block_size=4), 64, 256)
    sched.add_request(make_request("a", list(range(1, 21)), max_tokens=8))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 20}  # nobody decodes yet: the whole budget
    sched.add_request(make_request("b", list(range(101, 116)), max_tokens=8))
    sched.add_request(make_request("c", list(range(201, 204)), max_tokens=8))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 6}  # a decodes: 6 prompt tokens at most
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 6}
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 3, "c": 3}
    sched.check_integrity()


def test_token_budget_default_depends_on_the_device():
    from llmserve.config import SchedulerConfig

    assert SchedulerConfig().max_num_batched_tokens is None  # unset: the engine fills it in for its device
    assert SchedulerConfig().for_device("cpu").max_num_batched_tokens == 512
    assert SchedulerConfig().for_device("cuda").max_num_batched_tokens == 2048
    assert SchedulerConfig(max_num_batched_tokens=96).for_device("cpu").max_num_batched_tokens == 96
    h100 = SchedulerConfig().for_device("cuda", device_memory=80 * 2**30)
    assert (h100.max_num_seqs, h100.max_num_batched_tokens, h100.async_scheduling) == (1024, 8192, True)
    cpu = SchedulerConfig(max_num_seqs=7).for_device("cpu")
    assert (cpu.max_num_seqs, cpu.async_scheduling) == (7, False)


def _two_running_at_full_cache(first_priority: int, second_priority: int):
    """5 usable blocks of 4 tokens; `first` starts one step before `second`, so it is scheduled first in
    each step and crosses block boundaries first: at position 8 it takes the last free block, then
    `second` needs one too."""
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64, caching=False, policy="priority")
    sched.add_request(make_request("first", [1, 2, 3, 4], max_tokens=16, priority=first_priority, arrival=0))
    step(sched)
    sched.add_request(make_request("second", [5, 6, 7, 8], max_tokens=16, priority=second_priority, arrival=1))
    for _ in range(5):
        step(sched)
    return sched, sched.schedule()


def test_priority_preemption_undoes_a_lower_priority_request_scheduled_earlier_in_the_step():
    sched, out = _two_running_at_full_cache(first_priority=5, second_priority=0)
    assert sched.requests["first"].status == RequestStatus.PREEMPTED
    assert sched.requests["second"].status == RequestStatus.RUNNING
    assert out.num_scheduled_tokens == {"second": 1} and out.total_num_scheduled_tokens == 1
    assert [c.req_id for c in out.cached_reqs] == ["second"]
    assert "first" in out.finished_req_ids
    assert sched.waiting.peek().request_id == "first"
    sched.check_integrity()


def test_priority_preemption_never_takes_a_higher_priority_request():
    sched, out = _two_running_at_full_cache(first_priority=0, second_priority=5)
    assert sched.requests["first"].status == RequestStatus.RUNNING
    assert sched.requests["second"].status == RequestStatus.PREEMPTED
    assert out.num_scheduled_tokens == {"first": 1}
    sched.check_integrity()


def test_decode_steps_tell_the_runner_only_of_block_changes():
    sched = make_scheduler(block_size=4)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=6))
    out, _ = step(sched)  # the prompt, sent in full; samples token 4
    assert [r.block_ids for r in out.new_reqs] == [[1]]
    out, _ = step(sched)  # token 4 fits in block 1
    assert out.num_scheduled_tokens == {"a": 1} and out.cached_reqs == []
    out, _ = step(sched)  # token 5 starts block 2
    assert [(c.req_id, c.new_block_ids, c.num_old_blocks) for c in out.cached_reqs] == [("a", [2], 1)]
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1} and out.cached_reqs == []
    sched.check_integrity()
