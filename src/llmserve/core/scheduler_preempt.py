"""Preemption by recompute, the scheduler's way out when blocks run out: the lowest-priority running request
(the newest under FCFS) gives its blocks back and returns to the front of the waiting queue, taken out of
the step being scheduled if it was in it already. Blocks a KV connector's saves still hold are waited for
first (a copy out takes milliseconds; a recompute, a whole prompt)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmserve.core.block_pool import KVBlock
from llmserve.core.request import Request, RequestStatus
from llmserve.core.sched_output import SchedulerOutput

if TYPE_CHECKING:
    from llmserve.core.scheduler import Scheduler


def allocate_or_preempt(scheduler: Scheduler, out: SchedulerOutput, request: Request,
                        num_new: int) -> tuple[list[KVBlock] | None, int, int]:
    """Blocks for `request`'s new tokens, preempting the lowest-priority running request until they fit.

    Returns the new blocks (None when `request` itself was preempted), the token budget given back by
    victims scheduled earlier in this step, and how many victims stood before `request` in `running`.
    """
    budget_back = num_before = 0
    running = scheduler.running
    while True:
        new_blocks = scheduler.kv.allocate_slots(request, num_new, num_lookahead_tokens=scheduler.num_lookahead)
        if new_blocks is not None:
            return new_blocks, budget_back, num_before
        if scheduler.release_saved_blocks():
            continue
        victim = pick_victim(running, scheduler.config.policy)
        num_before += running.index(victim) < running.index(request)
        budget_back += _unschedule(scheduler, out, victim)
        preempt(scheduler, victim)
        if victim is request:
            return None, budget_back, num_before


def pick_victim(running: list[Request], policy: str) -> Request:
    """The lowest-priority running request (the newest under FCFS), perhaps one scheduled earlier in
    this step; never one that outranks the request asking for blocks (it is running too)."""
    if policy == "priority":
        return max(running, key=lambda r: (r.priority, r.arrival_time))
    return running[-1]


def _unschedule(scheduler: Scheduler, out: SchedulerOutput, request: Request) -> int:
    """Take `request` out of this step's output (it is being preempted); returns its scheduled tokens."""
    num = out.num_scheduled_tokens.pop(request.request_id, 0)
    if num == 0:
        return 0
    out.scheduled_spec_tokens.pop(request.request_id, None)
    out.cached_reqs = [c for c in out.cached_reqs if c.req_id != request.request_id]
    scheduler.num_step_rows -= 1
    if request in scheduler.rows_to_advance:
        scheduler.rows_to_advance.remove(request)
    else:  # a plain decode row, moved on as it was scheduled: back
        request.num_computed_tokens -= 1
        request.num_placeholders -= 1
        if request.num_computed_tokens < request.num_prompt_tokens:
            scheduler.num_step_prompt_tokens -= 1
    if request.num_tokens_with_placeholders - request.num_computed_tokens > 1:
        scheduler.prefill_budget += num  # it was a prompt chunk
    return num


def preempt(scheduler: Scheduler, request: Request) -> None:
    """The running request gives its blocks back and waits at the front of the queue, to recompute."""
    scheduler.running.remove(request)
    scheduler.kv.free(request)
    request.status = RequestStatus.PREEMPTED
    request.num_computed_tokens = 0
    request.spec_token_ids = []
    request.num_preemptions += 1
    scheduler.num_preemptions += 1
    if request.request_id in scheduler.seen_by_runner:
        scheduler.seen_by_runner.discard(request.request_id)
        scheduler.finished_req_ids.add(request.request_id)
    scheduler.waiting.add_front(request)
