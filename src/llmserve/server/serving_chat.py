"""POST /v1/chat/completions: messages through the model's chat template; streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import Response

from llmserve.engine.async_llm import TokensPrompt
from llmserve.outputs import CompletionOutput, RequestOutput, TokenLogprob
from llmserve.sampling_params import SamplingParams
from llmserve.server.params import build_params, chat_overrides
from llmserve.server.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                      ChatCompletionResponse, ChatLogprobs, ChatStreamChoice, ChatTokenLogprob,
                                      DeltaMessage, ResponseMessage, TopLogprob, decode_json, encode_json,
                                      make_usage)
from llmserve.server.reasoning import ThoughtStream, needs_special_tokens, reasoning_stream, split_reasoning
from llmserve.server.reasoning_grammar import grammar_after_thinking
from llmserve.server.serving_common import (ServingContext, TokenLabels, collect_final, created_now,
                                            logprob_labels, new_request_id, render_chat, template_kwargs)
from llmserve.server.streams import sse_event, sse_response, until_disconnect, with_error_event
from llmserve.server.tool_calls import ChoiceStream, ToolPlan, plan_tools, response_message


def chat_logprobs(token_text: TokenLabels, logprobs: list[TokenLogprob], num_top: int) -> ChatLogprobs:
    content = []
    for lp in logprobs:
        text = token_text(lp.token_id)
        top = [TopLogprob(t, value, list(t.encode()))
               for t, value in ((token_text(tid), value) for tid, value in lp.top[:num_top])]
        content.append(ChatTokenLogprob(text, lp.logprob, list(text.encode()), top))
    return ChatLogprobs(content)


def answer_message(plan: ToolPlan, reasoning_parser: str | None, text: str,
                   finish_reason: str | None) -> tuple[ResponseMessage, str | None]:
    """A whole output as the assistant message (its thoughts in reasoning_content with a reasoning parser, tool
    calls read from the answer) and its finish reason."""
    split = None if reasoning_parser is None else split_reasoning(reasoning_parser, text)
    message, finish_reason = response_message(plan, text if split is None else split.content, finish_reason)
    if split is not None:
        message.reasoning_content = split.reasoning
    return message, finish_reason


def prepare_chat(ctx: ServingContext, req: ChatCompletionRequest) -> tuple[ToolPlan, SamplingParams, TokensPrompt]:
    """A chat request checked and turned into its tool plan, sampling params and rendered prompt (also what the
    Responses API serves its requests through)."""
    ctx.check_model(req.model)
    tokenizer = ctx.engine.tokenizer
    plan = plan_tools(req, ctx.config.tool_call_parser, getattr(tokenizer, "chat_template", None))
    overrides = chat_overrides(req)
    plan.apply(overrides)
    if needs_special_tokens(ctx.config.reasoning_parser):  # its markers are special tokens
        overrides["skip_special_tokens"] = False
    params = build_params(ctx.engine.default_sampling_params, overrides)
    kwargs = template_kwargs(tokenizer, req.reasoning_effort, req.chat_template_kwargs)
    text = render_chat(tokenizer, req.messages, req.add_generation_prompt, plan.template_tools, kwargs)
    if not ctx.config.is_grammar_in_reasoning and not plan.is_harmony_call:  # that grammar holds the thoughts
        grammar_after_thinking(params, ctx.config.reasoning_parser, tokenizer, text)
    prompt = TokensPrompt(ctx.engine.encode(text, add_special_tokens=False), text)
    ctx.engine.check_request(len(prompt.token_ids), params)
    return plan, params, prompt


class ChatServer:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, request: Request, body: bytes) -> Response:
        ctx = self.ctx
        req: ChatCompletionRequest = decode_json(body, ChatCompletionRequest)
        plan, params, prompt = prepare_chat(ctx, req)
        ctx.admit(request.scope, params.n)
        request_id = new_request_id("chatcmpl")
        gen = ctx.engine.generate(prompt, params, request_id, req.priority, lora=ctx.lora_for(req.model))
        if req.stream:
            return sse_response(with_error_event(self._stream(req, plan, params, request_id, prompt, gen),
                                                 request_id), request_id, ctx.is_shutting_down)
        final = await until_disconnect(request, collect_final(gen), request_id)
        return Response(encode_json(self._response(req, plan, params, request_id, prompt, final)),
                        media_type="application/json")

    def _logprobs(self, req: ChatCompletionRequest, params: SamplingParams,
                  out: CompletionOutput) -> ChatLogprobs | None:
        if params.logprobs is None or out.logprobs is None:
            return None
        return chat_logprobs(logprob_labels(self.ctx, req.return_tokens_as_token_ids), out.logprobs, params.logprobs)

    def _response(self, req: ChatCompletionRequest, plan: ToolPlan, params: SamplingParams, request_id: str,
                  prompt: TokensPrompt, final: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for out in final.outputs:
            message, finish_reason = answer_message(plan, self.ctx.config.reasoning_parser, out.text,
                                                    out.finish_reason)
            token_ids = list(out.token_ids) if req.return_token_ids else None
            choices.append(ChatChoice(out.index, message, self._logprobs(req, params, out), finish_reason,
                                      out.stop_reason, token_ids))
        usage = make_usage(len(prompt.token_ids), sum(len(out.token_ids) for out in final.outputs),
                           final.num_cached_tokens)
        prompt_token_ids = list(prompt.token_ids) if req.return_token_ids else None
        return ChatCompletionResponse(request_id, created_now(), self.ctx.served_name(req.model), choices, usage,
                                      prompt_token_ids=prompt_token_ids)

    def _stream_choices(self, req: ChatCompletionRequest, stream: ChoiceStream, thoughts: ThoughtStream | None,
                        params: SamplingParams, out: CompletionOutput) -> list[ChatStreamChoice]:
        """One delta output of a choice as stream choices: logprobs and token ids on the first, the finish on
        the last; with a reasoning parser, the thoughts' delta before the answer's."""
        is_final = out.finish_reason is not None
        text, messages = out.text, []
        if thoughts is not None:
            reasoning, text = thoughts.feed(out.text, is_final)
            messages = [DeltaMessage(reasoning_content=reasoning)] if reasoning else []
        messages += stream.feed(text, is_final)
        logprobs = self._logprobs(req, params, out)
        token_ids = list(out.token_ids) if req.return_token_ids and out.token_ids else None
        finish_reason = stream.finish_reason(out.finish_reason) if is_final else None
        if not messages:
            if not is_final and logprobs is None and token_ids is None:
                return []
            messages = [DeltaMessage()]
        last = len(messages) - 1
        return [ChatStreamChoice(out.index, message, logprobs if i == 0 else None,
                                 finish_reason if i == last else None, token_ids if i == 0 else None)
                for i, message in enumerate(messages)]

    async def _stream(self, req: ChatCompletionRequest, plan: ToolPlan, params: SamplingParams, request_id: str,
                      prompt: TokensPrompt, gen) -> AsyncIterator[bytes]:
        created, model = created_now(), self.ctx.served_name(req.model)
        options = req.stream_options
        is_usage = options is not None and options.include_usage
        is_continuous = is_usage and options.continuous_usage_stats
        num_prompt, num_completion, num_cached = len(prompt.token_ids), 0, 0

        def chunk(choice: ChatStreamChoice | None, prompt_token_ids: list[int] | None = None):
            usage = make_usage(num_prompt, num_completion, num_cached) if is_continuous else None
            return sse_event(ChatCompletionChunk(request_id, created, model, [choice] if choice else [],
                                                 usage=usage, prompt_token_ids=prompt_token_ids))

        streams = [ChoiceStream(plan) for _ in range(params.n)]
        parser = self.ctx.config.reasoning_parser
        thoughts = [None if parser is None else reasoning_stream(parser) for _ in range(params.n)]
        prompt_ids = list(prompt.token_ids) if req.return_token_ids else None
        async with aclosing(gen):
            is_first = True
            async for output in gen:
                if is_first:  # with the first output (as vLLM): a client that saw it has a request in the engine
                    is_first = False
                    for i in range(params.n):
                        yield chunk(ChatStreamChoice(i, DeltaMessage(role="assistant", content="")),
                                    prompt_ids if i == 0 else None)
                num_cached = output.num_cached_tokens
                for out in output.outputs:
                    num_completion += len(out.token_ids)
                    for choice in self._stream_choices(req, streams[out.index], thoughts[out.index], params, out):
                        yield chunk(choice)
        if is_usage:
            yield sse_event(ChatCompletionChunk(request_id, created, model, [],
                                                usage=make_usage(num_prompt, num_completion, num_cached)))

