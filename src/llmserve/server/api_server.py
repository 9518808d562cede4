"""The FastAPI app: routes only; all state lives on `app.state.ctx` (a ServingContext)."""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.responses import Response

from llmserve import __version__
from llmserve.http.errors import APIError, service_unavailable
from llmserve.server.dashboard import add_dashboard_routes
from llmserve.server.errors import install_error_handlers, error_response
from llmserve.server.middleware import FrontDoor
from llmserve.server.openapi import DocumentedAPI, schema_ref
from llmserve.server.protocol import (ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                      CompletionChunk, CompletionRequest, CompletionResponse, DetokenizeRequest,
                                      DetokenizeResponse, LoadLoRAAdapterRequest, ModelCard, ModelList, TokenizeRequest,
                                      TokenizeResponse, TokenizerInfo, UnloadLoRAAdapterRequest, decode_json,
                                      encode_json)
from llmserve.server.serving_chat import ChatServer
from llmserve.server.serving_common import ServingContext, created_now
from llmserve.server.protocol_responses import ResponseObject, ResponsesRequest, StreamEvent
from llmserve.server.serving_completions import CompletionServer
from llmserve.server.serving_embeddings import EmbeddingServer
from llmserve.server.protocol_embeddings import EmbeddingRequest, EmbeddingResponse
from llmserve.server.serving_responses import ResponsesServer
from llmserve.server.serving_tgi import (TGIInfo, TGIRequest, TGIResponse, TGIServer, TGIStreamError, TGIStreamEvent,
                                         tgi_info)
from llmserve.server.serving_tokens import TokenizerServer
from llmserve.server.streams import ClientDisconnected
from llmserve.server.structured_fields import UNENFORCED_HEADER, unenforced_in_request
from llmserve.server.ui import add_ui_routes

logger = logging.getLogger("llmserve.server")

CLIENT_CLOSED_REQUEST = 499  # nobody reads it: the client is gone


def json_response(obj, status_code: int = 200) -> Response:
    return Response(encode_json(obj), status_code=status_code, media_type="application/json")


def build_app(ctx: ServingContext) -> DocumentedAPI:
    app = DocumentedAPI(title="llmserve", version=__version__, description=_DESCRIPTION, redoc_url=None, docs_url=None,
                        default_response_class=Response)
    app.state.ctx = ctx
    install_error_handlers(app)
    _add_generation_routes(app, ctx)
    _add_info_routes(app, ctx)
    _add_tokenizer_routes(app, ctx)
    _add_lora_routes(app, ctx)
    add_dashboard_routes(app, ctx.metrics)
    add_ui_routes(app)
    app.add_middleware(FrontDoor, ctx=ctx, api_key=ctx.config.api_key,
                       max_body_bytes=ctx.config.num_max_body_bytes)
    return app


_DESCRIPTION = ("OpenAI-compatible completions, chat completions, responses and embeddings (--runner pooling), "
                "TGI's generate API, vLLM's tokenizer routes (/tokenize, /detokenize, /tokenizer_info). Unknown "
                "request fields are refused (400) except the ignored bookkeeping fields (user, metadata, store, ...) declared in each request schema.")


def _add_generation_routes(app: DocumentedAPI, ctx: ServingContext) -> None:
    completions, chat, tgi = CompletionServer(ctx), ChatServer(ctx), TGIServer(ctx)
    responses, embeddings = ResponsesServer(ctx), EmbeddingServer(ctx)

    async def serve(handler, request: Request) -> Response:
        body = await request.body()
        token = unenforced_in_request.set(())
        try:
            response = await handler(request, body)
            if unenforced_in_request.get():
                response.headers[UNENFORCED_HEADER] = "; ".join(unenforced_in_request.get())
            return response
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        finally:
            unenforced_in_request.reset(token)

    @app.post("/v1/completions", openapi_extra=app.body(CompletionRequest),
              responses=app.responses(CompletionResponse, chunk=CompletionChunk))
    async def create_completion(request: Request) -> Response:
        return await serve(completions.create, request)

    @app.post("/v1/chat/completions", openapi_extra=app.body(ChatCompletionRequest),
              responses=app.responses(ChatCompletionResponse, chunk=ChatCompletionChunk))
    async def create_chat_completion(request: Request) -> Response:
        return await serve(chat.create, request)

    @app.post("/generate", openapi_extra=app.body(TGIRequest), responses=app.responses(TGIResponse))
    async def tgi_generate(request: Request) -> Response:
        return await serve(tgi.generate, request)

    tgi_stream = app.responses(chunk=TGIStreamEvent, chunk_error=TGIStreamError)

    @app.post("/generate_stream", openapi_extra=app.body(TGIRequest), responses=tgi_stream)
    async def tgi_generate_stream(request: Request) -> Response:
        return await serve(tgi.generate_stream, request)

    @app.post("/v1/responses", openapi_extra=app.body(ResponsesRequest),
              responses=app.responses(ResponseObject, chunk=StreamEvent))
    async def create_response(request: Request) -> Response:
        return await serve(responses.create, request)

    @app.post("/v1/embeddings", openapi_extra=app.body(EmbeddingRequest), responses=app.responses(EmbeddingResponse))
    async def create_embedding(request: Request) -> Response:
        return await serve(embeddings.create, request)

    @app.get("/v1/responses/{response_id}", responses=app.responses(ResponseObject))
    async def retrieve_response(response_id: str) -> Response:
        return json_response(responses.retrieve(response_id))

    compat = {"type": "array", "items": schema_ref(TGIResponse)}  # TGIResponse: named by /generate

    @app.post("/", openapi_extra=app.body(TGIRequest),
              responses=app.responses(compat, chunk=TGIStreamEvent, chunk_error=TGIStreamError))
    async def tgi_compat(request: Request) -> Response:
        return await serve(tgi.compat, request)


