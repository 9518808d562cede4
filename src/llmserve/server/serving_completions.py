"""POST /v1/completions: prompts as text, token ids, or lists of either; streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response

from llmserve.engine.async_llm import TokensPrompt
from llmserve.outputs import CompletionOutput, RequestOutput, TokenLogprob
from llmserve.sampling_params import SamplingParams
from llmserve.server.params import build_params, completion_overrides
from llmserve.server.protocol import (CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionRequest,
                                      CompletionResponse, PromptTokenLogprob, Usage, decode_json, encode_json,
                                      make_usage)
from llmserve.server.serving_common import (ServingContext, TokenLabels, created_now, fold, logprob_labels,
                                            new_request_id)
from llmserve.server.streams import merge_async_iterators, sse_event, sse_response, until_disconnect, \
    with_error_event
from llmserve.server.structured_fields import FieldError


def completion_prompts(ctx: ServingContext, req: CompletionRequest) -> list[TokensPrompt]:
    return token_prompts(ctx, req.prompt, req.add_special_tokens, "prompt")


def token_prompts(ctx: ServingContext, prompt: str | list, add_special_tokens: bool, name: str) -> list[TokensPrompt]:
    """A request's prompts (field `name`: a string, strings, token ids, or lists of token ids), tokenized."""
    if isinstance(prompt, str):
        return [_text_prompt(ctx, prompt, add_special_tokens)]
    if not prompt:
        raise FieldError(name, f"{name} must not be an empty list")
    if all(isinstance(p, int) for p in prompt):
        return [TokensPrompt(list(prompt))]
    if all(isinstance(p, str) for p in prompt):
        return [_text_prompt(ctx, p, add_special_tokens) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [TokensPrompt(p) for p in prompt]
    raise FieldError(name, f"{name} must be a string, a list of strings, a list of token ids, or a list of such "
                           "lists")


def _text_prompt(ctx: ServingContext, text: str, add_special_tokens: bool) -> TokensPrompt:
    return TokensPrompt(ctx.engine.encode(text, add_special_tokens), text)


@dataclass
class _Choices:
    """Running state of every choice of a request (indices prompt * n + sequence)."""

    n: int
    num_completion_tokens: int = 0
    num_cached_tokens: dict[int, int] = field(default_factory=dict)
    text_offsets: dict[int, int] = field(default_factory=dict)
    started: set[int] = field(default_factory=set)  # choices that sent their first chunk


def completion_logprobs(token_text: TokenLabels, logprobs: list[TokenLogprob], num_top: int,
                        offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs([], [], [], [])
    for lp in logprobs:
        text = token_text(lp.token_id)
        top = {token_text(tid): value for tid, value in lp.top[:num_top]}
        top.setdefault(text, lp.logprob)
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def prompt_completion_logprobs(token_text: TokenLabels, prompt_ids: list[int], scored: list[TokenLogprob | None],
                               num_top: int) -> CompletionLogprobs:
    """OpenAI's echo with logprobs: the prompt tokens first, the first one without a logprob."""
    out = completion_logprobs(token_text, [lp for lp in scored if lp is not None], num_top, len(token_text(prompt_ids[0])))
    first = token_text(prompt_ids[0])
    return CompletionLogprobs([first] + out.tokens, [None] + out.token_logprobs, [None] + out.top_logprobs,
                              [0] + out.text_offset)


def join_logprobs(head: CompletionLogprobs, tail: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(head.tokens + tail.tokens, head.token_logprobs + tail.token_logprobs,
                              head.top_logprobs + tail.top_logprobs, head.text_offset + tail.text_offset)


def vllm_prompt_logprobs(token_text: TokenLabels, scored: list[TokenLogprob | None],
                         num_top: int) -> list[dict[str, PromptTokenLogprob] | None]:
    """vLLM's shape: per prompt token {token id: {logprob, rank, decoded_token}} for it and its top k."""
    out: list[dict[str, PromptTokenLogprob] | None] = []
    for lp in scored:
        if lp is None:
            out.append(None)
            continue
        entries = {str(tid): PromptTokenLogprob(value, rank, token_text(tid))
                   for rank, (tid, value) in enumerate(lp.top[:num_top], start=1)}
        entries[str(lp.token_id)] = PromptTokenLogprob(lp.logprob, lp.rank, token_text(lp.token_id))
        out.append(entries)
    return out


class CompletionServer:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, request: Request, body: bytes) -> Response:
        ctx = self.ctx
        req: CompletionRequest = decode_json(body, CompletionRequest)
        ctx.check_model(req.model)
        params = build_params(ctx.engine.default_sampling_params, completion_overrides(req))
        prompts = completion_prompts(ctx, req)
        for prompt in prompts:
            ctx.engine.check_request(len(prompt.token_ids), params)
        if req.echo:
            for prompt in prompts:
                prompt.text = prompt.text if prompt.text is not None else ctx.engine.decode(prompt.token_ids)
        ctx.admit(request.scope, len(prompts) * params.n)
        request_id = new_request_id("cmpl")
        lora = ctx.lora_for(req.model)
        gens = [ctx.engine.generate(p, params, f"{request_id}-{i}", req.priority, lora=lora)
                for i, p in enumerate(prompts)]
        if req.stream:
            return sse_response(with_error_event(self._stream(req, params, request_id, prompts, gens), request_id),
                                request_id, ctx.is_shutting_down)
        finals = await until_disconnect(request, _collect(gens), request_id)
        return Response(encode_json(self._response(req, params, request_id, prompts, finals)),
                        media_type="application/json")

    def _choice(self, req: CompletionRequest, params: SamplingParams, state: _Choices, prompt_index: int,
                prompt: TokensPrompt, out: CompletionOutput,
                scored: list[TokenLogprob | None] | None) -> CompletionChoice:
        """`scored`: the prompt's logprobs (prompt_logprobs, or echo with logprobs), when they came."""
        index = prompt_index * state.n + out.index
        text = out.text
        is_first = index not in state.started
        state.started.add(index)
        labels = logprob_labels(self.ctx, req.return_tokens_as_token_ids)
        echo_logprobs = None
        if req.echo and is_first:
            text = (prompt.text or "") + text
            if req.logprobs is not None and scored is not None:
                echo_logprobs = prompt_completion_logprobs(labels, prompt.token_ids, scored, req.logprobs)
                state.text_offsets[index] = sum(len(t) for t in echo_logprobs.tokens)
        logprobs = echo_logprobs
        if params.logprobs is not None and out.logprobs is not None:
            offset = state.text_offsets.get(index, 0)
            logprobs = completion_logprobs(labels, out.logprobs, params.logprobs, offset)
            state.text_offsets[index] = offset + sum(len(t) for t in logprobs.tokens)
            if echo_logprobs is not None:
                logprobs = join_logprobs(echo_logprobs, logprobs)
        state.num_completion_tokens += len(out.token_ids)
        prompt_logprobs = None
        if req.prompt_logprobs is not None and is_first and scored is not None:
            prompt_logprobs = vllm_prompt_logprobs(labels, scored, req.prompt_logprobs)
        choice = CompletionChoice(index, text, logprobs, out.finish_reason, out.stop_reason, prompt_logprobs)
        if req.return_token_ids:
            choice.prompt_token_ids = list(prompt.token_ids) if is_first else None
            choice.token_ids = list(out.token_ids)
        return choice

    def _usage(self, prompts: list[TokensPrompt], state: _Choices) -> Usage:
        return make_usage(sum(len(p.token_ids) for p in prompts), state.num_completion_tokens,
                          sum(state.num_cached_tokens.values()))

    def _response(self, req: CompletionRequest, params: SamplingParams, request_id: str,
                  prompts: list[TokensPrompt], finals: list[RequestOutput]) -> CompletionResponse:
        state = _Choices(params.n)
        choices = []
        for i, (prompt, final) in enumerate(zip(prompts, finals)):
            state.num_cached_tokens[i] = final.num_cached_tokens
            choices.extend(self._choice(req, params, state, i, prompt, out, final.prompt_logprobs)
                           for out in final.outputs)
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(request_id, created_now(), self.ctx.served_name(req.model), choices,
                                  self._usage(prompts, state))

    async def _stream(self, req: CompletionRequest, params: SamplingParams, request_id: str,
                      prompts: list[TokensPrompt], gens) -> AsyncIterator[bytes]:
        state = _Choices(params.n)
        created, model = created_now(), self.ctx.served_name(req.model)
        options = req.stream_options
        is_continuous = options is not None and options.include_usage and options.continuous_usage_stats
        async with aclosing(merge_async_iterators(gens)) as merged:
            async for i, output in merged:
                state.num_cached_tokens[i] = output.num_cached_tokens
                for out in output.outputs:
                    choice = self._choice(req, params, state, i, prompts[i], out, output.prompt_logprobs)
                    if not (choice.text or choice.token_ids or choice.finish_reason or choice.logprobs):
                        continue  # nothing new (text held back at a partial UTF-8 character)
                    usage = self._usage(prompts, state) if is_continuous else None
                    yield sse_event(CompletionChunk(request_id, created, model, [choice], usage=usage))
        if options is not None and options.include_usage:
            yield sse_event(CompletionChunk(request_id, created, model, [], usage=self._usage(prompts, state)))


async def _collect(gens) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(gens)
    async with aclosing(merge_async_iterators(gens)) as merged:
        async for i, output in merged:
            finals[i] = fold(finals[i], output)
    assert all(f is not None and f.finished for f in finals), "a request ended without a final output"
    return finals  # type: ignore[return-value]
