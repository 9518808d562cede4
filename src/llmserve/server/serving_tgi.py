"""Text Generation Inference's API: POST /generate, /generate_stream, the compat route POST / and GET /info.

Compatible with huggingface_hub.InferenceClient.text_generation (details, streaming). The stream is
TGI's: one event per token, the last with `generated_text` and `details`, and no [DONE].
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import Response

from llmserve import __version__
from llmserve.engine.async_llm import TokensPrompt
from llmserve.http.sse import data_event
from llmserve.outputs import CompletionOutput, TokenLogprob
from llmserve.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS, ParamError, SamplingParams
from llmserve.server.errors import to_api_error
from llmserve.server.protocol import (NULL, NULL_OR_FALSE, NumLogprobs, Penalty, PositiveInt, RepetitionPenalty,
                                      StopStrings, Temperature, TopK, TopP, decode_json, encode_json, refused_unless)
from llmserve.server.serving_common import ServingContext, collect_final, new_request_id
from llmserve.server.structured_fields import FieldError, TGIGrammar, tgi_structured_outputs
from llmserve.server.streams import log_error_event, sse_response, until_disconnect

DEFAULT_MAX_NEW_TOKENS = 100


class TGIParameters(msgspec.Struct, kw_only=True):
    best_of: PositiveInt | None = None
    decoder_input_details: refused_unless(NULL_OR_FALSE) = None
    details: bool | None = None
    do_sample: bool | None = None
    frequency_penalty: Penalty | None = None
    grammar: TGIGrammar | None = None  # {"type": "json" | "regex", "value": ...}
    max_new_tokens: PositiveInt | None = None
    repetition_penalty: RepetitionPenalty | None = None
    return_full_text: bool | None = None
    seed: int | None = None
    stop: StopStrings | None = None
    temperature: Temperature | None = None
    top_k: TopK | None = None
    top_n_tokens: NumLogprobs | None = None
    top_p: TopP | None = None
    truncate: PositiveInt | None = None
    typical_p: float | None = None
    watermark: refused_unless(NULL_OR_FALSE) = None
    adapter_id: refused_unless(NULL) = None


class TGIRequest(msgspec.Struct, kw_only=True):
    inputs: str
    parameters: TGIParameters = msgspec.field(default_factory=TGIParameters)
    stream: bool = False


class TGIToken(msgspec.Struct):
    id: int
    text: str
    logprob: float
    special: bool


class TGIDetails(msgspec.Struct):
    finish_reason: str
    generated_tokens: int
    seed: int | None = None
    prefill: list[TGIToken] = []
    tokens: list[TGIToken] = []
    top_tokens: list[list[TGIToken]] | None = None


class TGIResponse(msgspec.Struct, omit_defaults=True):
    generated_text: str
    details: TGIDetails | None = None


class TGIStreamDetails(msgspec.Struct):
    finish_reason: str
    generated_tokens: int
    input_length: int
    seed: int | None = None


class TGIStreamEvent(msgspec.Struct):
    index: int
    token: TGIToken
    generated_text: str | None = None
    details: TGIStreamDetails | None = None
    top_tokens: list[TGIToken] | None = None


class TGIStreamError(msgspec.Struct):
    """TGI's in-stream error event."""

    error: str
    error_type: str


class TGIInfo(msgspec.Struct):
    """GET /info: TGI's fields (3.x names, plus 1.x/2.0's `max_input_length` and `model_dtype`)."""

    model_id: str
    model_sha: str | None
    model_dtype: str
    model_pipeline_tag: str | None
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_input_tokens: int
    max_input_length: int
    max_total_tokens: int
    max_batch_size: int | None
    validation_workers: int
    max_client_batch_size: int
    router: str
    version: str
    sha: str | None = None
    docker_label: str | None = None