def _add_info_routes(app: DocumentedAPI, ctx: ServingContext) -> None:
    @app.get("/health", responses=app.responses(description="Healthy (503 when draining or stalled)"))
    async def health() -> Response:
        if ctx.is_draining:
            return error_response(service_unavailable("the server is shutting down", retry_after=5))
        if not ctx.engine.is_making_progress(ctx.config.health_stall_timeout):
            reason = ctx.engine.client.dead_reason or "the engine has work but made no progress"
            return error_response(service_unavailable(f"unhealthy: {reason}", retry_after=30))
        return Response(status_code=200)

    @app.get("/kv_transfer", responses=app.responses(_object_of(disaggregation_mode="string", kv_port="integer")))
    async def kv_transfer() -> Response:
        """This server's disaggregation role, and the port its KV receiver binds (a decode server's)."""
        kv = ctx.engine.kv_transfer
        return json_response({"disaggregation_mode": kv.disaggregation_mode, "kv_port": kv.disaggregation_kv_port})

    @app.get("/version", responses=app.responses(_object_of(version="string")))
    async def version() -> Response:
        return json_response({"version": __version__})

    def model_card(model_id: str | None = None) -> ModelCard:
        info = ctx.engine.model_info
        lora = ctx.lora_for(model_id)
        if lora is not None:
            return ModelCard(lora.lora_name, created_now(), root=lora.lora_path, max_model_len=info.max_model_len,
                             parent=ctx.model_name)
        return ModelCard(ctx.model_name, created_now(), root=info.path, max_model_len=info.max_model_len)

    @app.get("/v1/models", responses=app.responses(ModelList))
    async def models() -> Response:
        """The model, then its LoRA adapters (parent: the model)."""
        names = [] if ctx.loras is None else list(ctx.loras.adapters)
        return json_response(ModelList([model_card(), *map(model_card, names)]))

    @app.get("/v1/models/{model_id:path}", responses=app.responses(ModelCard))
    async def model(model_id: str) -> Response:
        """OpenAI's models.retrieve: the served model's or an adapter's card, 404 for any other name."""
        return json_response(model_card(model_id))

    @app.get("/info", responses=app.responses(TGIInfo))
    async def info() -> Response:
        return json_response(tgi_info(ctx))

    @app.get("/metrics", responses=app.responses(text="text/plain"))
    async def metrics() -> Response:
        """From the stats of the engine's last step (no call into the engine)."""
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/reset_prefix_cache", responses=app.responses(_object_of(success="boolean")))
    async def reset_prefix_cache() -> Response:
        return json_response({"success": await ctx.engine.reset_prefix_cache()})


def _add_lora_routes(app: DocumentedAPI, ctx: ServingContext) -> None:
    """vLLM's run-time adapter routes (behind the API key like every generation route). An adapter unloaded
    while requests run with it lets them finish; new requests naming it get 404."""

    @app.post("/v1/load_lora_adapter", openapi_extra=app.body(LoadLoRAAdapterRequest),
              responses=app.responses(text="text/plain"))
    async def load_lora_adapter(request: Request) -> Response:
        body: LoadLoRAAdapterRequest = decode_json(await request.body(), LoadLoRAAdapterRequest)
        _registry(ctx).add(body.lora_name, body.lora_path)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter", openapi_extra=app.body(UnloadLoRAAdapterRequest),
              responses=app.responses(text="text/plain"))
    async def unload_lora_adapter(request: Request) -> Response:
        body: UnloadLoRAAdapterRequest = decode_json(await request.body(), UnloadLoRAAdapterRequest)
        registry = _registry(ctx)
        lora = registry.get(body.lora_name)
        if lora is not None and body.lora_int_id is not None and body.lora_int_id != lora.lora_int_id:
            raise APIError(400, f"lora_int_id {body.lora_int_id} is not adapter {body.lora_name!r}'s "
                           f"({lora.lora_int_id})", param="lora_int_id")
        registry.remove(body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")


def _registry(ctx: ServingContext):
    if ctx.loras is None or not ctx.loras.is_enabled:
        raise APIError(400, "LoRA adapters are not enabled on this server (start it with --enable-lora)")
    return ctx.loras


def _object_of(**types: str) -> dict:
    """The JSON Schema of an object with these required fields (name=JSON type)."""
    return {"type": "object", "properties": {k: {"type": t} for k, t in types.items()}, "required": list(types)}


def _add_tokenizer_routes(app: DocumentedAPI, ctx: ServingContext) -> None:
    tokenizer = TokenizerServer(ctx)
    for prefix in ("", "/v1"):
        app.add_api_route(f"{prefix}/tokenize", _tokenize(tokenizer), methods=["POST"],
                          openapi_extra=app.body(TokenizeRequest), responses=app.responses(TokenizeResponse))
        app.add_api_route(f"{prefix}/detokenize", _detokenize(tokenizer), methods=["POST"],
                          openapi_extra=app.body(DetokenizeRequest), responses=app.responses(DetokenizeResponse))
    app.add_api_route("/tokenizer_info", _tokenizer_info(tokenizer), methods=["GET"],
                      responses=app.responses(TokenizerInfo))


def _tokenizer_info(tokenizer: TokenizerServer):
    async def tokenizer_info() -> Response:
        return json_response(tokenizer.info())

    return tokenizer_info


def _tokenize(tokenizer: TokenizerServer):
    async def tokenize(request: Request) -> Response:
        return json_response(tokenizer.tokenize(await request.body()))

    return tokenize


def _detokenize(tokenizer: TokenizerServer):
    async def detokenize(request: Request) -> Response:
        return json_response(tokenizer.detokenize(await request.body()))

    return detokenize
