"""The FastAPI app: routes only; all state lives on `app.state.ctx` (a ServingContext)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import Response

from llmserve import __version__
from llmserve.server.errors import install_error_handlers, service_unavailable, error_response
from llmserve.server.middleware import FrontDoor
from llmserve.server.protocol import (DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList, TokenizeRequest,
                                      TokenizeResponse, decode_json, encode_json)
from llmserve.server.serving_chat import ChatServer
from llmserve.server.serving_common import ServingContext, created_now, render_chat
from llmserve.server.serving_completions import CompletionServer
from llmserve.server.serving_tgi import TGIServer
from llmserve.server.streams import ClientDisconnected

logger = logging.getLogger("llmserve.server")

CLIENT_CLOSED_REQUEST = 499  # nobody reads it: the client is gone


def json_response(obj, status_code: int = 200) -> Response:
    return Response(encode_json(obj), status_code=status_code, media_type="application/json")


def build_app(ctx: ServingContext) -> FastAPI:
    app = FastAPI(title="llmserve", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    install_error_handlers(app)
    _add_generation_routes(app, ctx)
    _add_info_routes(app, ctx)
    _add_tokenizer_routes(app, ctx)
    app.add_middleware(FrontDoor, ctx=ctx, api_key=ctx.config.api_key,
                       max_body_bytes=ctx.config.num_max_body_bytes)
    return app


def _add_generation_routes(app: FastAPI, ctx: ServingContext) -> None:
    completions, chat, tgi = CompletionServer(ctx), ChatServer(ctx), TGIServer(ctx)

    async def serve(handler, request: Request) -> Response:
        body = await request.body()
        try:
            return await handler(request, body)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        return await serve(completions.create, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        return await serve(chat.create, request)

    @app.post("/generate")
    async def tgi_generate(request: Request) -> Response:
        return await serve(tgi.generate, request)

    @app.post("/generate_stream")
    async def tgi_generate_stream(request: Request) -> Response:
        return await serve(tgi.generate_stream, request)

    @app.post("/")
    async def tgi_compat(request: Request) -> Response:
        return await serve(tgi.compat, request)


def _add_info_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.get("/health")
    async def health() -> Response:
        if ctx.is_draining:
            return error_response(service_unavailable("the server is shutting down", retry_after=5))
        if not ctx.engine.is_making_progress(ctx.config.health_stall_timeout):
            reason = ctx.engine.client.dead_reason or "the engine has work but made no progress"
            return error_response(service_unavailable(f"unhealthy: {reason}", retry_after=30))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> Response:
        return json_response({"version": __version__})

    @app.get("/v1/models")
    async def models() -> Response:
        info = ctx.engine.model_info
        card = ModelCard(ctx.model_name, created_now(), root=info.path, max_model_len=info.max_model_len)
        return json_response(ModelList([card]))

    @app.get("/metrics")
    async def metrics() -> Response:
        """From the stats of the engine's last step (no call into the engine)."""
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        return json_response({"success": await ctx.engine.reset_prefix_cache()})


def _add_tokenizer_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req: TokenizeRequest = decode_json(await request.body(), TokenizeRequest)
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if req.prompt is not None:
            tokens = ctx.engine.encode(req.prompt, req.add_special_tokens)
        else:
            text = render_chat(ctx.engine.tokenizer, req.messages, req.add_generation_prompt)
            tokens = ctx.engine.encode(text, add_special_tokens=False)
        return json_response(TokenizeResponse(len(tokens), ctx.engine.model_info.max_model_len, tokens))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req: DetokenizeRequest = decode_json(await request.body(), DetokenizeRequest)
        ctx.check_model(req.model)
        return json_response(DetokenizeResponse(ctx.engine.decode(req.tokens)))
