"""POST /v1/responses (OpenAI's Responses API) and GET /v1/responses/{id}, served through the chat pipeline.

A request becomes the chat request it means (responses_input.py); its output becomes a message item and a
function_call item per call, whole or as typed stream events (responses_stream.py). With `store` (the
default, as OpenAI's) the response and its conversation are kept in memory, the newest
MAX_STORED_RESPONSES of them, so that `previous_response_id` continues a conversation and GET returns it;
they are lost when the server stops, and with several replicas behind a router only the replica that
answered holds them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

import msgspec
from fastapi import Request
from fastapi.responses import Response

from llmserve.engine.async_llm import TokensPrompt
from llmserve.http.errors import APIError
from llmserve.server.protocol import ChatMessage, ResponseMessage, decode_json, encode_json
from llmserve.server.protocol_responses import (FunctionCallItem, IncompleteDetails, InputTokensDetails,
                                                OutputItem, OutputMessage, OutputText, OutputTokensDetails,
                                                ReasoningItem, ReasoningText, ResponseObject, ResponsesRequest,
                                                ResponseUsage)
from llmserve.server.protocol_tools import FunctionCall, ToolCall
from llmserve.server.responses_input import chat_request, check_unsupported, conversation_messages
from llmserve.server.responses_stream import EventCounter, OutputEvents, new_item_id
from llmserve.server.serving_chat import answer_message, prepare_chat
from llmserve.server.serving_common import ServingContext, collect_final, created_now, new_request_id
from llmserve.server.streams import sse_response, until_disconnect, with_error_event
from llmserve.server.structured_fields import FieldError
from llmserve.server.tool_calls import ToolPlan

MAX_STORED_RESPONSES = 1000
# chat's field -> the Responses field it came from
_RESPONSES_FIELDS = {"reasoning_effort": "reasoning.effort", "messages": "input", "max_tokens": "max_output_tokens"}


@dataclass
class StoredResponse:
    conversation: list[ChatMessage]  # every turn up to and including this response's output (no instructions)
    response: ResponseObject


class ResponseStore:
    """The newest `capacity` stored responses by id (the oldest goes first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self.entries[response_id] = entry
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def get(self, response_id: str, param: str) -> StoredResponse:
        entry = self.entries.get(response_id)
        if entry is None:
            raise APIError(404, f"no stored response with id {response_id!r} (responses are kept in memory, the "
                                f"newest {self.capacity}, with store true)", param=param, code="response_not_found")
        return entry


class ResponsesServer:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.store = ResponseStore(MAX_STORED_RESPONSES)

    def retrieve(self, response_id: str) -> ResponseObject:
        return self.store.get(response_id, "response_id").response

    async def create(self, request: Request, body: bytes) -> Response:
        ctx = self.ctx
        req: ResponsesRequest = decode_json(body, ResponsesRequest)
        check_unsupported(req)
        history = [] if req.previous_response_id is None else \
            self.store.get(req.previous_response_id, "previous_response_id").conversation
        conversation = history + conversation_messages(req)
        instructions = [] if req.instructions is None else [ChatMessage("system", req.instructions)]
        try:
            plan, params, prompt = prepare_chat(ctx, chat_request(req, instructions + conversation))
        except ValueError as e:
            raise _as_responses_field(e) from None
        ctx.admit(request.scope, 1)
        draft = self._draft(req, new_request_id("resp"))
        gen = ctx.engine.generate(prompt, params, draft.id, 0, lora=ctx.lora_for(req.model))
        if req.stream:
            events = self._stream(plan, draft, conversation, prompt, gen)
            return sse_response(with_error_event(events, draft.id, done=None), draft.id, ctx.is_shutting_down)
        final = await until_disconnect(request, collect_final(gen), draft.id)
        out = final.outputs[0]
        message, _ = answer_message(plan, ctx.config.reasoning_parser, out.text, out.finish_reason)
        response = _finished(draft, _output_items(message), out.finish_reason,
                             _usage(len(prompt.token_ids), len(out.token_ids), final.num_cached_tokens))
        self._remember(conversation, response)
        return Response(encode_json(response), media_type="application/json")

    def _draft(self, req: ResponsesRequest, response_id: str) -> ResponseObject:
        """The response before any output (status in_progress), with the request's settings."""
        text_format = {"type": "text"} if req.text is None or req.text.format is None else \
            msgspec.to_builtins(req.text.format)
        return ResponseObject(
            id=response_id, created_at=created_now(), model=self.ctx.model_name, status="in_progress",
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            previous_response_id=req.previous_response_id, tools=req.tools or [],
            tool_choice=req.tool_choice or ("auto" if req.tools else "none"),
            parallel_tool_calls=req.parallel_tool_calls is not False, temperature=req.temperature, top_p=req.top_p,
            text={"format": text_format}, metadata=req.metadata or {}, store=req.store is not False)

    async def _stream(self, plan: ToolPlan, draft: ResponseObject,
                      conversation: list[ChatMessage], prompt: TokensPrompt, gen) -> AsyncIterator[bytes]:
        counter = EventCounter()
        yield counter.event("created", response=draft)
        yield counter.event("in_progress", response=draft)
        output = OutputEvents(plan, counter, self.ctx.config.reasoning_parser)
        num_output, num_cached, finish_reason = 0, 0, None
        async with aclosing(gen):
            async for delta in gen:
                out = delta.outputs[0]
                num_output, num_cached = num_output + len(out.token_ids), delta.num_cached_tokens
                finish_reason = out.finish_reason
                for event in output.feed(out.text, finish_reason is not None):
                    yield event
        response = _finished(draft, output.items, finish_reason, _usage(len(prompt.token_ids), num_output,
                                                                          num_cached))
        self._remember(conversation, response)
        yield counter.event("completed" if response.status == "completed" else "incomplete", response=response)

    def _remember(self, conversation: list[ChatMessage], response: ResponseObject) -> None:
        if response.store:
            turn = _assistant_turn(response.output)
            self.store.put(response.id, StoredResponse(conversation + [turn], response))


def _as_responses_field(error: ValueError) -> ValueError:
    """A chat field's error named by the Responses field that set it."""
    param = _RESPONSES_FIELDS.get(getattr(error, "param", None) or "")
    return error if param is None else FieldError(param, str(error).replace(error.param, param, 1))


def _output_items(message: ResponseMessage) -> list[OutputItem]:
    """A chat answer as Responses items: its thoughts (with a reasoning parser), its text (when any, or when
    there is nothing else), then its calls."""
    calls = message.tool_calls or []
    items: list[OutputItem] = []
    if isinstance(message.reasoning_content, str):
        items.append(ReasoningItem(new_item_id("rs"), [ReasoningText(message.reasoning_content)]))
    if message.content or not calls:
        items.append(OutputMessage(new_item_id("msg"), [OutputText(message.content or "")]))
    items += [FunctionCallItem(new_item_id("fc"), call.id, call.function.name, call.function.arguments)
              for call in calls]
    return items


def _assistant_turn(items: list[OutputItem]) -> ChatMessage:
    """The output items as the assistant turn a later request's conversation holds (thoughts are not kept:
    templates drop earlier turns' thinking)."""
    text = "".join(part.text for item in items if isinstance(item, OutputMessage) for part in item.content)
    calls = [ToolCall(item.call_id, FunctionCall(item.name, item.arguments)) for item in items
             if isinstance(item, FunctionCallItem)]
    return ChatMessage("assistant", text or None, tool_calls=calls or None)


def _usage(num_input: int, num_output: int, num_cached: int) -> ResponseUsage:
    return ResponseUsage(num_input, num_output, num_input + num_output, InputTokensDetails(num_cached),
                         OutputTokensDetails(0))


def _finished(draft: ResponseObject, items: list[OutputItem], finish_reason: str | None,
              usage: ResponseUsage) -> ResponseObject:
    """The response once its output is whole: incomplete when max_output_tokens cut it."""
    is_cut = finish_reason == "length"
    return msgspec.structs.replace(draft, status="incomplete" if is_cut else "completed", output=items, usage=usage,
                                   incomplete_details=IncompleteDetails("max_output_tokens") if is_cut else None)
