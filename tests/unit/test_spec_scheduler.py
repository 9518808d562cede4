"""Speculative decoding in the scheduler: drafts under the token budget, rollback, trimmed blocks."""

from llmserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from llmserve.core.sched_output import ModelRunnerOutput
from llmserve.core.scheduler import Scheduler
from llmserve.core.scheduler_preempt import preempt

from core_helpers import make_request


def _scheduler(k: int = 5, budget: int = 64, max_batch: int = 8, num_blocks: int = 32, speculative: str = "ngram"):
    spec = SpeculativeConfig(speculative=speculative, num_speculative_tokens=k, speculative_max_batch=max_batch,
                             draft_model="d" if speculative == "draft" else None)
    return Scheduler(SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=budget), CacheConfig(block_size=4), num_blocks, 256,
                     spec)


def _run(sched, sampled: dict[str, list[int]], proposals: dict[str, list[int]]):
    out = sched.schedule()
    req_ids = list(out.num_scheduled_tokens)
    num_accepted = [max(0, len(sampled.get(r, [])) - 1) for r in req_ids]  # the runner's count: tokens - 1
    runner = ModelRunnerOutput(req_ids, [sampled.get(r, []) for r in req_ids],
                               spec_token_ids=[proposals.get(r, []) for r in req_ids], num_accepted=num_accepted)
    return out, sched.update_from_output(out, runner)


def test_rejected_drafts_roll_back_and_their_block_is_given_back_first():
    sched = _scheduler(k=5)
    sched.add_request(make_request("a", list(range(10, 17)), max_tokens=20))  # 7 prompt tokens
    out, _ = _run(sched, {"a": [1]}, {"a": [2, 3, 4, 5, 6]})
    assert out.num_scheduled_tokens == {"a": 7} and sched.kv.get_block_ids("a") == [1, 2]
    request = sched.requests["a"]
    assert request.spec_token_ids == [2, 3, 4, 5, 6]
    # 8 real tokens + 5 drafts: positions 7..12 are computed, 4 blocks
    out, _ = _run(sched, {"a": [9]}, {"a": []})  # the first draft is rejected: the target's token instead
    assert out.num_scheduled_tokens == {"a": 6} and out.scheduled_spec_tokens == {"a": [2, 3, 4, 5, 6]}
    assert out.cached_reqs[0].new_block_ids == [3, 4] and out.cached_reqs[0].num_old_blocks == 2
    assert request.num_tokens == 9 and request.num_computed_tokens == 8
    assert sched.kv.get_block_ids("a") == [1, 2, 3]  # block 4 held only rejected drafts
    assert sched.kv.pool.free_queue.block_ids()[0] == 4  # reused before any cached block is evicted
    sched.check_integrity()
    out, _ = _run(sched, {"a": [5]}, {})
    assert out.num_scheduled_tokens == {"a": 1} and out.cached_reqs[0].num_old_blocks == 3


def test_accepted_drafts_advance_and_stats_count_them():
    sched = _scheduler(k=3)
    sched.add_request(make_request("a", [5, 6, 7, 8], max_tokens=20))
    _run(sched, {"a": [1]}, {"a": [2, 3, 4]})
    out, outputs = _run(sched, {"a": [2, 3, 9]}, {"a": [1, 1, 1]})  # two accepted, then the target's token
    request = sched.requests["a"]
    assert outputs.outputs[0].new_token_ids == [2, 3, 9]
    assert request.num_tokens == 8 and request.num_computed_tokens == 7
    spec = outputs.stats.spec
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (1, 3, 2)
    assert spec.accepted_per_position == [1, 1, 0]
    sched.check_integrity()


