"""Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}` (or "arguments"), several separated by
`;`, opening the output or after `<|python_tag|>`."""

from __future__ import annotations

from llmserve.server.tool_parsers.base import (Item, ToolParser, add_text, json_value_end, loads_or_none,
                                               partial_suffix_len, skip_whitespace)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    """Calls start where the output's first non-space character is `{`, or after `<|python_tag|>`. The calls
    run while JSON objects follow (separated by `;` and spaces, which are dropped); an object that is not a
    call of a known tool ends them and stays in the content, as does the text after the last call."""

    name = "llama3_json"
    template_markers = (PYTHON_TAG, "ipython")

    def __init__(self, tool_names: frozenset[str]) -> None:
        super().__init__(tool_names)
        self.mode = "start"  # start (nothing settled yet) | text | calls

    def scan(self, text: str, final: bool) -> tuple[list[Item], int]:
        items: list[Item] = []
        pos = 0
        while True:
            step = {"start": self._start, "text": self._text, "calls": self._calls}[self.mode]
            new_pos = step(text, pos, final, items)
            if new_pos is None:
                return items, pos
            if new_pos == len(text) and self.mode != "start":
                return items, new_pos
            pos = new_pos

    def _start(self, text: str, pos: int, final: bool, items: list[Item]) -> int | None:
        first = skip_whitespace(text, pos)
        if first == len(text) or (PYTHON_TAG.startswith(text[first:]) and not final):
            if not final:
                return None
            add_text(items, text[pos:])
            self.mode = "text"
            return len(text)
        self.mode = "calls" if text[first] == "{" else "text"
        add_text(items, text[pos:first])
        return first

    def _text(self, text: str, pos: int, final: bool, items: list[Item]) -> int | None:
        tag = text.find(PYTHON_TAG, pos)
        if tag < 0:
            end = len(text) if final else len(text) - partial_suffix_len(text[pos:], PYTHON_TAG)
            add_text(items, text[pos:end])
            return None if end == pos else end
        add_text(items, text[pos:tag])
        self.mode = "calls"
        return tag + len(PYTHON_TAG)

    def _calls(self, text: str, pos: int, final: bool, items: list[Item]) -> int | None:
        start = skip_whitespace(text, pos, ";")
        if start == len(text):
            return len(text) if final else None
        if text[start] != "{":
            self.mode = "text"
            return start
        end = json_value_end(text, start)
        if end is None:
            if not final:
                return None
            add_text(items, text[start:])
            return len(text)
        call = self.call_from(loads_or_none(text[start:end]))
        if call is None:
            self.mode = "text"
            add_text(items, text[start:end])
        else:
            items.append(call)
        return end
