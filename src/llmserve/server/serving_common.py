"""What every generation route shares: the model-name check, admission (backpressure), request ids,
chat templating, token strings for logprobs, and folding a request's delta outputs."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass


from llmserve.engine.async_llm import AsyncLLM, merge_outputs
from llmserve.http.errors import APIError, service_unavailable
from llmserve.lora_request import LoRARequest
from llmserve.outputs import RequestOutput
from llmserve.server.config import ServerConfig
from llmserve.server.lora_registry import LoRARegistry
from llmserve.server.metrics import ServerMetrics
from llmserve.server.protocol import ChatMessage
from llmserve.server.protocol_tools import ToolCall
from llmserve.server.structured_fields import FieldError

ADMITTED_KEY = "llmserve.num_admitted"  # in the ASGI scope: sequences this request counts against the limit


@dataclass
class ServingContext:
    """Per-app state the routes use (held on app.state.ctx)."""

    engine: AsyncLLM
    config: ServerConfig
    metrics: ServerMetrics
    model_name: str
    max_num_seqs: int
    token_text: TokenTexts
    loras: LoRARegistry | None = None  # the adapters served by name (None: none)
    is_draining: bool = False
    num_http_in_flight: int = 0  # generation/tokenizer requests being answered (not /health, /metrics)
    num_admitted: int = 0  # engine sequences of the generation requests being answered

    def is_shutting_down(self) -> bool:
        """Draining after a signal, or going down with the engine."""
        return self.is_draining or self.engine.is_dead

    @property
    def num_max_in_flight(self) -> int:
        return self.max_num_seqs + self.config.max_queued_requests

    def check_model(self, model: str | None) -> None:
        self.lora_for(model)

    def served_name(self, model: str | None) -> str:
        """The `model` a response reports: the adapter's name when the request named one, else the model's."""
        lora = None if self.loras is None else self.loras.get(model)
        return self.model_name if lora is None else lora.lora_name

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for a name nothing here has."""
        if model is None or model in (self.model_name, self.engine.model_info.name):
            return None
        lora = None if self.loras is None else self.loras.get(model)
        if lora is None:
            raise APIError(404, f"The model `{model}` does not exist (this server serves `{self.model_name}`).",
                           param="model", code="model_not_found")
        return lora

    def admit(self, scope: dict, num_engine_requests: int) -> None:
        """Count the request's sequences in, in its `scope` (an HTTP request's: FrontDoor counts them out when
        its response ends; a gRPC call's: the call does).

        503 + Retry-After when max_num_seqs + max_queued_requests sequences are in flight already;
        400 when the request alone can never fit.
        """
        if self.is_draining:
            raise service_unavailable("the server is shutting down", retry_after=5)
        self.engine.check_health()
        if num_engine_requests > self.num_max_in_flight:
            raise ValueError(f"this request needs {num_engine_requests} sequences (prompts x n); "
                             f"the server takes at most {self.num_max_in_flight} at once")
        if self.num_admitted + num_engine_requests > self.num_max_in_flight:
            raise service_unavailable(f"too many requests queued ({self.num_admitted} sequences in flight, "
                                      f"limit {self.num_max_in_flight}); retry later", retry_after=1)
        assert ADMITTED_KEY not in scope, "a request admitted twice"
        scope[ADMITTED_KEY] = num_engine_requests
        self.num_admitted += num_engine_requests

    def release(self, scope: dict) -> None:
        self.num_admitted -= scope.pop(ADMITTED_KEY, 0)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def created_now() -> int:
    return int(time.time())


# ---- chat ---------------------------------------------------------------------------------------