def tgi_info(ctx: ServingContext) -> TGIInfo:
    """A prompt may take all but one position: at least one token is generated."""
    info = ctx.engine.model_info
    return TGIInfo(model_id=ctx.model_name, model_sha=None, model_dtype=f"torch.{info.dtype}",
                   model_pipeline_tag="text-generation", max_concurrent_requests=ctx.num_max_in_flight,
                   max_best_of=1, max_stop_sequences=MAX_STOP_STRINGS, max_input_tokens=info.max_model_len - 1,
                   max_input_length=info.max_model_len - 1, max_total_tokens=info.max_model_len,
                   max_batch_size=ctx.max_num_seqs, validation_workers=1, max_client_batch_size=1,
                   router="llmserve", version=__version__)


def _check_unsupported(p: TGIParameters) -> None:
    if p.watermark:
        raise ValueError("watermark is not supported")
    if p.typical_p is not None and p.typical_p < 1.0:
        raise ValueError("typical_p is not supported")
    if p.adapter_id is not None:
        raise ValueError("adapter_id is not supported")
    if p.decoder_input_details:
        raise ValueError("decoder_input_details (prompt logprobs) is not supported")
    if p.best_of is not None and p.best_of > 1:
        raise ValueError("best_of > 1 is not supported")
    if p.top_n_tokens is not None and not 0 <= p.top_n_tokens <= MAX_LOGPROBS:
        raise ValueError(f"top_n_tokens must be in [0, {MAX_LOGPROBS}], got {p.top_n_tokens}")


_TGI_FIELDS = {"prompt": "inputs", "max_tokens": "parameters.max_new_tokens", "logprobs": "parameters.top_n_tokens"}


def tgi_overrides(p: TGIParameters) -> dict:
    """TGI parameters in SamplingParams' names; greedy unless sampling was asked for."""
    _check_unsupported(p)
    overrides: dict[str, Any] = {"max_tokens": DEFAULT_MAX_NEW_TOKENS if p.max_new_tokens is None
                                 else p.max_new_tokens, "logprobs": p.top_n_tokens or 0, "stop": p.stop,
                                 "structured_outputs": tgi_structured_outputs(p.grammar)}
    for name in ("frequency_penalty", "repetition_penalty", "seed", "temperature", "top_k", "top_p"):
        if getattr(p, name) is not None:
            overrides[name] = getattr(p, name)
    is_sampling = p.do_sample or any(getattr(p, k) is not None for k in ("temperature", "top_k", "top_p"))
    if not is_sampling:
        overrides["temperature"] = 0.0
    return overrides


def tgi_finish_reason(out: CompletionOutput, eos_token_ids: list[int]) -> str:
    if out.finish_reason == "stop":
        is_eos = out.stop_reason is None or out.stop_reason in eos_token_ids
        return "eos_token" if is_eos else "stop_sequence"
    return out.finish_reason or "length"


