"""Forwarding one request: pick a backend (waiting in the gateway queue if need be), send, retry with
backoff while nothing has reached the client yet, then relay the response bytes unchanged.

Retried (on another backend where there is one): connect errors and timeouts, the backend closing the
connection before its response headers, and 503 answers. Never retried: anything after the response
headers were received, since from then on bytes flow to the client. A stream the backend cuts ends
with an SSE error event and `data: [DONE]`. A client that disconnects cancels the relay, which closes
the upstream connection, so the backend aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import httpx
import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from llmserve.router.admission import QueueFull, QueueTimeout
from llmserve.router.backends import Backend, Pool
from llmserve.router.gateway import Gateway
from llmserve.router.policies import RouteRequest
from llmserve.server.errors import APIError, ErrorBody, service_unavailable

CLIENT_CLOSED_REQUEST = 499
SSE_DONE = b"data: [DONE]\n\n"
_DROPPED_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "date", "server"})
_FAILURE_STATUSES = frozenset({502, 504})  # a proxy in front of the backend could not reach it


class ClientGone(Exception):
    """The client disconnected before the response headers were ready."""


@dataclass(frozen=True)
class Forward:
    """One request to forward: where, what, and the headers the router adds to the response."""

    pool: Pool
    route: RouteRequest
    path: str
    body: bytes
    headers: dict[str, str]
    extra_response_headers: dict[str, str]


@dataclass
class _Retry:
    reason: str  # connect | disconnect | 503
    error: APIError
    response_body: bytes | None = None  # a backend's 503 body, answered as-is when the retries run out


async def forward(gw: Gateway, request: Request, fwd: Forward) -> Response:
    started = time.perf_counter()
    try:
        backend, upstream = await until_disconnect(request, _open(gw, fwd))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    gw.metrics.requests.labels(fwd.pool.name, backend.url, str(upstream.status_code)).inc()
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROPPED_HEADERS}
    headers.update(fwd.extra_response_headers)
    headers["x-llmserve-backend"] = backend.url
    return StreamingResponse(_relay(gw, fwd.pool, backend, upstream, started), status_code=upstream.status_code,
                             headers=headers)


async def _open(gw: Gateway, fwd: Forward) -> tuple[Backend, httpx.Response]:
    tried: set[str] = set()
    retry: _Retry | None = None
    for attempt in range(gw.config.max_retries + 1):
        if retry is not None:
            gw.metrics.retries.labels(fwd.pool.name, retry.reason).inc()
            await asyncio.sleep(gw.config.retry_backoff_s * 2 ** (attempt - 1))
        backend = await _acquire(gw, fwd, frozenset(tried))
        gw.metrics.decisions.labels(fwd.pool.name, backend.url, fwd.pool.policy.name).inc()
        tried.add(backend.url)
        outcome = await _attempt(gw, fwd, backend)
        if not isinstance(outcome, _Retry):
            return backend, outcome
        retry = outcome
    assert retry is not None
    gw.metrics.requests.labels(fwd.pool.name, "", str(retry.error.status)).inc()
    if retry.response_body is not None:
        raise UpstreamAnswer(retry.response_body)
    raise retry.error


class UpstreamAnswer(Exception):
    """The last backend's 503 body, relayed as the answer once the retries ran out."""

    def __init__(self, body: bytes) -> None:
        super().__init__("upstream 503")
        self.body = body


async def _acquire(gw: Gateway, fwd: Forward, tried: frozenset[str]) -> Backend:
    pool = fwd.pool
    try:
        return await pool.queue.acquire(lambda: pool.pick(fwd.route, time.monotonic(), tried),
                                        gw.config.queue_timeout_s)
    except QueueFull:
        gw.metrics.rejected.labels("queue_full").inc()
        raise service_unavailable(f"the router's queue for `{pool.name}` is full", retry_after=1) from None
    except QueueTimeout:
        gw.metrics.rejected.labels("queue_timeout").inc()
        raise service_unavailable(f"no backend of `{pool.name}` became available within "
                                  f"{gw.config.queue_timeout_s:g} s", retry_after=5) from None


async def _attempt(gw: Gateway, fwd: Forward, backend: Backend) -> httpx.Response | _Retry:
    request = gw.client.build_request("POST", backend.url + fwd.path, content=fwd.body,
                                      headers=_upstream_headers(fwd, backend))
    sent_at = time.perf_counter()
    try:
        upstream = await gw.client.send(request, stream=True)
    except BaseException as e:
        fwd.pool.release(backend)
        if not isinstance(e, httpx.TransportError):
            raise
        gw.record_failure(backend)
        reason = "connect" if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)) else "disconnect"
        return _Retry(reason, APIError(502, f"no backend of `{fwd.pool.name}` answered (last: {reason} error "
                                            f"from {backend.url})", code="bad_gateway"))
    gw.metrics.upstream_latency.labels(fwd.pool.name, backend.url).observe(time.perf_counter() - sent_at)
    if upstream.status_code == 503:
        return await _on_unavailable(fwd, backend, upstream)
    if upstream.status_code in _FAILURE_STATUSES:
        gw.record_failure(backend)
    else:
        gw.record_success(backend)
    return upstream


async def _on_unavailable(fwd: Forward, backend: Backend, upstream: httpx.Response) -> _Retry:
    """A 503 (draining, overloaded): retried elsewhere, but not counted against its health."""
    try:
        body = await upstream.aread()
    except httpx.HTTPError:
        body = None
    finally:
        await upstream.aclose()
        fwd.pool.release(backend)
    return _Retry("503", service_unavailable(f"every backend of `{fwd.pool.name}` is unavailable"), body)


def _upstream_headers(fwd: Forward, backend: Backend) -> dict[str, str]:
    if backend.spec.api_key is None:
        return fwd.headers
    return {**fwd.headers, "authorization": f"Bearer {backend.spec.api_key}"}


async def _relay(gw: Gateway, pool: Pool, backend: Backend, upstream: httpx.Response,
                 started: float) -> AsyncIterator[bytes]:
    is_sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
    last = b"\n\n"
    try:
        async for chunk in upstream.aiter_raw():
            last = chunk or last
            yield chunk
    except httpx.HTTPError as e:
        gw.record_failure(backend)
        gw.metrics.stream_errors.labels(pool.name, backend.url).inc()
        if is_sse:
            yield (b"" if last.endswith(b"\n\n") else b"\n\n") + sse_error_event(e, backend) + SSE_DONE
    finally:
        with anyio.CancelScope(shield=True):  # a cancelled relay must still close the upstream connection
            await upstream.aclose()
        pool.release(backend)
        gw.metrics.request_duration.labels(pool.name).observe(time.perf_counter() - started)


def sse_error_event(exc: BaseException, backend: Backend) -> bytes:
    error = APIError(502, f"the backend {backend.url} closed the stream mid-way ({type(exc).__name__})",
                     code="upstream_disconnected")
    return b"data: " + msgspec.json.encode(ErrorBody(error.info())) + b"\n\n"


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work):
    """Await `work`; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


def upstream_answer_response(exc: UpstreamAnswer) -> Response:
    return Response(exc.body, status_code=503, media_type="application/json", headers={"Retry-After": "1"})
