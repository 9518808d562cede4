"""What every tool-call parser shares: the scan contract, JSON helpers, and folding a scan into content + calls.

A parser reads the model's text and splits it into items: plain text (the message content) and parsed
calls. `scan(text, final)` works on text deltas: it returns the items of a settled prefix of `text` and how
many characters that prefix holds; the rest (a possible start of a call marker, a call not closed yet) is
held back and given again, with more text after it, on the next scan. With `final` the whole text settles:
an unfinished call is left as content. A parser instance belongs to one output (it may keep state between
scans); scanning the text in one piece or in any pieces gives the same items.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any

import msgspec


class ParsedCall(msgspec.Struct, frozen=True):
    name: str
    arguments: str  # JSON text of the arguments object (compact)


Item = str | ParsedCall


class ParsedOutput(msgspec.Struct):
    content: str | None
    calls: list[ParsedCall]


class ToolParser(ABC):
    """One model family's tool-call syntax. Subclasses set `name` (the --tool-call-parser value) and
    `template_markers` (strings whose presence in a chat template selects this parser)."""

    name: str = ""
    template_markers: tuple[str, ...] = ()
    needs_special_tokens: bool = False  # its markers are special tokens: decode with skip_special_tokens off

    def __init__(self, tool_names: frozenset[str]) -> None:
        self.tool_names = tool_names

    @abstractmethod
    def scan(self, text: str, final: bool) -> tuple[list[Item], int]:
        """Items of text[:consumed] and `consumed` (len(text) when final)."""

    def call_from(self, obj: Any, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedCall | None:
        """{"name": <a tool's name>, "arguments": {...}} -> a call; None when it is not one."""
        if not isinstance(obj, dict) or obj.get("name") not in self.tool_names:
            return None
        keys = [key for key in argument_keys if key in obj]
        if len(keys) > 1 or set(obj) - {"name", *keys}:
            return None
        arguments = obj[keys[0]] if keys else {}
        if isinstance(arguments, str):  # some models send the arguments as JSON text
            arguments = loads_or_none(arguments)
        if not isinstance(arguments, dict):
            return None
        return ParsedCall(obj["name"], dump_arguments(arguments))


def parse_output(parser: ToolParser, text: str, max_calls: int | None = None) -> ParsedOutput:
    """The whole text at once: content (None when only whitespace is left beside calls) and calls."""
    items, consumed = parser.scan(text, final=True)
    assert consumed == len(text), "a final scan must settle the whole text"
    calls = [item for item in items if isinstance(item, ParsedCall)]
    content = "".join(item for item in items if isinstance(item, str))
    if calls and not content.strip():
        content = None
    return ParsedOutput(content, calls[:max_calls])


def add_text(items: list[Item], text: str) -> None:
    if text:
        items.append(text)


def dump_arguments(arguments: dict) -> str:
    return json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))


def loads_or_none(text: str) -> Any:
    """JSON, or None; raw control characters in strings are taken (models and grammars emit them), the
    arguments are dumped again with them escaped."""
    try:
        return json.loads(text, strict=False)
    except ValueError:
        return None


_CONTROL_ESCAPES = {code: f"\\u{code:04x}" for code in range(0x20)}


def escape_controls(json_text: str) -> str:
    """JSON text without raw control characters: where JSON has no whitespace but single spaces (compact
    separators), any control character is inside a string, where it must be escaped. Works on pieces."""
    return json_text.translate(_CONTROL_ESCAPES)


def partial_suffix_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker` (text to hold back)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def json_value_end(text: str, start: int) -> int | None:
    """End (exclusive) of the JSON object or array opening at text[start], by bracket depth outside
    strings; None when it is not closed yet. Whether it is valid JSON is json.loads's call."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        char = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def skip_whitespace(text: str, start: int, extra: str = "") -> int:
    while start < len(text) and (text[start].isspace() or text[start] in extra):
        start += 1
    return start
