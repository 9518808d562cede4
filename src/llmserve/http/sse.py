"""Server-sent events as OpenAI frames them: `data: <json>` events, an error as an event, then `[DONE]`."""

from __future__ import annotations

from llmserve.http.errors import Classify, error_payload, to_api_error

SSE_DONE = b"data: [DONE]\n\n"


def sse_error(exc: BaseException, classify: Classify = to_api_error) -> bytes:
    """`exc` as an SSE event in OpenAI's error shape (how a stream ends that cannot answer with a status)."""
    return b"data: " + error_payload(exc, classify) + b"\n\n"
