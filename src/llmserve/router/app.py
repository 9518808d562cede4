"""The router's HTTP app: the OpenAI generation routes forwarded to pools, /v1/models (the union of
the pools), /health, /metrics. All state is the Gateway on `app.state.gateway`."""

from __future__ import annotations

import time

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from llmserve.router import proxy
from llmserve.router.classifier import RouteDecision
from llmserve.router.gateway import Gateway
from llmserve.router.ratelimit import retry_after_header
from llmserve.router.requests import decode_body, route_request, with_model
from llmserve.server.errors import APIError, error_response, install_error_handlers, service_unavailable

_FORWARDED_HEADERS = ("content-type", "authorization", "accept", "x-request-id")


def build_app(gw: Gateway) -> Starlette:
    routes = [Route("/v1/completions", _generation(gw, "/v1/completions"), methods=["POST"]),
              Route("/v1/chat/completions", _generation(gw, "/v1/chat/completions"), methods=["POST"]),
              Route("/v1/models", _models(gw), methods=["GET"]),
              Route("/health", _health(gw), methods=["GET"]),
              Route("/metrics", _metrics(gw), methods=["GET"])]
    app = Starlette(routes=routes)
    app.state.gateway = gw
    install_error_handlers(app)
    return app


def _generation(gw: Gateway, path: str):
    async def endpoint(request: Request) -> Response:
        try:
            return await _serve(gw, request, path)
        except proxy.UpstreamAnswer as e:
            return proxy.upstream_answer_response(e)
        except (APIError, ValueError) as e:
            return error_response(e)

    return endpoint


async def _serve(gw: Gateway, request: Request, path: str) -> Response:
    _check_rate_limit(gw, request)
    body = await request.body()
    obj = decode_body(body)
    route = route_request(obj, gw.config.prefix)
    pool, decision = gw.resolve(route)
    fwd = proxy.Forward(pool, route, path, with_model(body, obj, pool.upstream_model),
                        _upstream_headers(request), _decision_headers(pool.name, decision))
    return await proxy.forward(gw, request, fwd)


def _check_rate_limit(gw: Gateway, request: Request) -> None:
    key = _api_key(request)
    wait_s = gw.limiter.check(key, time.monotonic())
    if wait_s is not None:
        gw.metrics.rejected.labels("rate_limited").inc()
        raise APIError(429, "rate limit exceeded for this API key", code="rate_limit_exceeded",
                       headers={"Retry-After": retry_after_header(wait_s)})


def _api_key(request: Request) -> str:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _upstream_headers(request: Request) -> dict[str, str]:
    return {name: value for name in _FORWARDED_HEADERS if (value := request.headers.get(name)) is not None}


def _decision_headers(pool: str, decision: RouteDecision | None) -> dict[str, str]:
    headers = {"x-llmserve-pool": pool}
    if decision is not None:
        headers["x-llmserve-route"] = f"{decision.pool}; reason={decision.reason}"
    return headers


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
