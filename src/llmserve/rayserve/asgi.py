"""Answer one forwarded request with an ASGI app in this process: the app sees an ordinary HTTP request
(body already complete), and what it sends comes out as a `ResponseHead` then body chunks. When the
consumer stops early (the client left, Ray cancelled the call), the app receives `http.disconnect`,
which is how our routes abort the request in the engine."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from llmserve.rayserve.messages import ForwardedRequest, ResponseHead

DISCONNECT_GRACE_S = 5.0  # after a disconnect, how long the app gets to abort and return


def http_scope(request: ForwardedRequest) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
            "query_string": request.query_string, "root_path": "", "headers": list(request.headers),
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "state": {}}


async def call_asgi(app, request: ForwardedRequest, extra_headers: tuple[tuple[bytes, bytes], ...] = ()
                    ) -> AsyncIterator[ResponseHead | bytes]:
    """Yields the response head (with the body's first chunk), then the rest of the body in chunks; chunks
    the app sent while the consumer was busy come out joined (one item instead of many under load)."""
    sent: asyncio.Queue[dict] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_given = False

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    task = asyncio.create_task(app(http_scope(request), receive, sent.put))
    try:
        async for item in _responses(sent, task, extra_headers):
            yield item
    finally:
        disconnected.set()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), DISCONNECT_GRACE_S)
        if not task.done():
            task.cancel()


async def _responses(sent: asyncio.Queue, task: asyncio.Task, extra_headers) -> AsyncIterator[ResponseHead | bytes]:
    start = await _next_message(sent, task)
    if start["type"] != "http.response.start":
        raise RuntimeError(f"the app sent {start['type']} before http.response.start")
    body, more = await _body_chunk(sent, task)
    yield ResponseHead(start["status"], (*start.get("headers", ()), *extra_headers), body, not more)
    while more:
        body, more = await _body_chunk(sent, task)
        if body:
            yield body


async def _body_chunk(sent: asyncio.Queue, task: asyncio.Task) -> tuple[bytes, bool]:
    """The next body message's bytes joined with those already waiting behind it; and whether more follow."""
    message = await _next_message(sent, task)
    chunks, more = [message.get("body", b"")], message.get("more_body", False)
    while more and not sent.empty():
        message = sent.get_nowait()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks), more


async def _next_message(sent: asyncio.Queue, task: asyncio.Task) -> dict:
    if not sent.empty():
        return sent.get_nowait()
    getter = asyncio.ensure_future(sent.get())
    await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
    if getter.done():
        return getter.result()
    getter.cancel()
    task.result()  # raises the app's exception, if any
    raise RuntimeError("the app returned without completing its response")