def _message_text(index: int, message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise FieldError(f"messages[{index}].content",
                             f"messages[{index}].content: only text parts are supported, got type {part.type!r}")
        texts.append(part.text)
    return "".join(texts)


def chat_conversation(messages: list[ChatMessage] | None) -> list[dict]:
    if not messages:
        raise FieldError("messages", "messages must be a non-empty list")
    return [_chat_entry(i, message) for i, message in enumerate(messages)]


def _chat_entry(index: int, message: ChatMessage) -> dict:
    role = "system" if message.role == "developer" else message.role
    entry: dict = {"role": role, "content": _message_text(index, message)}
    if message.name is not None:
        entry["name"] = message.name
    if message.tool_calls is not None and role != "assistant":
        raise FieldError(f"messages[{index}].tool_calls",
                         f"messages[{index}]: only assistant messages carry tool_calls, not {role} ones")
    if message.tool_calls:
        entry["tool_calls"] = [_template_tool_call(call) for call in message.tool_calls]
    if (message.tool_call_id is not None) != (role == "tool"):
        raise FieldError(f"messages[{index}].tool_call_id", f"messages[{index}]: tool messages need tool_call_id "
                         "(the id of the call they answer), and only they carry one")
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    return entry


def _template_tool_call(call: ToolCall) -> dict:
    """A call as transformers' chat templates expect it: arguments as a dict, not OpenAI's JSON text. A call
    cut off by max_tokens comes back in later turns (LangChain sends it as it got it), so any text is taken:
    empty is {}, anything but a JSON object reaches the template as the text it is (vLLM accepts them too)."""
    text = call.function.arguments
    try:
        arguments = json.loads(text) if text.strip() else {}
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        arguments = text
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


TEMPLATE_ARGUMENTS = ("conversation", "messages", "tools", "documents", "add_generation_prompt", "tokenize",
                      "chat_template", "continue_final_message", "return_dict")


def template_kwargs(tokenizer, reasoning_effort: str | None, chat_template_kwargs: dict | None) -> dict:
    """What a chat request passes to the template beside its messages; a key the template never reads is
    refused (400 naming it) rather than ignored."""
    kwargs = dict(chat_template_kwargs or {})
    if reasoning_effort is not None:
        kwargs["reasoning_effort"] = reasoning_effort
    template = tokenizer.chat_template if isinstance(getattr(tokenizer, "chat_template", None), str) else ""
    for key in kwargs:
        param = "reasoning_effort" if key == "reasoning_effort" and reasoning_effort is not None \
            else f"chat_template_kwargs.{key}"
        if key in TEMPLATE_ARGUMENTS:
            raise FieldError(param, f"{param}: {key!r} is set by the server, not by chat_template_kwargs")
        if key not in template:
            raise FieldError(param, f"{param}: this model's chat template does not read {key!r}")
    return kwargs


def render_chat(tokenizer, messages: list[ChatMessage] | None, add_generation_prompt: bool,
                tools: list[dict] | None = None, kwargs: dict | None = None) -> str:
    """The chat template applied (text; tokenize it without adding special tokens). `tools` in OpenAI's
    form ({"type": "function", "function": {...}}), as transformers' templates take them; `kwargs` from
    `template_kwargs`."""
    conversation = chat_conversation(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use /v1/completions")
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=add_generation_prompt,
                                             tokenize=False, **(kwargs or {}))
    except TemplateError as e:
        raise FieldError("messages", f"the chat template rejected the messages: {e}") from None
    if not isinstance(text, str):
        raise ValueError("the chat template did not render to text")
    return text


# ---- outputs ------------------------------------------------------------------------------------


class TokenTexts:
    """Token id -> its text (cached; logprobs ask for the same ids again and again)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if len(self.cache) < 1_000_000:
                self.cache[token_id] = text
        return text


TokenLabels = Callable[[int], str]  # token id -> how logprobs name it


def token_id_label(token_id: int) -> str:
    """vLLM's return_tokens_as_token_ids: a token named by its id, for ids whose text alone is not valid UTF-8."""
    return f"token_id:{token_id}"


def logprob_labels(ctx: ServingContext, as_token_ids: bool) -> TokenLabels:
    """How logprobs name a token: its text, or "token_id:<id>" (return_tokens_as_token_ids)."""
    return token_id_label if as_token_ids else ctx.token_text


def fold(outputs: RequestOutput | None, new: RequestOutput) -> RequestOutput:
    return new if outputs is None else merge_outputs(outputs, new)


async def collect_final(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    """All deltas of one request folded into its final output."""
    final = None
    async with aclosing(gen):
        async for output in gen:
            final = fold(final, output)
    assert final is not None and final.finished, "a request ended without a final output"
    return final
