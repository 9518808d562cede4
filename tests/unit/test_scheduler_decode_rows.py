"""The scheduler's plain decode rows (core/decode_rows.py, core/scheduler_update.py): stops,
aborts and streamed outputs in one step's update; blocks handed out in row order until the pool runs dry,
then the general path's preemption."""

from __future__ import annotations

from llmserve.core.sched_output import ModelRunnerOutput
from llmserve.messages import FinishReason
from tests.unit.core_helpers import EOS, fake_runner_output, make_request, make_scheduler


def test_decode_rows_stop_on_eos_length_and_abort_in_one_vectorised_update():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=64)
    prompts = {"eos": [1, 2, 3], "len": [4, 5, 6], "go": [7, 8, 9], "gone": [10, 11], "stream": [12, 13]}
    for req_id, prompt in prompts.items():
        request = make_request(req_id, prompt, max_tokens=2 if req_id == "len" else 8)
        request.is_final_only = req_id != "stream"
        sched.add_request(request)
    out = sched.schedule()  # the prompts: every row samples its first token (general path)
    sched.update_from_output(out, fake_runner_output(sched, out, token=5))
    out = sched.schedule()  # all five are plain decode rows now
    assert dict(out.num_scheduled_tokens) == dict.fromkeys(prompts, 1)
    sched.abort_requests(["gone"])
    ids = [EOS, 6, 6, 6, 6]  # rows in order: eos, len, go, gone, stream
    result = sched.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens), [[i] for i in ids]))
    finished = {o.request_id: o.finish_reason for o in result.outputs if o.finish_reason is not None}
    assert finished == {"eos": FinishReason.STOP, "len": FinishReason.LENGTH, "gone": FinishReason.ABORT}
    streamed = [o for o in result.outputs if o.request_id == "stream"]
    assert [o.new_token_ids for o in streamed] == [[6]]
    assert sched.requests["go"].all_token_ids == [7, 8, 9, 5, 6] and sched.requests["go"].num_placeholders == 0
    assert result.stats.num_generation_tokens == 4  # the aborted row's id is dropped
    sched.check_integrity()


def test_decode_rows_get_blocks_in_row_order_and_the_general_path_preempts_when_they_run_out():
    sched = make_scheduler(num_blocks=5, block_size=4, budget=64)  # 4 usable blocks
    for req_id in "abc":
        sched.add_request(make_request(req_id, [1, 2, 3], max_tokens=8, ignore_eos=True))
    for _ in range(2):  # the prompts, then the 4th token: one full block each
        out = sched.schedule()
        sched.update_from_output(out, fake_runner_output(sched, out))
    out = sched.schedule()  # all three need a 2nd block, one is free: a takes it, b preempts c (the newest)
    assert dict(out.num_scheduled_tokens) == {"a": 1, "b": 1}
    assert [(c.req_id, c.num_old_blocks, len(c.new_block_ids)) for c in out.cached_reqs] == [("a", 1, 1), ("b", 1, 1)]
    assert sched.num_preemptions == 1 and [r.request_id for r in sched.running] == ["a", "b"]
    assert sched.requests["c"].num_computed_tokens == 0 and sched.requests["c"].num_placeholders == 0
    sched.check_integrity()
