"""Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after optional text."""

from __future__ import annotations

from llmserve.server.tool_parsers.base import (Item, ToolParser, add_text, json_value_end, loads_or_none,
                                               partial_suffix_len, skip_whitespace)

MARKER = "[TOOL_CALLS]"


class MistralParser(ToolParser):
    """The array is taken whole: if any element is not a call of a known tool, the marker and the array stay
    in the content. `[TOOL_CALLS]` is a special token of Mistral's tokenizers, so outputs are decoded with
    special tokens kept. (The v11 form `[TOOL_CALLS]name[ARGS]{...}` is not parsed.)"""

    name = "mistral"
    template_markers = (MARKER,)
    needs_special_tokens = True

    def scan(self, text: str, final: bool) -> tuple[list[Item], int]:
        items: list[Item] = []
        pos = 0
        while True:
            start = text.find(MARKER, pos)
            if start < 0:
                end = len(text) if final else len(text) - partial_suffix_len(text[pos:], MARKER)
                add_text(items, text[pos:end])
                return items, max(end, pos)
            add_text(items, text[pos:start])
            value_start = skip_whitespace(text, start + len(MARKER))
            if value_start == len(text) and not final:
                return items, start
            end = json_value_end(text, value_start) if text[value_start:value_start + 1] in ("[", "{") else -1
            if end is None:
                if not final:
                    return items, start
                items.append(text[start:])
                return items, len(text)
            if end < 0:  # the marker without a JSON value after it
                pos = start + len(MARKER)
                items.append(MARKER)
                continue
            calls = self._calls(loads_or_none(text[value_start:end]))
            items.extend(calls if calls else [text[start:end]])
            pos = end

    def _calls(self, value) -> list[Item]:
        values = value if isinstance(value, list) else [value]
        calls = [self.call_from(v, ("arguments",)) for v in values]
        return calls if values and all(call is not None for call in calls) else []
