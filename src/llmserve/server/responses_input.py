"""A Responses API request as the chat request it means: `instructions` and `input` items -> chat messages,
function tools, `tool_choice` and `text.format` -> chat's fields. The chat pipeline (template, tools,
structured outputs, sampling) then serves it; every bad item is a ValueError naming its place (-> 400)."""

from __future__ import annotations

from typing import Any

from llmserve.server.protocol import ChatCompletionRequest, ChatMessage
from llmserve.server.protocol_responses import ResponsesRequest, TextFormat
from llmserve.server.protocol_tools import ChatTool, FunctionCall, FunctionDefinition, NamedFunction, \
    NamedToolChoice, ToolCall
from llmserve.server.structured_fields import FieldError, JsonObjectFormat, JsonSchemaFormat, JsonSchemaSpec

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
ACCEPTED_VALUES = {"include": (None, []), "background": (None, False),
                   "truncation": (None, "disabled"), "max_tool_calls": (None,), "top_logprobs": (None, 0),
                   "prompt": (None,), "conversation": (None,), "stream_options": (None,)}


def _error(message: str, param: str) -> FieldError:
    """A 400 whose `param` names the field at fault."""
    return FieldError(param, message)


def check_unsupported(req: ResponsesRequest) -> None:
    """The declared fields of what is not built: 400 naming the field unless it has a neutral value."""
    for name, accepted in ACCEPTED_VALUES.items():
        value = getattr(req, name)
        if value not in accepted:
            raise _error(f"{name} is not supported by this server (got {value!r})", name)
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise _error("text.verbosity other than medium is not supported", "text.verbosity")
    for name in ("summary", "generate_summary"):
        if req.reasoning is not None and getattr(req.reasoning, name) is not None:
            raise _error(f"reasoning.{name} is not supported by this server (reasoning comes back whole, as "
                         "reasoning items)", f"reasoning.{name}")


def conversation_messages(req: ResponsesRequest) -> list[ChatMessage]:
    """The turns this request's input adds to the conversation (its `instructions` are not among them: they
    apply to this request alone, as OpenAI's do)."""
    if isinstance(req.input, str):
        return [ChatMessage("user", req.input)]
    messages: list[ChatMessage] = []
    for index, item in enumerate(req.input):
        _add_item(messages, item, f"input[{index}]")
    return messages


def _add_item(messages: list[ChatMessage], item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise _error(f"{where} must be an object (a message or an item)", where)
    kind = item.get("type", "message")
    if kind == "message":
        messages.append(_message(item, where))
    elif kind == "function_call":
        call = ToolCall(_text(item, "call_id", where), FunctionCall(_text(item, "name", where),
                                                                     _text(item, "arguments", where)))
        last = messages[-1] if messages else None
        if last is not None and last.role == "assistant" and last.tool_calls and not last.content:
            last.tool_calls.append(call)  # parallel calls: one assistant turn
        else:
            messages.append(ChatMessage("assistant", None, tool_calls=[call]))
    elif kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            raise _error(f"{where}.output must be a string", f"{where}.output")
        messages.append(ChatMessage("tool", output, tool_call_id=_text(item, "call_id", where)))
    elif kind != "reasoning":  # earlier turns' thinking: not part of the prompt
        raise _error(f"{where}.type {kind!r} is not supported (message, function_call, function_call_output, "
                         "reasoning)", f"{where}.type")


def _message(item: dict, where: str) -> ChatMessage:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise _error(f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}", f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return ChatMessage(role, content)
    if not isinstance(content, list):
        raise _error(f"{where}.content must be a string or a list of text parts", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _error(f"{where}.content[{j}]: only text parts ({', '.join(TEXT_PARTS)}) are supported, "
                             f"got {kind!r}", f"{where}.content[{j}].type")
        texts.append(part["text"])
    return ChatMessage(role, "".join(texts))


def _text(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _error(f"{where}.{key} must be a string", f"{where}.{key}")
    return value


def chat_request(req: ResponsesRequest, messages: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat request that serves `req` over the whole conversation (`messages`)."""
    tools = None if req.tools is None else [_chat_tool(tool, i) for i, tool in enumerate(req.tools)]
    choice = req.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = NamedToolChoice(function=NamedFunction(choice.name))
    return ChatCompletionRequest(
        messages=messages, model=req.model, tools=tools, tool_choice=choice,
        parallel_tool_calls=req.parallel_tool_calls, max_tokens=req.max_output_tokens, temperature=req.temperature,
        top_p=req.top_p, seed=req.seed, response_format=_response_format(req.text.format if req.text else None),
        structured_outputs=req.structured_outputs, logit_bias=req.logit_bias,
        reasoning_effort=None if req.reasoning is None else req.reasoning.effort)


def _chat_tool(tool, index: int) -> ChatTool:
    if tool.type != "function":
        raise _error(f"tools[{index}].type {tool.type!r} is not supported: only function tools",
                         f"tools[{index}].type")
    return ChatTool(type="function", function=FunctionDefinition(name=tool.name, description=tool.description,
                                                                 parameters=tool.parameters, strict=tool.strict))


def _response_format(text_format: TextFormat | None):
    if text_format is None or text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return JsonObjectFormat()
    if text_format.schema is None:
        raise _error("text.format.schema is required with type json_schema", "text.format.schema")
    spec = JsonSchemaSpec(name=text_format.name or "response", schema=text_format.schema,
                          description=text_format.description, strict=text_format.strict)
    return JsonSchemaFormat(json_schema=spec)
