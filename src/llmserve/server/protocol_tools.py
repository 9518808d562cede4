"""OpenAI tool-calling records: the request's `tools` and `tool_choice`, tool calls in chat messages, and the
`tool_calls` of responses and stream deltas (see protocol.py for the rest of the wire format)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

ToolName = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.\-]+$")]


class FunctionDefinition(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: str  # only "function" (checked in tool_calls.py, with a message naming the type)
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


# ---- tool calls in chat messages (requests) and in responses --------------------------------------


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text of the arguments object


class ToolCall(msgspec.Struct):
    """A call as OpenAI returns it; also what clients send back in an assistant message's `tool_calls`."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """One stream delta of a call: the first carries id, type and name (arguments ""), later ones
    fragments of the arguments text."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None
