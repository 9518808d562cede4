"""Forwarding one request: pick a backend (waiting in the gateway queue if need be), send, retry with
backoff while nothing has reached the client yet, then relay the response bytes unchanged, straight
onto the ASGI `send` (no Response object, no re-chunking: each read hands over all the bytes that arrived).

Retried (on another backend where there is one): connect errors and timeouts, the backend closing the
connection before its response headers, and 503 answers. Never retried: anything after the response
headers were received, since from then on bytes flow to the client. A stream the backend cuts ends
with an SSE error event and `data: [DONE]`. A client that disconnects cancels the request (a watcher
task sees `http.disconnect`), which closes the upstream connection, so the backend aborts the request and
frees its KV blocks.

A pool whose backends serve its model under another name (rewrite.py) costs more: the request body is
re-encoded per backend with the backend's name, and the response's `model` renamed back (a JSON body read
whole; an SSE stream event by event, not written straight onto the client's socket).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import msgspec

from llmserve.http.errors import APIError, ErrorBody, service_unavailable, to_api_error
from llmserve.http.sse import SSE_DONE, sse_error
from llmserve.router.admission import QueueFull, QueueTimeout
from llmserve.router.backends import Backend, Pool
from llmserve.router.direct_write import ChunkedBodyWriter
from llmserve.router.gateway import Gateway
from llmserve.router.policies import RouteRequest
from llmserve.router.rewrite import ModelRename, SseRenamer, json_body, request_body
from llmserve.router.upstream import Header, Response, UpstreamConnectError, UpstreamError

_DROPPED_HEADERS = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"date", b"server"})
_FAILURE_STATUSES = frozenset({502, 504})  # a proxy in front of the backend could not reach it


@dataclass(frozen=True)
class Forward:
    """One request to forward: where, what, and the headers the router adds to the response."""

    pool: Pool
    route: RouteRequest
    path: str  # with the query string, if any
    body: bytes
    headers: tuple[Header, ...]  # sent upstream (lower-case names)
    extra_response_headers: tuple[Header, ...]
    client_transport: asyncio.Transport | None = None  # for direct body writes (router/direct_write.py)
    obj: dict | None = None  # the decoded JSON body, whose `model` is renamed per backend
    method: bytes = b"POST"

    def body_for(self, backend: Backend) -> bytes:
        return request_body(self.body, self.obj, self.pool.model_of(backend, self.route.model))


@dataclass
class _Retry:
    reason: str  # connect | disconnect | 503
    error: APIError
    response_body: bytes | None = None  # a backend's 503 body, answered as-is when the retries run out


class UpstreamAnswer(Exception):
    """The last backend's 503 body, relayed as the answer once the retries ran out."""

    def __init__(self, body: bytes) -> None:
        super().__init__("upstream 503")
        self.body = body


class _Watch:
    """Watches the client while the request is served: on `http.disconnect` before the response is done,
    cancels the serving task (which closes the upstream connection on its way out)."""

    def __init__(self, receive, task: asyncio.Task) -> None:
        self.is_done = False
        self.client_gone = False
        self.response_started = False
        self._task = task
        self._watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self.is_done:
            self.client_gone = True
            self._task.cancel()

    def stop(self) -> None:
        self.is_done = True
        self._watcher.cancel()


async def forward(gw: Gateway, fwd: Forward, receive, send) -> None:
    """Serve `fwd` on the ASGI `send`; returns quietly when the client went away."""
    started = time.perf_counter()
    task = asyncio.current_task()
    assert task is not None
    watch = _Watch(receive, task)
    try:
        backend, upstream = await _open(gw, fwd)
        await _relay(gw, fwd, backend, upstream, send, watch, started)
    except asyncio.CancelledError:
        if not watch.client_gone:
            raise
        task.uncancel()
    except UpstreamAnswer as e:
        watch.is_done = True
        await send_json(send, 503, e.body, ((b"retry-after", b"1"),))
    except Exception as e:  # noqa: BLE001 - answered in the OpenAI shape (to_api_error logs the unexpected)
        if watch.response_started:
            raise
        watch.is_done = True
        await send_error(send, e)
    finally:
        watch.stop()


async def _open(gw: Gateway, fwd: Forward) -> tuple[Backend, Response]:
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


async def _attempt(gw: Gateway, fwd: Forward, backend: Backend) -> Response | _Retry:
    sent_at = time.perf_counter()
    try:
        upstream = await gw.upstream.send(backend.url, fwd.path, fwd.body_for(backend), _upstream_headers(fwd, backend),
                                          fwd.method)
    except BaseException as e:
        fwd.pool.release(backend)
        if not isinstance(e, UpstreamError):
            raise
        gw.record_failure(backend)
        reason = "connect" if isinstance(e, UpstreamConnectError) else "disconnect"
        return _Retry(reason, APIError(502, f"no backend of `{fwd.pool.name}` answered (last: {reason} error "
                                            f"from {backend.url})", code="bad_gateway"))
    gw.metrics.upstream_latency.labels(fwd.pool.name, backend.url).observe(time.perf_counter() - sent_at)
    if upstream.status == 503:
        return await _on_unavailable(fwd, backend, upstream)
    if upstream.status in _FAILURE_STATUSES:
        gw.record_failure(backend)
    else:
        gw.record_success(backend)
    return upstream


