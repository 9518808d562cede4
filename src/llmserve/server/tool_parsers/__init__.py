"""Tool-call parsers, one module per model family, and the registry that picks one (--tool-call-parser,
else the chat template's markers)."""

from __future__ import annotations

from llmserve.server.tool_parsers.harmony import HarmonyParser
from llmserve.server.tool_parsers.base import ParsedCall, ParsedOutput, ToolParser, escape_controls, parse_output
from llmserve.server.tool_parsers.hermes import HermesParser
from llmserve.server.tool_parsers.json_array import JsonArrayParser
from llmserve.server.tool_parsers.llama3_json import Llama3JsonParser
from llmserve.server.tool_parsers.mistral import MistralParser
from llmserve.server.tool_parsers.stream import ToolCallStream, ToolDelta

PARSERS: dict[str, type[ToolParser]] = {cls.name: cls for cls in (HermesParser, Llama3JsonParser, MistralParser,
                                                                   HarmonyParser)}
PARSER_NAMES: tuple[str, ...] = tuple(PARSERS)


def detect_parser(chat_template: str | dict | None) -> str | None:
    """The parser whose markers the chat template mentions (the first in PARSERS' order), or None."""
    if isinstance(chat_template, dict):  # several named templates
        chat_template = "\n".join(str(t) for t in chat_template.values())
    if not chat_template:
        return None
    for name, cls in PARSERS.items():
        if any(marker in chat_template for marker in cls.template_markers):
            return name
    return None


def resolve_parser(configured: str | None, chat_template: str | dict | None) -> type[ToolParser] | None:
    name = configured or detect_parser(chat_template)
    return PARSERS[name] if name is not None else None


__all__ = ["PARSERS", "PARSER_NAMES", "HarmonyParser", "HermesParser", "JsonArrayParser", "Llama3JsonParser",
           "MistralParser",
           "ParsedCall", "ParsedOutput", "ToolCallStream", "ToolDelta", "ToolParser", "detect_parser",
           "escape_controls", "parse_output", "resolve_parser"]
