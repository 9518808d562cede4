"""OpenAI's Responses API records (POST /v1/responses): the request, the response object and its output
items, and the typed stream events.

What is built (vLLM's `structured_outputs` and `logit_bias` too): text and message input (with function calls
and their outputs), `instructions`, function tools and `tool_choice`, `text.format` (json_schema /
json_object), `max_output_tokens`, sampling fields, `reasoning.effort` (the chat template's reasoning_effort),
streaming, and `store` / `previous_response_id` over a bounded in-memory store. The fields of what is not
built (reasoning summaries, built-in tools, background runs, `include`, reusable prompts, conversations) are
declared so that a request using them is refused (400) naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from llmserve.server.protocol import (NULL, NULL_OR_EMPTY, NULL_OR_FALSE, IgnoredFields, LogitBias, PositiveInt,
                                      ReasoningEffort, Temperature, TopP, refused_unless)
from llmserve.server.protocol_tools import ToolName
from llmserve.server.structured_fields import StructuredOutputsRequest


class FunctionTool(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A function tool in the Responses form (flat: no nested `function` record as in chat)."""

    type: str  # only "function" (built-in tools such as web_search are refused, naming the type)
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function"]
    name: str


class TextFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`text.format`: text, json_object, or json_schema with its schema inline (flat, unlike chat's)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ReasoningOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`reasoning`: its effort goes to the chat template as chat's reasoning_effort does."""

    effort: ReasoningEffort | None = None
    summary: refused_unless(NULL) = None
    generate_summary: refused_unless(NULL) = None


class TextOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    format: TextFormat | None = None
    verbosity: refused_unless({"enum": [None, "medium"]}) = None


class ResponsesRequest(IgnoredFields, forbid_unknown_fields=True, kw_only=True):
    """`input`: a string (one user message) or a list of items: messages ({"role", "content"}, with or
    without "type": "message"), function_call and function_call_output items; reasoning items sent back
    are dropped from the prompt, as chat templates drop earlier turns' thinking."""

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: int | None = None
    logit_bias: dict[str, LogitBias] | None = None  # vLLM's, as on chat
    reasoning: ReasoningOptions | None = None
    stream: bool = False
    previous_response_id: str | None = None
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM's, as on chat (or text.format)
    # Declared to be refused while not built.
    include: refused_unless(NULL_OR_EMPTY) = None
    background: refused_unless(NULL_OR_FALSE) = None
    truncation: refused_unless({"enum": [None, "disabled"]}) = None
    max_tool_calls: refused_unless(NULL) = None
    top_logprobs: refused_unless({"enum": [None, 0]}) = None
    prompt: refused_unless(NULL) = None
    conversation: refused_unless(NULL) = None
    stream_options: refused_unless(NULL) = None


# ---- the response object --------------------------------------------------------------------------


class OutputText(msgspec.Struct):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []
    type: str = "output_text"


class OutputMessage(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    content: list[OutputText]
    status: str = "completed"
    role: str = "assistant"


class FunctionCallItem(msgspec.Struct, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class ReasoningText(msgspec.Struct):
    text: str
    type: str = "reasoning_text"


class ReasoningItem(msgspec.Struct, tag_field="type", tag="reasoning"):
    """The model's thoughts (--reasoning-parser), before its answer."""

    id: str
    content: list[ReasoningText]
    summary: list[Any] = []
    status: str = "completed"


OutputItem = ReasoningItem | OutputMessage | FunctionCallItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails


class IncompleteDetails(msgspec.Struct):
    reason: str  # max_output_tokens


class ResponseObject(msgspec.Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: str  # in_progress | completed | incomplete
    output: list[OutputItem] = []
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] = []
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, str] = {}
    store: bool = True
    object: str = "response"


class StreamEvent(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One typed stream event (`type`: response.created, response.output_item.added, ...); the fields
    each type carries are OpenAI's, absent ones omitted."""

    type: str
    sequence_number: int
    response: ResponseObject | None = None
    output_index: int | None = None
    item: OutputItem | None = None
    item_id: str | None = None
    content_index: int | None = None
    part: OutputText | None = None
    delta: str | None = None
    text: str | None = None
    arguments: str | None = None
    name: str | None = None
    logprobs: list[Any] | None = None