def test_drafts_fit_the_token_budget_and_max_tokens():
    sched = _scheduler(k=5, budget=3)
    sched.add_request(make_request("a", [5, 6], max_tokens=20))
    _run(sched, {"a": [1]}, {"a": [2, 3, 4, 5, 6]})
    out, _ = _run(sched, {"a": [2, 3, 9]}, {"a": [7, 7, 7, 7, 7]})
    assert out.num_scheduled_tokens == {"a": 3} and out.scheduled_spec_tokens == {"a": [2, 3]}
    sched2 = _scheduler(k=5)
    sched2.add_request(make_request("b", [5, 6], max_tokens=3))
    _run(sched2, {"b": [1]}, {"b": [2, 3, 4, 5, 6]})
    assert sched2.requests["b"].spec_token_ids == [2]  # 3 - 1 output - 1 bonus: one draft at most


def test_speculation_switches_off_above_the_batch_limit():
    sched = _scheduler(k=2, max_batch=2)
    for name in "abc":
        sched.add_request(make_request(name, [5, 6, 7], max_tokens=20))
    out, _ = _run(sched, {r: [1] for r in "abc"}, {r: [2, 3] for r in "abc"})
    assert not out.use_speculation
    out, _ = _run(sched, {r: [1] for r in "abc"}, {})
    assert out.scheduled_spec_tokens == {} and out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1}
    sched.abort_requests(["c"])
    out, _ = _run(sched, {r: [1] for r in "ab"}, {r: [2, 3] for r in "ab"})
    assert out.use_speculation
    out, _ = _run(sched, {r: [2, 3, 4] for r in "ab"}, {})
    assert out.scheduled_spec_tokens == {"a": [2, 3], "b": [2, 3]}
    sched.check_integrity()


def test_preemption_drops_drafts_and_draft_lookahead_slots_are_reserved():
    sched = _scheduler(k=4, speculative="draft")
    sched.add_request(make_request("a", [5, 6, 7], max_tokens=20))
    out, _ = _run(sched, {"a": [1]}, {"a": [2, 3, 4, 5]})
    assert sched.kv.get_block_ids("a") == [1, 2]  # 3 prompt slots + 4 lookahead for the draft's proposals
    request = sched.requests["a"]
    preempt(sched, request)
    assert request.spec_token_ids == [] and request.num_computed_tokens == 0
    out, _ = _run(sched, {"a": [1]}, {})
    assert out.new_reqs[0].req_id == "a" and out.scheduled_spec_tokens == {}
    sched.abort_requests(["a"])
    sched.check_integrity()
    assert sched.kv.pool.get_num_free_blocks() == sched.kv.pool.num_usable_blocks


def test_a_preempted_victim_scheduled_earlier_in_the_step_loses_its_drafts_too():
    """4 usable blocks of 4 tokens: `low` (scheduled first) takes the last block for its drafts, then
    `high` needs one; `low` is preempted and its scheduling in this step, drafts included, undone."""
    spec = SpeculativeConfig(speculative="ngram", num_speculative_tokens=2, speculative_max_batch=8)
    sched = Scheduler(SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=64, policy="priority"),
                      CacheConfig(block_size=4, enable_prefix_caching=False), 5, 256, spec)
    sched.add_request(make_request("low", [1, 2, 3, 4], max_tokens=20, priority=5, arrival=0))
    _run(sched, {"low": [1]}, {"low": [2, 3]})
    sched.add_request(make_request("high", [5, 6, 7, 8], max_tokens=20, priority=0, arrival=1))
    _run(sched, {"low": [2, 3, 9], "high": [1]}, {"low": [4, 5], "high": [6, 7]})
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"high": 3} and out.total_num_scheduled_tokens == 3
    assert out.scheduled_spec_tokens == {"high": [6, 7]}
    assert [c.req_id for c in out.cached_reqs] == ["high"]
    assert "low" in out.finished_req_ids and sched.waiting.peek().request_id == "low"
    sched.update_from_output(out, ModelRunnerOutput(["high"], [[6, 7, 10]], spec_token_ids=[[]], num_accepted=[2]))
    sched.check_integrity()
