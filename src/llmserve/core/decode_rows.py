"""The running path's fast lane: plain decode rows (one token each, no drafts) scheduled in one tight loop,
each moved on as it is scheduled. The scheduler's general running path takes the first row that needs more."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmserve.core.request import Request
from llmserve.core.sched_output import SchedulerOutput

if TYPE_CHECKING:
    from llmserve.core.scheduler import Scheduler


def schedule_decode_rows(scheduler: Scheduler, out: SchedulerOutput, start: int, budget: int) -> int:
    """Schedules the plain decode rows from running[start] on: one token each, no drafts; a row whose blocks
    are full gets one here. Each samples in this step, so it moves on at once (`_advance_scheduled` for one
    row; a row with a grammar is left to it). Returns how many; the first row that needs more (a prompt
    chunk, drafts, a preemption, or nothing) is left to the general path."""
    kv, num_lookahead = scheduler.kv, scheduler.num_lookahead
    block_size, num_groups = kv.block_size, kv.num_groups
    req_to_blocks, num_cached_blocks = kv.req_to_blocks, kv.num_cached_blocks
    is_caching, scheduled = kv.enable_caching, out.num_scheduled_tokens
    rows = scheduler.running[start:start + budget]
    for i, request in enumerate(rows):
        req_id, num_after = request.request_id, request.num_computed_tokens + 1  # tokens computed after it
        num_known = len(request.all_token_ids)
        if (num_known + request.num_placeholders != num_after or request.spec_token_ids
                or (request.num_placeholders and has_all_tokens_in_flight(request))):
            return i
        num_blocks = len(req_to_blocks[req_id])  # of every group (a block position holds num_groups)
        if num_after + num_lookahead > num_blocks // num_groups * block_size \
                or num_blocks != request.num_runner_blocks:
            new_blocks = kv.allocate_slots(request, 1, num_lookahead_tokens=num_lookahead)
            if new_blocks is None:
                return i  # out of blocks: the general path preempts
            scheduler.send_blocks(out, request, new_blocks)
        elif is_caching and (num_after if num_after < num_known else num_known) // block_size > \
                num_cached_blocks.get(req_id, 0):
            kv.cache_full_blocks(request, num_after)  # a block fills in this step
        scheduled[req_id] = 1
        if request.grammar is not None:
            scheduler.rows_to_advance.append(request)
            continue
        request.num_computed_tokens = num_after
        request.num_placeholders += 1
        if num_after <= request.num_prompt_tokens:  # its last prompt token
            scheduler.num_step_prompt_tokens += 1
    return len(rows)


def has_all_tokens_in_flight(request: Request) -> bool:
    """Its tokens in flight reach max_tokens or the context length: nothing more to schedule."""
    return 0 < request.num_placeholders >= request.max_num_tokens - len(request.all_token_ids)
