"""Preemption by recompute, the scheduler's way out when blocks run out: the lowest-priority running request
(the newest under FCFS) gives its blocks back and returns to the front of the waiting queue, taken out of
the step being scheduled if it was in it already. `Scheduler` (core/scheduler.py) inherits it and owns the
state it reads."""

from __future__ import annotations

from llmserve.config import SchedulerConfig
from llmserve.core.block_pool import KVBlock
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.request import Request, RequestStatus
from llmserve.core.request_queue import FCFSQueue, PriorityQueue
from llmserve.core.sched_output import SchedulerOutput


class Preemption:
    """What preemption reads and writes of the scheduler's state (set by `Scheduler.__init__`)."""

    config: SchedulerConfig
    kv: KVCacheManager
    num_lookahead: int
    running: list[Request]
    waiting: FCFSQueue | PriorityQueue
    rows_to_advance: list[Request]
    num_step_rows: int
    num_step_prompt_tokens: int
    prefill_budget: int
    num_preemptions: int
    seen_by_runner: set[str]
    finished_req_ids: set[str]

    def _allocate_or_preempt(self, out: SchedulerOutput, request: Request,
                             num_new: int) -> tuple[list[KVBlock] | None, int, int]:
        """Blocks for `request`'s new tokens, preempting the lowest-priority running request until they fit.

        Returns the new blocks (None when `request` itself was preempted), the token budget given back by
        victims scheduled earlier in this step, and how many victims stood before `request` in `running`.
        """
        budget_back = num_before = 0
        while True:
            new_blocks = self.kv.allocate_slots(request, num_new, num_lookahead_tokens=self.num_lookahead)
            if new_blocks is not None:
                return new_blocks, budget_back, num_before
            victim = self._pick_victim()
            num_before += self.running.index(victim) < self.running.index(request)
            budget_back += self._unschedule(out, victim)
            self._preempt(victim)
            if victim is request:
                return None, budget_back, num_before

    def _pick_victim(self) -> Request:
        """The lowest-priority running request (the newest under FCFS), perhaps one scheduled earlier in
        this step; never one that outranks the request asking for blocks (it is running too)."""
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _unschedule(self, out: SchedulerOutput, request: Request) -> int:
        """Take `request` out of this step's output (it is being preempted); returns its scheduled tokens."""
        num = out.num_scheduled_tokens.pop(request.request_id, 0)
        if num == 0:
            return 0
        out.scheduled_spec_tokens.pop(request.request_id, None)
        out.cached_reqs = [c for c in out.cached_reqs if c.req_id != request.request_id]
        self.num_step_rows -= 1
        if request in self.rows_to_advance:
            self.rows_to_advance.remove(request)
        else:  # a plain decode row, moved on as it was scheduled: back
            request.num_computed_tokens -= 1
            request.num_placeholders -= 1
            if request.num_computed_tokens < request.num_prompt_tokens:
                self.num_step_prompt_tokens -= 1
        if request.num_tokens_with_placeholders - request.num_computed_tokens > 1:
            self.prefill_budget += num  # it was a prompt chunk
        return num

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        if request.request_id in self.seen_by_runner:
            self.seen_by_runner.discard(request.request_id)
            self.finished_req_ids.add(request.request_id)
        self.waiting.add_front(request)
