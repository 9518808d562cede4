"""A request's stops on its tokens, checked after each sampled one: EOS, a stop token id, max_tokens, the
context length, a grammar's end (pure functions of the request). Stop strings, found in the detokenized
text, are the front's: engine/stop_strings.py."""

from __future__ import annotations

import logging

from llmserve.core.request import Request, RequestStatus

logger = logging.getLogger(__name__)


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


def follow_grammar(request: Request, token_id: int) -> RequestStatus | None:
    """Advance a structured request's grammar over a kept token: stopped once the grammar is complete
    (its stop token taken)."""
    if not request.grammar.accept(token_id):  # the bitmask allowed it, so the grammar must
        logger.error("request %s: token %d broke its grammar; ending it", request.request_id, token_id)
        return RequestStatus.FINISHED_ABORTED
    return RequestStatus.FINISHED_STOPPED if request.grammar.is_terminated else None
