"""The router's HTTP app: the OpenAI generation routes forwarded to pools, /v1/models (the union of
the pools), /health, /metrics, /dashboard. All state is the Gateway on `app.state.gateway`."""

from __future__ import annotations

import time

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from llmserve.router import proxy
from llmserve.router.classifier import RouteDecision
from llmserve.router.dashboard import dashboard_routes
from llmserve.router.direct_write import client_transport
from llmserve.router.gateway import Gateway
from llmserve.router.ratelimit import retry_after_header
from llmserve.router.requests import decode_body, route_request, with_model
from llmserve.server.errors import APIError, error_response, install_error_handlers, service_unavailable

_FORWARDED_HEADERS = frozenset({b"content-type", b"authorization", b"accept", b"x-request-id"})


GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class RouterApp:
    """The ASGI app: the generation routes on a lean path (raw ASGI, bytes in and out), everything else
    (models, health, metrics, 404/405) through Starlette."""

    def __init__(self, gw: Gateway, fallback: Starlette) -> None:
        self.gateway = gw
        self.fallback = fallback
        self.state = fallback.state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] in GENERATION_PATHS and scope["method"] == "POST":
            await serve_generation(self.gateway, scope, receive, send)
        else:
            await self.fallback(scope, receive, send)


def build_app(gw: Gateway) -> RouterApp:
    routes = [*(Route(path, _GenerationEndpoint(gw), methods=["POST"]) for path in sorted(GENERATION_PATHS)),
              Route("/v1/models", _models(gw), methods=["GET"]),
              Route("/health", _health(gw), methods=["GET"]),
              Route("/metrics", _metrics(gw), methods=["GET"]), *dashboard_routes(gw)]
    app = Starlette(routes=routes)
    app.state.gateway = gw
    install_error_handlers(app)
    return RouterApp(gw, app)


class _GenerationEndpoint:
    """The generation routes as a raw ASGI endpoint of the Starlette app (so that other methods get 405);
    RouterApp takes the POSTs before Starlette's routing and middleware."""

    def __init__(self, gw: Gateway) -> None:
        self.gateway = gw

    async def __call__(self, scope, receive, send) -> None:
        await serve_generation(self.gateway, scope, receive, send)


class _ClientGone(Exception):
    """The client disconnected while sending its body."""


async def serve_generation(gw: Gateway, scope, receive, send) -> None:
    headers = _forwarded_headers(scope["headers"])
    try:
        _check_rate_limit(gw, headers.get(b"authorization", b""))
        body = await _read_body(receive)
        obj = decode_body(body)
        route = route_request(obj, gw.config.prefix)
        pool, decision = gw.resolve(route)
    except _ClientGone:
        return
    except (APIError, ValueError) as e:
        await proxy.send_error(send, e)
        return
    fwd = proxy.Forward(pool, route, scope["path"], with_model(body, obj, pool.upstream_model),
                        tuple(headers.items()), _decision_headers(pool.name, decision), client_transport(scope))
    await proxy.forward(gw, fwd, receive, send)


async def _read_body(receive) -> bytes:
    message = await receive()
    if message["type"] == "http.disconnect":
        raise _ClientGone()
    body = message.get("body", b"")
    if not message.get("more_body"):
        return body
    parts = [body]
    while message.get("more_body"):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone()
        parts.append(message.get("body", b""))
    return b"".join(parts)


def _forwarded_headers(raw: list[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    """The request headers that go upstream (names lower-case, as ASGI servers give them)."""
    return {name: value for name, value in raw if name in _FORWARDED_HEADERS}


def _check_rate_limit(gw: Gateway, authorization: bytes) -> None:
    if not gw.limiter.is_enabled:
        return
    wait_s = gw.limiter.check(_api_key(authorization), time.monotonic())
    if wait_s is not None:
        gw.metrics.rejected.labels("rate_limited").inc()
        raise APIError(429, "rate limit exceeded for this API key", code="rate_limit_exceeded",
                       headers={"Retry-After": retry_after_header(wait_s)})


def _api_key(authorization: bytes) -> str:
    scheme, _, token = authorization.decode("latin-1").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _decision_headers(pool: str, decision: RouteDecision | None) -> tuple[tuple[bytes, bytes], ...]:
    headers = ((b"x-llmserve-pool", pool.encode()),)
    if decision is None:
        return headers
    return (*headers, (b"x-llmserve-route", f"{decision.pool}; reason={decision.reason}".encode()))


def _models(gw: Gateway):
    async def endpoint(request: Request) -> Response:
        created = int(time.time())
        data = [{"id": name, "object": "model", "created": created, "owned_by": "llmserve-router"}
                for name in gw.model_names()]
        return Response(msgspec.json.encode({"object": "list", "data": data}), media_type="application/json")

    return endpoint


def _health(gw: Gateway):
    async def endpoint(request: Request) -> Response:
        if gw.is_healthy():
            return Response(status_code=200)
        return error_response(service_unavailable("no backend is healthy", retry_after=5))

    return endpoint


def _metrics(gw: Gateway):
    async def endpoint(request: Request) -> Response:
        gw.refresh_gauges()
        return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return endpoint
