"""A parser driven by text deltas: each delta in, the content and the calls it settles out.

What comes out, joined, equals parse_output() of the whole text: the same calls in the same order, and
the same content (whitespace-only content beside calls is held back and, as there, dropped).
"""

from __future__ import annotations

import msgspec

from llmserve.server.tool_parsers.base import ParsedCall, ToolParser


class ToolDelta(msgspec.Struct):
    """Content text, or a whole call with its position among the output's calls."""

    content: str | None = None
    call: ParsedCall | None = None
    index: int = 0


class ToolCallStream:
    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.held = ""  # text given to the parser but not settled yet
        self.pending_space = ""  # whitespace-only content, sent once other content comes
        self.has_content = False
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> list[ToolDelta]:
        self.held += text
        items, consumed = self.parser.scan(self.held, final)
        self.held = self.held[consumed:]
        deltas: list[ToolDelta] = []
        for item in items:
            if isinstance(item, str):
                deltas.extend(self._content(item))
            elif self.max_calls is None or self.num_calls < self.max_calls:
                deltas.append(ToolDelta(call=item, index=self.num_calls))
                self.num_calls += 1
        if final and self.pending_space and not self.num_calls:
            deltas.append(ToolDelta(content=self.pending_space))
            self.pending_space = ""
        return deltas

    def _content(self, text: str) -> list[ToolDelta]:
        if not self.has_content:
            self.pending_space += text
            if not self.pending_space.strip():
                return []
            text, self.pending_space, self.has_content = self.pending_space, "", True
        return [ToolDelta(content=text)]
