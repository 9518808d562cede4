"""gpt-oss (OpenAI's harmony format; vLLM's `openai` parser): a call is a message to a function,
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` (the recipient may stand
in the role part instead: `<|start|>assistant to=functions.NAME<|channel|>commentary ...`).

It reads what the gpt_oss reasoning parser leaves as the content (the final channel's text, and messages to
functions whole), or a raw harmony output, whose other messages then stay in the content as they are. The
<|call|> that ends a call is gpt-oss's EOS, so a call may end with the output instead.
"""

from __future__ import annotations

from llmserve.server.reasoning import BODY_ENDS, CHANNEL, MESSAGE, START, function_name
from llmserve.server.tool_parsers.base import Item, ToolParser, add_text, loads_or_none, partial_suffix_len

_HEADER_STARTS = (START, CHANNEL)


class HarmonyParser(ToolParser):
    """A message whose body is not the JSON arguments of a known tool stays in the content, markers and all;
    so does a header the output ends in."""

    name = "openai"
    template_markers = ("<|call|>",)
    needs_special_tokens = True

    def scan(self, text: str, final: bool) -> tuple[list[Item], int]:
        items: list[Item] = []
        pos = 0
        while True:
            start = _find_first(text, _HEADER_STARTS, pos)
            if start is None:
                held = 0 if final else max(partial_suffix_len(text[pos:], marker) for marker in _HEADER_STARTS)
                add_text(items, text[pos:len(text) - held])
                return items, len(text) - held
            add_text(items, text[pos:start])
            end = self._message_end(text, start, final)
            if end is None:
                return items, start  # the message goes on in the next delta
            items.append(self._message(text[start:end]))
            pos = end

    def _message_end(self, text: str, start: int, final: bool) -> int | None:
        """End of the message opening at `start` (past its end marker, or the text's end when final)."""
        body = text.find(MESSAGE, start)
        if body >= 0:
            end = _find_first(text, BODY_ENDS, body)
            if end is not None:
                return end + len(next(m for m in BODY_ENDS if text.startswith(m, end)))
        return len(text) if final else None

    def _message(self, message: str) -> Item:
        """One whole message -> its call, or the message as text."""
        at = message.find(MESSAGE)
        if at < 0:
            return message
        name = function_name(message[:at])
        body = message[at + len(MESSAGE):]
        end = _find_first(body, BODY_ENDS, 0)
        call = self.call_from({"name": name, "arguments": loads_or_none(body[:end])}) if name else None
        return call if call is not None else message


def _find_first(text: str, markers: tuple[str, ...], start: int) -> int | None:
    found = [i for marker in markers if (i := text.find(marker, start)) >= 0]
    return min(found) if found else None