async def _on_unavailable(fwd: Forward, backend: Backend, upstream: Response) -> _Retry:
    """A 503 (draining, overloaded): retried elsewhere, but not counted against its health."""
    try:
        body: bytes | None = await upstream.read_all()
    except UpstreamError:
        body = None
    finally:
        await upstream.aclose()
        fwd.pool.release(backend)
    return _Retry("503", service_unavailable(f"every backend of `{fwd.pool.name}` is unavailable"), body)


def _upstream_headers(fwd: Forward, backend: Backend) -> tuple[Header, ...]:
    if backend.spec.api_key is None:
        return fwd.headers
    kept = tuple(h for h in fwd.headers if h[0] != b"authorization")
    return (*kept, (b"authorization", f"Bearer {backend.spec.api_key}".encode()))


def _response_headers(fwd: Forward, backend: Backend, upstream: Response) -> list[Header]:
    headers = [h for h in upstream.headers if h[0] not in _DROPPED_HEADERS]
    headers += fwd.extra_response_headers
    headers.append((b"x-llmserve-backend", backend.url.encode()))
    return headers


async def _relay(gw: Gateway, fwd: Forward, backend: Backend, upstream: Response, send, watch: _Watch,
                 started: float) -> None:
    pool = fwd.pool
    served = pool.model_of(backend, fwd.route.model)
    rename = ModelRename(served, served if served in backend.adapters else pool.name)
    try:
        gw.metrics.requests.labels(pool.name, backend.url, str(upstream.status)).inc()
        if rename.is_needed and _content_type_is(upstream, b"application/json"):
            await _relay_renamed_json(gw, fwd, backend, upstream, send, watch, rename)
            return
        watch.response_started = True
        await send({"type": "http.response.start", "status": upstream.status,
                    "headers": _response_headers(fwd, backend, upstream)})
        renamer = SseRenamer(rename) if rename.is_needed and _content_type_is(upstream, b"text/event-stream") else None
        writer = None if renamer is not None else _direct_writer(fwd, upstream)
        tail = await _pump(gw, pool, backend, upstream, send, writer, renamer)
        if tail is not None:
            watch.is_done = True
            await send({"type": "http.response.body", "body": tail, "more_body": False})
    finally:
        await upstream.aclose()
        pool.release(backend)
        gw.metrics.request_duration.labels(pool.name).observe(time.perf_counter() - started)


def _content_type_is(upstream: Response, media_type: bytes) -> bool:
    return (upstream.header(b"content-type") or b"").startswith(media_type)


async def _relay_renamed_json(gw: Gateway, fwd: Forward, backend: Backend, upstream: Response, send,
                              watch: _Watch, rename: ModelRename) -> None:
    """A JSON answer read whole, its `model` renamed to the pool's, sent with its new length."""
    try:
        body = json_body(await upstream.read_all(), rename)
    except UpstreamError as e:
        gw.record_failure(backend)
        raise APIError(502, f"the backend {backend.url} closed the connection mid-answer ({e})",
                       code="upstream_disconnected") from None
    headers = [h for h in _response_headers(fwd, backend, upstream) if h[0] != b"content-length"]
    watch.response_started = watch.is_done = True
    await send({"type": "http.response.start", "status": upstream.status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _direct_writer(fwd: Forward, upstream: Response) -> ChunkedBodyWriter | None:
    """A writer onto the client's socket when uvicorn gave us one and will frame the body in chunks."""
    is_chunked = upstream.header(b"content-length") is None and upstream.status not in (204, 304)
    if fwd.client_transport is None or not is_chunked:
        return None
    return ChunkedBodyWriter(fwd.client_transport)


async def _pump(gw: Gateway, pool: Pool, backend: Backend, upstream: Response, send,
                writer: ChunkedBodyWriter | None, renamer: SseRenamer | None = None) -> bytes | None:
    """Relay the body; the last bytes to send (b"", or the SSE error event of a cut stream), or None when a
    cut response cannot be ended properly (not SSE): the connection to the client is then closed.
    With a writer, bytes go straight to the client as they arrive (read() returns only the end, or what
    piled up while the client was slow). With a renamer (never with a writer), only whole events go out."""
    if writer is not None:
        upstream.start_sink(writer)
    try:
        while chunk := await upstream.read():
            if renamer is not None:
                chunk = renamer.feed(chunk) + (renamer.flush() if upstream.is_complete else b"")
            if upstream.is_complete:
                return chunk  # the end arrived with these bytes: sent with the end of the response, one write
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if writer is not None and writer.can_write():
                upstream.start_sink(writer)
    except UpstreamError as e:
        gw.record_failure(backend)
        gw.metrics.stream_errors.labels(pool.name, backend.url).inc()
        if not _content_type_is(upstream, b"text/event-stream"):
            return None
        at_boundary = renamer is not None or upstream.is_at_event_boundary  # a renamer holds back partial events
        return (b"" if at_boundary else b"\n\n") + sse_error_event(e, backend) + SSE_DONE
    return renamer.flush() if renamer is not None else b""


def sse_error_event(exc: BaseException, backend: Backend) -> bytes:
    error = APIError(502, f"the backend {backend.url} closed the stream mid-way ({type(exc).__name__}: {exc})",
                     code="upstream_disconnected")
    return sse_error(error)


async def send_json(send, status: int, body: bytes, headers: tuple[Header, ...] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send, exc: BaseException) -> None:
    """An OpenAI-shaped error answer (400 for ValueError, the status of an APIError, else 500)."""
    err = to_api_error(exc)
    headers = tuple((k.lower().encode(), v.encode()) for k, v in err.headers.items())
    await send_json(send, err.status, msgspec.json.encode(ErrorBody(err.info())), headers)
