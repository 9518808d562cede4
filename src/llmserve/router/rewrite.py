"""Model names between a pool and its replicas: clients send and see the pool's name, replicas get and
answer with the name they serve (vLLM production-stack's way).

Requests: `model` of the JSON body becomes the replica's served name (the body stays untouched when it has
no `model` or already says so). Responses: the top-level `model` (TGI's /info: `model_id`) of a JSON body,
or of each SSE event's JSON, goes back from the served name to the pool's name. Everything else passes byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from llmserve.http.sse import line_safe

_MODEL_KEYS = ("model", "model_id")  # OpenAI's answers and chunks; TGI's GET /info
_EVENT_END = b"\n\n"
_DATA = b"data:"


@dataclass(frozen=True)
class ModelRename:
    """The model name a replica answers with (`served`) and the one the client asked for (`public`)."""

    served: str
    public: str

    @property
    def is_needed(self) -> bool:
        return self.served != self.public


def request_body(body: bytes, obj: dict[str, Any] | None, model: str) -> bytes:
    """The body with its `model` replaced by `model` (the original bytes when it has none or says so)."""
    if obj is None or "model" not in obj or obj["model"] == model:
        return body
    return msgspec.json.encode({**obj, "model": model})


def _renamed(obj: Any, rename: ModelRename) -> Any | None:
    """The object with its top-level model renamed; None when there is nothing to rename."""
    if not isinstance(obj, dict):
        return None
    keys = [k for k in _MODEL_KEYS if obj.get(k) == rename.served]
    return {**obj, **{k: rename.public for k in keys}} if keys else None


def json_body(body: bytes, rename: ModelRename) -> bytes:
    """A JSON response body with the served model name replaced by the pool's (else unchanged)."""
    try:
        renamed = _renamed(msgspec.json.decode(body), rename)
    except msgspec.DecodeError:
        return body
    return body if renamed is None else msgspec.json.encode(renamed)


def _data_line(line: bytes, rename: ModelRename) -> bytes:
    if not line.startswith(_DATA):
        return line
    payload = line[len(_DATA):].lstrip(b" ")
    if not payload.startswith(b"{"):  # [DONE]
        return line
    renamed = json_body(payload, rename)
    return line if renamed is payload else b"data: " + line_safe(renamed)


def sse_event(event: bytes, rename: ModelRename) -> bytes:
    """One SSE event (its lines, without the blank line ending it) with its data renamed."""
    return b"\n".join(_data_line(line, rename) for line in event.split(b"\n"))


class SseRenamer:
    """Renames the model in an SSE stream that arrives in arbitrary pieces: complete events go out
    renamed, a partial event waits for the rest."""

    def __init__(self, rename: ModelRename) -> None:
        self.rename = rename
        self.pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self.pending + chunk
        end = data.rfind(_EVENT_END)
        if end < 0:
            self.pending = data
            return b""
        self.pending = data[end + len(_EVENT_END):]
        events = data[:end].split(_EVENT_END)
        return b"".join(sse_event(e, self.rename) + _EVENT_END for e in events)

    def flush(self) -> bytes:
        """What is left at the end of the stream (a last event without its blank line), renamed."""
        rest, self.pending = self.pending, b""
        return sse_event(rest, self.rename) if rest else b""

    @property
    def is_at_event_boundary(self) -> bool:
        return not self.pending
