"""Stop rules applied after each sampled token: pure functions of the request."""

from __future__ import annotations

from llmserve.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """The finished status this request has reached with its last token, or None to go on."""
    last = request.all_token_ids[-1]
    if request.num_output_tokens >= request.sampling_params.min_tokens:
        if last in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if last in request.stop_token_ids:
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
