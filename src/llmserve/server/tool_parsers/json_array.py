"""The output of tool_choice "required": a JSON array of {"name": ..., "parameters": {...}} (the grammar
built by server/tool_calls.py enforces it), read one element at a time so that streams get each call as
soon as its object closes."""

from __future__ import annotations

from llmserve.server.tool_parsers.base import Item, ToolParser, json_value_end, loads_or_none, skip_whitespace


class JsonArrayParser(ToolParser):
    """Not a --tool-call-parser choice: the parser of grammar-constrained outputs. What does not parse (an
    output cut by max_tokens) is left as content."""

    name = "json_array"

    def __init__(self, tool_names: frozenset[str]) -> None:
        super().__init__(tool_names)
        self.is_open = False  # the `[` was read

    def scan(self, text: str, final: bool) -> tuple[list[Item], int]:
        items: list[Item] = []
        pos = 0
        while True:
            start = skip_whitespace(text, pos, "," if self.is_open else "")
            if start < len(text) and not self.is_open and text[start] == "[":
                self.is_open, pos = True, start + 1
                continue
            if self.is_open and text[start:start + 1] == "]":  # the end: only whitespace may follow
                return items, len(text)
            end = json_value_end(text, start) if self.is_open and text[start:start + 1] == "{" else None
            if end is None:
                if not final:
                    return items, pos
                if start < len(text):
                    items.append(text[start:])
                return items, len(text)
            call = self.call_from(loads_or_none(text[start:end]), ("parameters",))
            items.append(call if call is not None else text[start:end])
            pos = end
