"""Tool calling on /v1/chat/completions: the request's tools checked, the tools handed to the chat template,
the grammar that enforces tool_choice "required" and named, and the model's text turned into
`message.tool_calls`, whole or as stream deltas.

tool_choice "none": tools are rendered, the text is content. "auto": the model's text is read by the
--tool-call-parser (or the one the chat template's markers select). "required": the output is constrained to
a JSON array of {"name", "parameters"} (one element when parallel_tool_calls is false). Named: the output is
constrained to the function's arguments object. Under the `openai` parser (gpt-oss) both are instead held to
a call in harmony's commentary channel (harmony_tool_choice.py), which that parser reads.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from llmserve.sampling_params import StructuredOutputsParams
from llmserve.server.protocol import ChatCompletionRequest, DeltaMessage, ResponseMessage
from llmserve.server.harmony_tool_choice import harmony_call_constraint
from llmserve.server.protocol_tools import (ChatTool, DeltaFunctionCall, DeltaToolCall, FunctionCall,
                                            NamedToolChoice, ToolCall)
from llmserve.server.structured_fields import FieldError
from llmserve.server.tool_parsers import (PARSER_NAMES, HarmonyParser, JsonArrayParser, ParsedCall, ToolCallStream,
                                          ToolParser, escape_controls, parse_output, resolve_parser)

ANY_OBJECT: dict = {"type": "object"}
_DEFS_KEYS = ("$defs", "definitions")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tool fields ask for, checked."""

    mode: str  # none | auto | required | named
    tools: tuple[ChatTool, ...] = ()
    named: str | None = None  # the function tool_choice names
    is_parallel: bool = True
    parser_cls: type[ToolParser] | None = None  # the --tool-call-parser (or the template's)

    @property
    def template_tools(self) -> list[dict] | None:
        return template_tools(self.tools)

    @property
    def is_harmony_call(self) -> bool:
        """required / named held to a harmony call, thoughts included (not the JSON forms)."""
        return self.mode in ("required", "named") and self.parser_cls is HarmonyParser

    @property
    def is_parsed(self) -> bool:
        """The output is read by a parser (else: all content, or a named call's arguments)."""
        return self.mode in ("auto", "required") or self.is_harmony_call

    @property
    def max_calls(self) -> int | None:
        return None if self.is_parallel else 1

    def apply(self, overrides: dict) -> None:
        """Put the grammar (required, named) and the decoding needs of the parser into SamplingParams'
        overrides; ValueError when another constraint is set already."""
        constraint = self.structured_outputs()
        if constraint is not None:
            if overrides.get("structured_outputs") is not None:
                raise FieldError("tool_choice", f"tool_choice {self._choice_text()} cannot be combined with another "
                                                "output constraint (response_format, structured_outputs)")
            from llmserve.structured.grammar import validate

            validate(constraint)
            overrides["structured_outputs"] = constraint
        is_parser_read = self.mode == "auto" or self.is_harmony_call
        if is_parser_read and self.parser_cls is not None and self.parser_cls.needs_special_tokens:
            overrides["skip_special_tokens"] = False

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if self.is_harmony_call:
            return harmony_call_constraint(self.tools, self.named)
        if self.mode == "named":
            return StructuredOutputsParams.from_json_schema(self._parameters(self.named),
                                                            disable_any_whitespace=True)
        if self.mode == "required":
            return StructuredOutputsParams.from_json_schema(required_schema(self.tools, self.is_parallel),
                                                            disable_any_whitespace=True)
        return None

    def new_parser(self) -> ToolParser:
        names = frozenset(tool.function.name for tool in self.tools)
        if self.mode == "required" and not self.is_harmony_call:
            return JsonArrayParser(names)
        assert self.is_parsed and self.parser_cls is not None
        return self.parser_cls(names)

    def _parameters(self, name: str | None) -> dict:
        tool = next(tool for tool in self.tools if tool.function.name == name)
        return tool.function.parameters if tool.function.parameters is not None else ANY_OBJECT

    def _choice_text(self) -> str:
        return repr(self.mode) if self.mode != "named" else f"naming {self.named!r}"


def template_tools(tools: tuple[ChatTool, ...] | list[ChatTool] | None) -> list[dict] | None:
    """The tools as transformers' chat templates take them (OpenAI's JSON form), checked first."""
    if not tools:
        return None
    _check_tools(tuple(tools))
    return [{"type": "function", "function": _function_dict(tool)} for tool in tools]


def _function_dict(tool: ChatTool) -> dict:
    function = {"name": tool.function.name}
    if tool.function.description is not None:
        function["description"] = tool.function.description
    function["parameters"] = tool.function.parameters if tool.function.parameters is not None else ANY_OBJECT
    return function


# ---- the request's fields -----------------------------------------------------------------------


def plan_tools(req: ChatCompletionRequest, configured_parser: str | None, chat_template) -> ToolPlan:
    """Check tools / tool_choice (functions / function_call: params.py); ValueError (-> 400) naming the field."""
    tools = tuple(req.tools or ())
    _check_tools(tools)
    choice = req.tool_choice
    is_parallel = req.parallel_tool_calls is not False
    if not tools:
        if choice is not None and choice != "none":
            raise FieldError("tool_choice", "tool_choice is only allowed when tools are given")
        return ToolPlan("none")
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if named is not None and named not in {tool.function.name for tool in tools}:
        raise FieldError("tool_choice", f"tool_choice names the function {named!r}, which is not among tools")
    mode = "named" if named is not None else choice or "auto"
    parser_cls = resolve_parser(configured_parser, chat_template)
    if mode == "auto" and parser_cls is None:
        raise FieldError("tool_choice", "tool_choice 'auto' needs a tool-call parser and none matches this model's "
                                        "chat template: start the server with --tool-call-parser "
                                        f"({', '.join(PARSER_NAMES)}), or send tool_choice 'required' or a named "
                                        "function")
    return ToolPlan(mode, tools, named, is_parallel, parser_cls)


