"""The scheduler's second half, `Scheduler.update_from_output`: a step's sampled ids in (stops, the one
rollback of rejected drafts, the next drafts kept), and the step's outputs and stats. A plain decode step
(one token a row, nothing else asked for) takes a tight loop, a multi-step window its own
(core/decode_window.py), a pooling step its vectors; everything else the general loop."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from llmserve.core.decode_window import update_from_window
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.request import Request, RequestStatus
from llmserve.core.request_output import append_tokens
from llmserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from llmserve.core.spec_stats import SpecDecodeCounter
from llmserve.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason, SchedulerStats

if TYPE_CHECKING:
    from llmserve.core.scheduler import Scheduler


def update_from_output(scheduler: Scheduler, sched_out: SchedulerOutput,
                       runner_out: ModelRunnerOutput) -> EngineCoreOutputs:
    """The step's outputs (with those of requests aborted since the last step) and stats."""
    outputs = scheduler.take_aborted_outputs()
    now = time.time()
    if runner_out.pooled is not None:
        _update_pooled(scheduler, runner_out, outputs, now)
        num_generated = 0
    elif sched_out.num_steps > 1:
        num_generated = update_from_window(scheduler, sched_out, runner_out, outputs, now)
    elif _is_plain_decode(scheduler, sched_out, runner_out):
        num_generated = _update_plain(scheduler, runner_out, outputs, now)
    else:
        num_generated = _update_general(scheduler, sched_out, runner_out, outputs, now)
    return EngineCoreOutputs(outputs=outputs, stats=_stats(scheduler, sched_out, num_generated))


def _update_general(scheduler: Scheduler, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput,
                    outputs: list[EngineCoreOutput], now: float) -> int:
    """Any step: logprobs, prompt logprobs, drafts to roll back and to keep, siblings waiting on a prompt.
    Returns the number of tokens generated."""
    num_generated = 0
    logprobs = runner_out.logprobs or [None] * len(runner_out.req_ids)
    proposals = runner_out.spec_token_ids or [None] * len(runner_out.req_ids)
    prompt_logprobs = runner_out.prompt_logprobs or [None] * len(runner_out.req_ids)
    accepted = runner_out.num_accepted or [0] * len(runner_out.req_ids)
    for req_id, token_ids, row_logprobs, drafts, row_prompt, num_accepted in zip(
            runner_out.req_ids, runner_out.sampled_token_ids, logprobs, proposals, prompt_logprobs, accepted):
        request = scheduler.requests.get(req_id)
        if request is None:
            continue  # aborted during the step
        if scheduler.held_siblings and request.num_computed_tokens >= request.num_prompt_tokens:
            scheduler._release_siblings(request)
        if not token_ids:
            if row_prompt is not None:  # a prefill chunk: only its prompt logprobs to report
                outputs.append(EngineCoreOutput(req_id, [], prompt_logprobs=row_prompt))
            continue
        request.num_placeholders -= 1
        _reject_drafts(request, sched_out.scheduled_spec_tokens.get(req_id), num_accepted, scheduler.spec_counter)
        num_generated += len(token_ids)
        out = append_tokens(scheduler, request, token_ids, row_logprobs, now)
        if out is not None:
            out.prompt_logprobs = row_prompt
            outputs.append(out)
        if scheduler.spec_config.is_enabled and not request.is_finished:
            _store_drafts(request, drafts or [], scheduler.kv, scheduler.num_lookahead)
    if sched_out.use_speculation:
        scheduler.draft_backoff.observe(sum(bool(d) for d in proposals))
    return num_generated


def _update_pooled(scheduler: Scheduler, runner_out: ModelRunnerOutput, outputs: list[EngineCoreOutput],
                   now: float) -> None:
    """A pooling step: a row whose prompt ended has its vector, and ends (stop)."""
    for req_id, pooled in zip(runner_out.req_ids, runner_out.pooled):
        request = scheduler.requests.get(req_id)
        if request is None or pooled is None:
            continue  # aborted during the step, or a prompt chunk
        request.num_placeholders -= 1
        scheduler.running.remove(request)
        scheduler._finish(request, RequestStatus.FINISHED_STOPPED)
        outputs.append(EngineCoreOutput(req_id, [], finish_reason=FinishReason.STOP,
                                        num_cached_tokens=max(request.num_cached_tokens, 0),
                                        scheduled_time=request.scheduled_time, first_token_time=now,
                                        pooled=pooled))


