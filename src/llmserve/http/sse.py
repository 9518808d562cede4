"""Server-sent events as OpenAI frames them: `data: <json>` events, an error as an event, then `[DONE]`."""

from __future__ import annotations

from llmserve.http.errors import Classify, error_payload, to_api_error

SSE_DONE = b"data: [DONE]\n\n"

# Characters JSON leaves raw inside strings but str.splitlines breaks lines at (httpx's aiter_lines is built
# on it): U+0085, U+2028, U+2029 in UTF-8, and their JSON escapes.
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def line_safe(data: bytes) -> bytes:
    """Encoded JSON whose strings escape the characters above, so that an event is one line for every client
    (a model's text may hold them; SSE itself breaks lines only at CR and LF)."""
    if b"\xc2\x85" not in data and b"\xe2\x80" not in data:
        return data
    for raw, escaped in _LINE_BREAKS:
        data = data.replace(raw, escaped)
    return data


def data_event(payload: bytes, field: bytes = b"data: ") -> bytes:
    """One SSE event carrying encoded JSON (TGI writes its field as `data:`), line-safe."""
    return field + line_safe(payload) + b"\n\n"


def sse_error(exc: BaseException, classify: Classify = to_api_error) -> bytes:
    """`exc` as an SSE event in OpenAI's error shape (how a stream ends that cannot answer with a status)."""
    return data_event(error_payload(exc, classify))
