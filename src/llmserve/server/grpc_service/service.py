"""The gRPC API (llmserve.proto's `Generation` service: generation, and embeddings on --runner pooling) on the
HTTP server's engine and event loop.

Same rules as the HTTP routes: the API key (`authorization: Bearer KEY` metadata), admission
(max_num_seqs + max_queued_requests sequences in flight, then UNAVAILABLE), the model's generation defaults
under the request's sampling fields, the draining on SIGTERM. HTTP statuses map to gRPC codes
(400 INVALID_ARGUMENT, 401 UNAUTHENTICATED, 404 NOT_FOUND, 503 UNAVAILABLE, 504 DEADLINE_EXCEEDED, else
INTERNAL); the details are the message the HTTP error would carry.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager

import grpc

from llmserve.engine.async_llm import TokensPrompt
from llmserve.http.errors import APIError
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams
from llmserve.server.errors import to_api_error
from llmserve.server.grpc_service import llmserve_pb2 as pb
from llmserve.server.grpc_service import llmserve_pb2_grpc as pb_grpc
from llmserve.server.params import build_params
from llmserve.server.serving_common import ServingContext, new_request_id
from llmserve.server.serving_embeddings import check_embeddings, embed_all

logger = logging.getLogger("llmserve.server")

_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
          404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.INVALID_ARGUMENT,
          503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}
_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "skip_special_tokens")


def sampling_overrides(sampling: pb.SamplingParams) -> dict:
    """The fields the request set, in SamplingParams' names (the rest: the model's defaults)."""
    overrides = {name: getattr(sampling, name) for name in _OPTIONAL if sampling.HasField(name)}
    overrides.update(stop=list(sampling.stop) or None, stop_token_ids=list(sampling.stop_token_ids) or None,
                     ignore_eos=sampling.ignore_eos, min_tokens=sampling.min_tokens)
    return overrides


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        async with self._call(context) as scope:
            request_id, prompt, gen = self._start(request, scope)
            token_ids, texts, last = [], [], None
            async with aclosing(gen):
                async for output in gen:
                    token_ids += output.outputs[0].token_ids
                    texts.append(output.outputs[0].text)
                    last = output
            return _response(request_id, token_ids, "".join(texts), len(prompt.token_ids), len(token_ids), last)

    async def GenerateStream(self, request: pb.GenerateRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        async with self._call(context) as scope:
            request_id, prompt, gen = self._start(request, scope)
            num_generated = 0
            async with aclosing(gen):
                async for output in gen:
                    out = output.outputs[0]
                    num_generated += len(out.token_ids)
                    if out.token_ids or out.finish_reason is not None:
                        yield _response(request_id, out.token_ids, out.text, len(prompt.token_ids), num_generated,
                                        output)

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        async with self._call(context, is_counted=False):
            if self.ctx.is_draining:
                return pb.HealthResponse(is_healthy=False, reason="the server is shutting down")
            engine = self.ctx.engine
            if not engine.is_making_progress(self.ctx.config.health_stall_timeout):
                reason = engine.client.dead_reason or "the engine has work but made no progress"
                return pb.HealthResponse(is_healthy=False, reason=reason)
            return pb.HealthResponse(is_healthy=True)

    async def ModelInfo(self, request: pb.ModelInfoRequest,
                        context: grpc.aio.ServicerContext) -> pb.ModelInfoResponse:
        async with self._call(context, is_counted=False):
            info = self.ctx.engine.model_info
            return pb.ModelInfoResponse(model=self.ctx.model_name, max_model_len=info.max_model_len,
                                        vocab_size=info.vocab_size, eos_token_ids=list(info.eos_token_ids))

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        async with self._call(context) as scope:
            ctx = self.ctx
            ctx.check_model(request.model or None)
            ctx.engine.check_runner(is_pooling=True)
            prompts = [self._embed_prompt(item) for item in request.inputs]
            dimensions = request.dimensions if request.HasField("dimensions") else None
            check_embeddings(ctx, prompts, dimensions)
            ctx.admit(scope, len(prompts))
            request_id = new_request_id("grpc-embd")
            vectors = await embed_all(ctx, prompts, request_id, dimensions, request.priority)
            embeddings = [pb.Embedding(values=vector.tolist()) for vector in vectors]
            return pb.EmbedResponse(request_id=request_id, embeddings=embeddings,
                                    prompt_tokens=sum(len(p.token_ids) for p in prompts))

    def _embed_prompt(self, item: pb.EmbedInput) -> TokensPrompt:
        kind = item.WhichOneof("input")
        if kind is None:
            raise APIError(400, "give each input as text or token_ids", param="inputs")
        if kind == "text":
            return TokensPrompt(self.ctx.engine.encode(item.text), item.text)
        return TokensPrompt(list(item.token_ids.ids))

    def _start(self, request: pb.GenerateRequest,
               scope: dict) -> tuple[str, TokensPrompt, AsyncIterator[RequestOutput]]:
        """Checked, admitted and started: the request's id, its prompt and its outputs."""
        ctx = self.ctx
        ctx.check_model(request.model or None)
        params: SamplingParams = build_params(ctx.engine.default_sampling_params,
                                              sampling_overrides(request.sampling))
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise APIError(400, "give the prompt as text or token_ids", param="prompt")
        prompt = TokensPrompt(ctx.engine.encode(request.text), request.text) if kind == "text" else \
            TokensPrompt(list(request.token_ids.ids))
        ctx.engine.check_request(len(prompt.token_ids), params)
        ctx.admit(scope, 1)
        request_id = new_request_id("grpc")
        lora = ctx.lora_for(request.model or None)
        return request_id, prompt, ctx.engine.generate(prompt, params, request_id, request.priority, lora=lora)

    @asynccontextmanager
    async def _call(self, context: grpc.aio.ServicerContext, is_counted: bool = True):
        """One RPC: the key checked, counted in flight (the drain waits for it), its admission released at the
        end, any error answered with its status. Yields the call's admission scope."""
        scope: dict = {}
        ctx = self.ctx
        if is_counted:
            ctx.num_http_in_flight += 1
        try:
            self._check_key(context)
            yield scope
        except Exception as e:  # noqa: BLE001 - classified (and internal ones logged) by to_api_error
            err = to_api_error(e)
            await context.abort(_CODES.get(err.status, grpc.StatusCode.INTERNAL), err.message)
        finally:
            ctx.release(scope)
            if is_counted:
                ctx.num_http_in_flight -= 1

    def _check_key(self, context: grpc.aio.ServicerContext) -> None:
        key = self.ctx.config.api_key
        if key is None:
            return
        given = dict(context.invocation_metadata() or ()).get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise APIError(401, "missing or wrong API key (metadata authorization: Bearer KEY)")


def bind_grpc(host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """A gRPC server bound to host:port (0: any free port) before the model loads, and its port."""
    server = grpc.aio.server()
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as e:
        raise RuntimeError(f"cannot bind gRPC {address}: {e}") from None
    if bound == 0:
        raise RuntimeError(f"cannot bind gRPC {address}")
    return server, bound


async def start_grpc(server: grpc.aio.Server, ctx: ServingContext) -> None:
    pb_grpc.add_GenerationServicer_to_server(GenerationService(ctx), server)
    await server.start()


def _response(request_id: str, token_ids, text: str, num_prompt: int, num_generated: int,
              output: RequestOutput | None) -> pb.GenerateResponse:
    """A message of `token_ids` and their text; the last one (its output finished) with the finish and usage."""
    response = pb.GenerateResponse(request_id=request_id, token_ids=list(token_ids), text=text)
    out = output.outputs[0] if output is not None else None
    if out is not None and out.finish_reason is not None:
        response.finish_reason = out.finish_reason
        response.usage.CopyFrom(pb.Usage(prompt_tokens=num_prompt, completion_tokens=num_generated,
                                         cached_tokens=output.num_cached_tokens))
    return response
