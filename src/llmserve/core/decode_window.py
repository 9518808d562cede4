"""Multi-step decoding, the scheduler's side: a window is one engine step that runs several decode
forwards back to back. The runner's side is worker/decode_window.py.

Where no request watches its tokens one by one (each reports only its final output), the host work of a
step (scheduling, the bookkeeping of its sampled ids, outputs) need not run after every forward: the
scheduler gives each running request up to `num_scheduler_steps` tokens at once (`schedule_window`), the
runner runs that many forwards of one token a row (a row drops out after its own count), and
`update_from_window` takes each row's ids in one go. vLLM's V0 engine called this multi-step scheduling.
A row that samples a token it stops on (EOS, a stop id) runs no further forward of the window. While
requests wait for a free seat a window ends when its first row does; in the engine-core process a request
(or an abort) that arrives meanwhile ends the window after the forward it arrives in, and the scheduler
rolls back the forwards a row did not run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmserve.core.kv_cache_manager import KVCacheManager, cdiv
from llmserve.core.request import Request, RequestStatus
from llmserve.core.request_output import append_tokens
from llmserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from llmserve.messages import EngineCoreOutput

if TYPE_CHECKING:
    from llmserve.core.scheduler import Scheduler


def schedule_window(scheduler: Scheduler, out: SchedulerOutput, budget: int) -> bool:
    """A window where one can run: every running request decodes its counted tokens, one a forward;
    False (nothing scheduled) where none can."""
    num_forwards = num_window_forwards(scheduler)
    if num_forwards == 1 or not _can_open_window(scheduler, budget):
        return False
    # while requests wait for a seat the window ends when its first row does: no seat idles meanwhile
    counts = window_counts(scheduler.running, num_forwards, scheduler.kv, is_even=bool(len(scheduler.waiting)))
    if counts is None:
        return False
    kv, scheduled = scheduler.kv, out.num_scheduled_tokens
    for request, num in zip(scheduler.running, counts):
        req_id, num_after = request.request_id, request.num_computed_tokens + num
        num_blocks = len(kv.req_to_blocks[req_id])
        if num_after > kv.num_slots(req_id) or num_blocks != request.num_runner_blocks:
            scheduler.send_blocks(out, request, kv.grow(request, num_after))
        kv.cache_full_blocks(request, num_after)  # blocks its known tokens filled
        scheduled[req_id] = num
        request.num_computed_tokens = num_after
        request.num_placeholders = num
    scheduler.num_step_rows = len(counts)
    out.num_steps = max(counts)
    return True


def _can_open_window(scheduler: Scheduler, budget: int) -> bool:
    """No request reads its tokens as they come or follows a grammar, and none waits for a seat that a
    running request would hold for the whole window (or for a sibling's prompt, or for its KV load)."""
    waiting, num_running = scheduler.waiting, len(scheduler.running)
    return not (num_running > budget or scheduler.num_streamed or scheduler.num_structured
                or scheduler.held_siblings or scheduler.kv_loading
                or (len(waiting) and num_running < scheduler.config.max_num_seqs))


def num_window_forwards(scheduler: Scheduler) -> int:
    """The most forwards a window may run now: none with speculation on, except while it backs off after
    a step that found no drafts (core/spec_stats.DraftBackoff), for the forwards it skips."""
    num_forwards = scheduler.config.num_scheduler_steps or 1
    if not scheduler.spec_config.is_enabled:
        return num_forwards
    backoff = scheduler.draft_backoff
    return min(num_forwards, backoff.num_skips_left) if backoff.is_skipping else 1


def window_counts(running: list[Request], num_forwards: int, kv: KVCacheManager,
                  is_even: bool = False) -> list[int] | None:
    """Per running request the forwards it runs in a window (`num_forwards`, or fewer where its
    max_tokens or the context ends sooner; with `is_even` all run as many as the shortest), or None when
    no window can run now: a row that is not in plain decode (a prompt chunk to go, a token in flight),
    too few free blocks for all of them, or no row with two tokens to go. The caller checks the rest (no
    drafts, grammars or streamed requests)."""
    counts: list[int] = []
    for request in running:
        num_known = len(request.all_token_ids)
        if num_known != request.num_computed_tokens + 1:
            return None
        counts.append(min(num_forwards, request.max_num_tokens - num_known))
    if is_even and counts:
        counts = [min(counts)] * len(counts)
    if not counts or max(counts) < 2:
        return None
    num_free = kv.pool.get_num_free_blocks()
    if num_free < len(running) * cdiv(num_forwards, kv.block_size) * kv.num_groups:  # the bound is not enough
        num_free -= sum(kv.num_blocks_to_grow(request, request.num_computed_tokens + num)
                        for request, num in zip(running, counts))
    return counts if num_free >= 0 else None


def update_from_window(scheduler: Scheduler, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput,
                       outputs: list[EngineCoreOutput], now: float) -> int:
    """update_from_output for a window, whose rows report only their final output, follow no grammar
    and have their first token: a row whose ids stop on nothing only takes them in; the others go through
    `append_tokens`. A window the runner ended early gave a row fewer ids than forwards counted: the rest
    is rolled back. Returns the number of tokens generated."""
    num_generated = 0
    scheduled = sched_out.num_scheduled_tokens
    for req_id, token_ids in zip(runner_out.req_ids, runner_out.sampled_token_ids):
        request = scheduler.requests.get(req_id)
        if request is None:
            continue  # aborted during the step
        num_generated += len(token_ids)
        request.num_placeholders = 0
        request.num_computed_tokens -= scheduled[req_id] - len(token_ids)  # forwards the window did not run
        if request.any_stop_token_ids.isdisjoint(token_ids):  # (its count stops at max_num_tokens)
            known = request.all_token_ids
            known += token_ids
            if len(known) < request.max_num_tokens:
                continue
            out = append_tokens(scheduler, request, [], None, now, RequestStatus.FINISHED_LENGTH)
        else:  # a stop id: taken in one by one (min_tokens)
            out = append_tokens(scheduler, request, token_ids, None, now)
        if out is not None:
            outputs.append(out)  # it ended
    return num_generated
