"""The router's HTTP app: every route of an llmserve replica forwarded to a pool (the POSTs to the pool of
the body's `model`, else the default pool; the GETs to any healthy replica), and the router's own:
/v1/models (the union of the pools, and the LoRA adapters their backends serve), /health, /metrics, /dashboard, /reset_prefix_cache (to every
replica). All state is the Gateway on `app.state.gateway`."""

from __future__ import annotations

import asyncio
import time

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from llmserve.http.errors import APIError, error_response, install_error_handlers, service_unavailable
from llmserve.router import proxy
from llmserve.router.classifier import RouteDecision
from llmserve.router.dashboard import dashboard_routes
from llmserve.router.direct_write import client_transport
from llmserve.router.fetch import fetch
from llmserve.router.gateway import Gateway
from llmserve.router.ratelimit import retry_after_header
from llmserve.router.policies import RouteRequest
from llmserve.router.requests import decode_body, route_request
from llmserve.router.upstream import UpstreamError

_FORWARDED_HEADERS = frozenset({b"content-type", b"authorization", b"accept", b"x-request-id"})


GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# The replica's other routes: POSTs with a JSON body (TGI's generate API, vLLM's tokenizer), then GETs.
POST_PATHS = GENERATION_PATHS | {"/v1/responses", "/v1/embeddings", "/generate", "/generate_stream", "/",
                                 "/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize"}
GET_PATHS = frozenset({"/version", "/info", "/tokenizer_info", "/"})
PLAYGROUND_ASSETS = "/static/playground"  # the playground page's files (GET / is the page)


class RouterApp:
    """The ASGI app: the forwarded POST routes on a lean path (raw ASGI, bytes in and out), everything else
    (forwarded GETs, models, health, metrics, 404/405) through Starlette."""

    def __init__(self, gw: Gateway, fallback: Starlette) -> None:
        self.gateway = gw
        self.fallback = fallback
        self.state = fallback.state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] in POST_PATHS and scope["method"] == "POST":
            await serve_forwarded(self.gateway, scope, receive, send)
        elif scope["type"] == "http" and _is_playground_asset(scope):
            await serve_get(self.gateway, scope, receive, send)
        else:
            await self.fallback(scope, receive, send)


def _is_playground_asset(scope) -> bool:
    return scope["method"] in ("GET", "HEAD") and scope["path"].startswith(PLAYGROUND_ASSETS + "/")


def build_app(gw: Gateway) -> RouterApp:
    forwarded = _ForwardedEndpoint(gw)
    routes = [*(Route(path, forwarded, methods=["POST"] + (["GET"] if path in GET_PATHS else []))
                for path in sorted(POST_PATHS)),
              *(Route(path, forwarded, methods=["GET"]) for path in sorted(GET_PATHS - POST_PATHS)),
              Route("/v1/models", _models(gw), methods=["GET"]),
              Route("/v1/models/{model:path}", _model(gw), methods=["GET"]),
              Route("/reset_prefix_cache", _reset_prefix_cache(gw), methods=["POST"]),
              Route("/health", _health(gw), methods=["GET"]),
              Route("/metrics", _metrics(gw), methods=["GET"]), *dashboard_routes(gw)]
    app = Starlette(routes=routes)
    app.state.gateway = gw
    install_error_handlers(app)
    return RouterApp(gw, app)


class _ForwardedEndpoint:
    """The forwarded routes as a raw ASGI endpoint of the Starlette app (so that other methods get 405);
    RouterApp takes the POSTs before Starlette's routing and middleware."""

    def __init__(self, gw: Gateway) -> None:
        self.gateway = gw

    async def __call__(self, scope, receive, send) -> None:
        if scope["method"] == "POST":
            await serve_forwarded(self.gateway, scope, receive, send)
        else:
            await serve_get(self.gateway, scope, receive, send)


class _ClientGone(Exception):
    """The client disconnected while sending its body."""


async def serve_forwarded(gw: Gateway, scope, receive, send) -> None:
    """A POST with a JSON body, to the pool its `model` names (the default pool when it names none)."""
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
    fwd = proxy.Forward(pool, route, _path(scope), body, tuple(headers.items()),
                        _decision_headers(pool.name, decision), client_transport(scope), obj)
    await proxy.forward(gw, fwd, receive, send)


async def serve_get(gw: Gateway, scope, receive, send) -> None:
    """A GET (HEAD too, sent as a GET) to any healthy replica."""
    headers = _forwarded_headers(scope["headers"])
    try:
        _check_rate_limit(gw, headers.get(b"authorization", b""))
    except APIError as e:
        await proxy.send_error(send, e)
        return
    pool = gw.any_pool()
    fwd = proxy.Forward(pool, RouteRequest(pool.name), _path(scope), b"", tuple(headers.items()),
                        _decision_headers(pool.name, None), client_transport(scope), method=b"GET")
    await proxy.forward(gw, fwd, receive, send)


def _path(scope) -> str:
    query = scope.get("query_string", b"")
    return f"{scope['path']}?{query.decode('latin-1')}" if query else scope["path"]


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


def _model_card(gw: Gateway, name: str, created: int) -> dict:
    """A pool's card: its replicas' (root, max_model_len, ...) under the pool's name, else a plain one."""
    pool = gw.pools.get(name)
    cards = [b.model_card for b in pool.backends if b.model_card and b.is_up] if pool is not None else []
    base = {"object": "model", "created": created, "owned_by": "llmserve-router"}
    return {**base, **(cards[0] if cards else {}), "id": name}


def _adapter_cards(gw: Gateway, created: int) -> dict[str, dict]:
    """{adapter: card} of the LoRA adapters some up backend serves, each with its pool's name as parent (the
    backends' own /v1/models cards, as vLLM lists an adapter)."""
    cards = {}
    for pool in gw.pools.values():
        for name in sorted({a for b in pool.backends if b.is_up for a in b.adapters}):
            cards.setdefault(name, {"id": name, "object": "model", "created": created, "owned_by": "llmserve-router",
                                    "parent": pool.name})
    return cards


def _models(gw: Gateway):
    async def endpoint(request: Request) -> Response:
        created = int(time.time())
        data = [_model_card(gw, name, created) for name in gw.model_names()]
        data += [card for name, card in _adapter_cards(gw, created).items() if name not in gw.model_names()]
        return Response(msgspec.json.encode({"object": "list", "data": data}), media_type="application/json")

    return endpoint


def _model(gw: Gateway):
    async def endpoint(request: Request) -> Response:
        name, created = request.path_params["model"], int(time.time())
        if name in gw.model_names():
            return Response(msgspec.json.encode(_model_card(gw, name, created)), media_type="application/json")
        adapter = _adapter_cards(gw, created).get(name)
        if adapter is None:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        return Response(msgspec.json.encode(adapter), media_type="application/json")

    return endpoint


def _reset_prefix_cache(gw: Gateway):
    """Sent to every replica that is up; success when all of them succeeded."""
    async def reset(url: str) -> bool:
        try:
            response = await fetch(gw.upstream, url, "/reset_prefix_cache", gw.config.health_timeout_s,
                                   method=b"POST")
            return response.status == 200 and response.json().get("success") is True
        except (UpstreamError, ValueError, AttributeError):
            return False

    async def endpoint(request: Request) -> Response:
        urls = [b.url for pool in gw.pools.values() for b in pool.backends if b.is_up]
        results = await asyncio.gather(*(reset(url) for url in urls))
        return Response(msgspec.json.encode({"success": bool(urls) and all(results)}), media_type="application/json")

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
