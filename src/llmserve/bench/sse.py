"""Server-sent events: an incremental decoder, and the parsing of OpenAI completions and chat chunks."""

from __future__ import annotations

import codecs
from dataclasses import dataclass

import msgspec

DONE = "[DONE]"


class ProtocolError(Exception):
    """The server's answer is not what the OpenAI API specifies."""


def _split_lines(text: str) -> list[str]:
    """SSE's lines: ends at LF, CRLF or CR only (not at U+2028 and the others str.splitlines takes, which a
    server may leave raw inside JSON strings)."""
    return text.replace("\r\n", "\n").replace("\r", "\n").split("\n")


class SSEDecoder:
    """text/event-stream bytes in (split anywhere), the `data` of each complete event out.

    Lines end in LF, CRLF or CR; comment lines (': ping') and fields other than `data` are skipped;
    the data lines of one event are joined with LF.
    """

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buffer = ""
        self._data: list[str] = []

    def feed(self, raw: bytes) -> list[str]:
        self._buffer += self._utf8.decode(raw)
        lines = self._take_lines()
        return [event for line in lines if (event := self._on_line(line)) is not None]

    def close(self) -> list[str]:
        """The last event, where the stream ended without a blank line."""
        rest = self._buffer + self._utf8.decode(b"", final=True)
        self._buffer = ""
        events = [e for line in _split_lines(rest) if (e := self._on_line(line)) is not None]
        final = self._on_line("")
        return events + ([final] if final is not None else [])

    def _take_lines(self) -> list[str]:
        # A CR at the very end may be the first half of a CRLF: keep it until the next bytes come.
        end = len(self._buffer) - 1 if self._buffer.endswith("\r") else len(self._buffer)
        cut = max(self._buffer.rfind("\n", 0, end), self._buffer.rfind("\r", 0, end))
        if cut < 0:
            return []
        complete, self._buffer = self._buffer[: cut + 1], self._buffer[cut + 1:]
        return _split_lines(complete)[:-1]

    def _on_line(self, line: str) -> str | None:
        if not line:
            event = "\n".join(self._data) if self._data else None
            self._data = []
            return event
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None


@dataclass(frozen=True)
class Usage:
    num_prompt_tokens: int | None
    num_completion_tokens: int | None


@dataclass(frozen=True)
class Chunk:
    """One parsed chunk (or a whole non-streamed response)."""

    text: str  # generated text it carries ("" for role-only, finish-only and usage-only chunks)
    usage: Usage | None = None
    error: str | None = None  # an error object the server sent instead of a chunk


def parse_chunk(data: str | bytes) -> Chunk:
    """Parse a completions or chat.completion(.chunk) object (the `data` of one event)."""
    try:
        obj = msgspec.json.decode(data)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"not JSON: {_excerpt(data)} ({e})") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"expected a JSON object, got {_excerpt(data)}")
    if obj.get("error") is not None:
        return Chunk("", error=_error_text(obj["error"]))
    if "choices" not in obj and "usage" not in obj:
        raise ProtocolError(f"neither choices nor usage in {_excerpt(data)}")
    return Chunk(_choice_text(obj.get("choices")), usage=_usage(obj.get("usage")))


def _choice_text(choices: object) -> str:
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    message = choice.get("delta") or choice.get("message")
    if isinstance(message, dict):  # chat; reasoning models stream part of their output apart
        parts = (message.get(k) for k in ("content", "reasoning_content", "reasoning"))
        return "".join(p for p in parts if isinstance(p, str))
    text = choice.get("text")
    return text if isinstance(text, str) else ""


def _usage(usage: object) -> Usage | None:
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return Usage(prompt if isinstance(prompt, int) else None, completion if isinstance(completion, int) else None)


def _error_text(error: object) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def _excerpt(data: str | bytes, limit: int = 200) -> str:
    text = data.decode(errors="replace") if isinstance(data, bytes) else data
    return repr(text if len(text) <= limit else text[:limit] + "...")