def _is_plain_decode(scheduler: Scheduler, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> bool:
    """The step has only sampled ids to take in: no logprobs, drafts or siblings waiting on a prompt,
    and it did not look for drafts (the back-off counts the steps that found none)."""
    return not (runner_out.logprobs or runner_out.prompt_logprobs or runner_out.spec_token_ids
                or sched_out.scheduled_spec_tokens or sched_out.use_speculation or scheduler.held_siblings)


def _update_plain(scheduler: Scheduler, runner_out: ModelRunnerOutput, outputs: list[EngineCoreOutput],
                  now: float) -> int:
    """A plain step (`_is_plain_decode`): a row that samples one token and stops on nothing (its grammar, if
    any, takes the token and stays open) takes it in a tight loop; the others go through `append_tokens`.
    Returns the number of tokens generated."""
    num_generated = 0
    requests = scheduler.requests
    for req_id, token_ids in zip(runner_out.req_ids, runner_out.sampled_token_ids):
        request = requests.get(req_id)
        if request is None or not token_ids:
            continue  # aborted during the step, or a prompt chunk
        request.num_placeholders -= 1
        num_generated += len(token_ids)
        num_tokens = len(request.all_token_ids) + 1
        if (len(token_ids) == 1 and token_ids[0] not in request.any_stop_token_ids
                and num_tokens < request.max_num_tokens and request.first_token_time is not None
                and (request.grammar is None or request.grammar.accept_if_open(token_ids[0]))):  # last: it advances
            request.all_token_ids.append(token_ids[0])
            if not request.is_final_only:
                outputs.append(EngineCoreOutput(req_id, token_ids,
                                                num_cached_tokens=max(request.num_cached_tokens, 0)))
            continue
        out = append_tokens(scheduler, request, token_ids, None, now)
        if out is not None:
            outputs.append(out)
    return num_generated


def _reject_drafts(request: Request, drafts: list[int] | None, num_accepted: int,
                   spec_counter: SpecDecodeCounter) -> None:
    """Roll `num_computed_tokens` back over the drafts the target rejected (their KV is overwritten;
    the runner takes the count from the next step's diff): the one rollback of a speculative step."""
    if not drafts:
        return
    assert 0 <= num_accepted <= len(drafts), "more drafts accepted than scheduled"
    if num_accepted < len(drafts):
        request.num_computed_tokens -= len(drafts) - num_accepted
        request.num_runner_blocks = -1  # the next step sends the runner this row's diff (`send_blocks`)
    spec_counter.observe(len(drafts), num_accepted)


def _store_drafts(request: Request, drafts: list[int], kv: KVCacheManager, num_lookahead: int) -> None:
    """Keep the proposals for the next step (never past max_tokens) and give back the blocks that
    only rejected drafts used."""
    room = max(0, request.max_tokens - request.num_output_tokens - 1)
    request.spec_token_ids = drafts[:room]
    kv.trim(request, request.num_tokens + len(request.spec_token_ids) + num_lookahead)


def _stats(scheduler: Scheduler, sched_out: SchedulerOutput, num_generated: int) -> SchedulerStats:
    kv = scheduler.kv
    queries, hits = kv.take_prefix_stats()
    num_preemptions, scheduler.num_preemptions = scheduler.num_preemptions, 0
    num_held = scheduler.held_siblings.num_held()
    return SchedulerStats(num_running=len(scheduler.running),
                          num_waiting=len(scheduler.waiting) + num_held + len(scheduler.compiling)
                          + len(scheduler.kv_loading or ()),
                          kv_cache_usage=kv.usage(), num_kv_blocks=kv.pool.num_usable_blocks,
                          num_free_kv_blocks=kv.pool.get_num_free_blocks(), prefix_cache_queries=queries,
                          prefix_cache_hits=hits, num_preemptions=num_preemptions,
                          num_scheduled_tokens=sched_out.total_num_scheduled_tokens,
                          num_prompt_tokens=scheduler.num_step_prompt_tokens, num_generation_tokens=num_generated,
                          timestamp=time.time(), spec=scheduler.spec_counter.take())