class TGIServer:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.special_ids = set(ctx.engine.tokenizer.all_special_ids)

    async def compat(self, request: Request, body: bytes) -> Response:
        req: TGIRequest = decode_json(body, TGIRequest)
        if req.stream:
            return await self.generate_stream(request, body)
        response = await self.generate(request, body)
        return Response(b"[" + response.body + b"]", media_type="application/json")

    def _start(self, request: Request,
               body: bytes) -> tuple[TGIRequest, SamplingParams, TokensPrompt, Any, str]:
        ctx = self.ctx
        req: TGIRequest = decode_json(body, TGIRequest)
        params = ctx.engine.default_sampling_params(**tgi_overrides(req.parameters))
        token_ids = ctx.engine.encode(req.inputs)
        truncate = req.parameters.truncate
        if truncate is not None:
            if truncate <= 0:
                raise ValueError(f"truncate must be positive, got {truncate}")
            token_ids = token_ids[-truncate:]
        prompt = TokensPrompt(token_ids, req.inputs)
        try:
            ctx.engine.check_request(len(token_ids), params)
        except ParamError as e:  # named as SamplingParams names it: say TGI's field
            param = _TGI_FIELDS.get(e.param, f"parameters.{e.param}")
            raise FieldError(param, str(e)) from None
        ctx.admit(request.scope, 1)
        request_id = new_request_id("tgi")
        gen = ctx.engine.generate(prompt, params, request_id, 0)
        return req, params, prompt, gen, request_id

    async def generate(self, request: Request, body: bytes) -> Response:
        req, params, prompt, gen, request_id = self._start(request, body)
        final = await until_disconnect(request, collect_final(gen), request_id)
        out = final.outputs[0]
        text = (req.inputs + out.text) if req.parameters.return_full_text else out.text
        details = self._details(req.parameters, out) if req.parameters.details else None
        return Response(encode_json(TGIResponse(text, details)), media_type="application/json")

    def _token(self, token_id: int, text: str, logprob: float) -> TGIToken:
        return TGIToken(token_id, text, logprob, token_id in self.special_ids)

    def _top(self, lp: TokenLogprob, num_top: int) -> list[TGIToken]:
        return [self._token(tid, self.ctx.token_text(tid), value) for tid, value in lp.top[:num_top]]

    def _details(self, p: TGIParameters, out: CompletionOutput) -> TGIDetails:
        logprobs = out.logprobs or []
        tokens = [self._token(lp.token_id, self.ctx.token_text(lp.token_id), lp.logprob) for lp in logprobs]
        top = [self._top(lp, p.top_n_tokens) for lp in logprobs] if p.top_n_tokens else None
        return TGIDetails(tgi_finish_reason(out, self.ctx.engine.model_info.eos_token_ids), len(out.token_ids),
                          p.seed, [], tokens, top)

    async def generate_stream(self, request: Request, body: bytes) -> Response:
        req, params, prompt, gen, request_id = self._start(request, body)
        return sse_response(self._stream(req, prompt, gen, request_id), request_id, self.ctx.is_shutting_down)

    async def _stream(self, req: TGIRequest, prompt: TokensPrompt, gen, request_id: str) -> AsyncIterator[bytes]:
        p = req.parameters
        text, index = (req.inputs if p.return_full_text else ""), 0
        try:
            async with aclosing(gen):
                async for output in gen:
                    out = output.outputs[0]
                    text += out.text
                    events = self._events(p, out, index, text, len(prompt.token_ids))
                    index += len(events)
                    for event in events:
                        yield data_event(encode_json(event), b"data:")
        except Exception as e:  # noqa: BLE001 - TGI's in-stream error shape
            err = to_api_error(e)
            log_error_event(request_id, err.message)
            yield data_event(encode_json(TGIStreamError(err.message, err.info().type)), b"data:")

    def _events(self, p: TGIParameters, out: CompletionOutput, index: int, text: str,
                num_prompt_tokens: int) -> list[TGIStreamEvent]:
        """One event per new token; a merged delta's text rides on its last token."""
        logprobs = out.logprobs or []
        events = []
        for k, token_id in enumerate(out.token_ids):
            is_last = k == len(out.token_ids) - 1
            logprob = logprobs[k].logprob if k < len(logprobs) else 0.0
            top = self._top(logprobs[k], p.top_n_tokens) if p.top_n_tokens and k < len(logprobs) else None
            token = self._token(token_id, out.text if is_last else "", logprob)
            events.append(TGIStreamEvent(index + k, token, top_tokens=top))
        if out.finish_reason is not None:
            if not events:  # finished without a new token (abort): TGI still ends on a token event
                events.append(TGIStreamEvent(index, self._token(0, out.text, 0.0)))
            events[-1].generated_text = text
            events[-1].details = TGIStreamDetails(tgi_finish_reason(out, self.ctx.engine.model_info.eos_token_ids),
                                                  index + len(out.token_ids), num_prompt_tokens, p.seed)
        return events

