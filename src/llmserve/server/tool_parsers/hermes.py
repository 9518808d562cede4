"""Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text around them."""

from __future__ import annotations

from llmserve.server.tool_parsers.base import Item, ToolParser, add_text, loads_or_none, partial_suffix_len

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    """A block whose body is not a call of a known tool stays in the content, tags included; so does an
    unclosed block, unless the output ends inside it with a whole call (a model stopped before its end tag)."""

    name = "hermes"
    template_markers = (START,)

    def scan(self, text: str, final: bool) -> tuple[list[Item], int]:
        items: list[Item] = []
        pos = 0
        while True:
            start = text.find(START, pos)
            if start < 0:
                end = len(text) if final else len(text) - partial_suffix_len(text[pos:], START)
                add_text(items, text[pos:end])
                return items, max(end, pos)
            add_text(items, text[pos:start])
            end = text.find(END, start + len(START))
            if end < 0:
                if not final:
                    return items, start
                call = self.call_from(loads_or_none(text[start + len(START):]))
                items.append(call if call is not None else text[start:])
                return items, len(text)
            call = self.call_from(loads_or_none(text[start + len(START):end]))
            pos = end + len(END)
            items.append(call if call is not None else text[start:pos])
