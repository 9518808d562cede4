"""A row's sampled ids into its request, up to the first stop, and the request's output: the step shared by
every kind of update (core/scheduler_update.py, core/decode_window.py); a request that stops is finished
here (the scheduler's `_finish`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmserve.core.request import Request, RequestStatus
from llmserve.core.token_stops import check_stop, follow_grammar
from llmserve.messages import EngineCoreOutput

if TYPE_CHECKING:
    from llmserve.core.scheduler import Scheduler


def append_tokens(scheduler: Scheduler, request: Request, token_ids: list[int], row_logprobs, now: float,
                  status: RequestStatus | None = None) -> EngineCoreOutput | None:
    """The row's ids in, up to a stop -> its output (None: a final-only request that goes on). `status`:
    the stop its ids already reached (taken in by the caller)."""
    accepted: list[int] = []
    for token_id in token_ids:
        request.append_output_token(token_id)
        accepted.append(token_id)
        status = check_stop(request, scheduler.max_model_len)
        if status is None and request.grammar is not None:
            status = follow_grammar(request, token_id)
        if status is not None:
            break
    out = EngineCoreOutput(request.request_id, accepted, new_logprobs=row_logprobs,
                           num_cached_tokens=max(request.num_cached_tokens, 0))
    if request.first_token_time is None:
        request.first_token_time = now
        out.scheduled_time = request.scheduled_time
        out.first_token_time = now
    if status is not None:
        if request.status == RequestStatus.RUNNING:
            scheduler.running.remove(request)
        else:  # preempted while its last step was in flight
            scheduler.waiting.remove(request)
        scheduler._finish(request, status)
        out.finish_reason = status.finish_reason()
        out.stop_reason = request.stop_reason
    if request.is_final_only:
        return None if status is None else _as_final(out, request)
    return out


def _as_final(out: EngineCoreOutput, request: Request) -> EngineCoreOutput:
    """A final-only request's one output: all its ids and its times (no earlier output carried them)."""
    out.new_token_ids = request.output_token_ids
    out.scheduled_time = request.scheduled_time
    out.first_token_time = request.first_token_time
    return out


def aborted_output(request: Request) -> EngineCoreOutput:
    """The output of a request ended by an abort (its ids too if it is final-only)."""
    out = EngineCoreOutput(request.request_id, [], finish_reason=request.status.finish_reason())
    return _as_final(out, request) if request.is_final_only else out