def _check_tools(tools: tuple[ChatTool, ...]) -> None:
    names: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise FieldError(f"tools[{i}].type", f"tools[{i}].type must be 'function', got {tool.type!r}")
        name = tool.function.name
        if name in names:
            raise FieldError(f"tools[{i}].function.name",
                             f"tools[{i}].function.name {name!r} is given twice: tool names must be unique")
        names.add(name)
        parameters = tool.function.parameters
        if parameters is not None and parameters.get("type", "object") != "object":
            raise FieldError(f"tools[{i}].function.parameters", f"tools[{i}].function.parameters must be a JSON schema "
                             f"of an object (type 'object'), got type {parameters.get('type')!r}")


def required_schema(tools: tuple[ChatTool, ...], is_parallel: bool) -> dict:
    """vLLM's form: an array of {"name": <a tool's name>, "parameters": <its arguments>}, one element or more
    (exactly one when not parallel); each tool's $defs are lifted to the root, where its $refs point."""
    defs: dict = {}
    variants = []
    for tool in tools:
        parameters = dict(tool.function.parameters) if tool.function.parameters is not None else dict(ANY_OBJECT)
        for key in _DEFS_KEYS:
            definitions = parameters.pop(key, {})
            if not isinstance(definitions, dict):
                raise FieldError("tools", f"tools: {tool.function.name}'s parameters.{key} must be an object")
            for name, schema in definitions.items():
                if defs.setdefault(key, {}).setdefault(name, schema) != schema:
                    raise FieldError("tools", f"tools: two functions define {key} {name!r} differently; with "
                                              "tool_choice 'required' their definitions share one namespace")
        variants.append({"type": "object", "properties": {"name": {"const": tool.function.name},
                                                          "parameters": parameters},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "items": {"anyOf": variants}, "minItems": 1, **defs}
    if not is_parallel:
        schema["maxItems"] = 1
    return schema


# ---- the model's text -> message.tool_calls -------------------------------------------------------


def _tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall(new_call_id(), FunctionCall(call.name, call.arguments))


def tool_finish_reason(finish_reason: str | None, plan: ToolPlan, made_calls: bool) -> str | None:
    """OpenAI's: "tool_calls" when calls end the output, but "stop" when tool_choice named the function."""
    if finish_reason == "stop" and made_calls and plan.mode != "named":
        return "tool_calls"
    return finish_reason


def response_message(plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[ResponseMessage, str | None]:
    """The assistant message of a whole output and its finish reason."""
    if plan.mode == "none":
        return ResponseMessage("assistant", text), finish_reason
    if not plan.is_parsed:  # named: the output is the arguments
        call = ToolCall(new_call_id(), FunctionCall(plan.named or "", escape_controls(text)))
        return ResponseMessage("assistant", None, [call]), finish_reason
    parsed = parse_output(plan.new_parser(), text, plan.max_calls)
    if not parsed.calls:
        return ResponseMessage("assistant", parsed.content), finish_reason
    message = ResponseMessage("assistant", parsed.content, [_tool_call(call) for call in parsed.calls])
    return message, tool_finish_reason(finish_reason, plan, True)


class ChoiceStream:
    """One choice's text deltas -> OpenAI deltas: content, and per call a first delta (index, id, type,
    name, arguments "") then its arguments. Named calls stream their arguments as they come; parsed calls
    (auto, required, and gpt-oss's named) come whole once the parser has read their end."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.stream = ToolCallStream(plan.new_parser(), plan.max_calls) if plan.is_parsed else None
        self.num_calls = 0

    def feed(self, text: str, final: bool) -> list[DeltaMessage]:
        if self.plan.mode == "none":
            return [DeltaMessage(content=text)] if text else []
        if self.stream is None:
            return self._named(text)
        messages = []
        for delta in self.stream.feed(text, final):
            if delta.call is None:
                messages.append(DeltaMessage(content=delta.content))
            else:
                messages.extend(self._call(delta.index, delta.call.name, delta.call.arguments))
        return messages

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return tool_finish_reason(finish_reason, self.plan, self.num_calls > 0)

    def _named(self, text: str) -> list[DeltaMessage]:
        text = escape_controls(text)
        if self.num_calls == 0:
            return self._call(0, self.plan.named or "", text)
        return [_arguments_delta(0, text)] if text else []

    def _call(self, index: int, name: str, arguments: str) -> list[DeltaMessage]:
        self.num_calls += 1
        first = DeltaToolCall(index, new_call_id(), "function", DeltaFunctionCall(name, ""))
        return [DeltaMessage(tool_calls=[first])] + ([_arguments_delta(index, arguments)] if arguments else [])


def _arguments_delta(index: int, arguments: str) -> DeltaMessage:
    return DeltaMessage(tool_calls=[DeltaToolCall(index, function=DeltaFunctionCall(arguments=arguments))])
