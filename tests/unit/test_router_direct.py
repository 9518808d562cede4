"""Direct body writes (router/direct_write.py): through a real uvicorn server with the router's protocol,
streamed bytes reach the client unchanged, mostly without the ASGI `send`, the connection stays usable for
the next request, a cut stream still ends with the SSE error event; the upstream connection's sink keeps
the order of bytes and hands over to `read()` when the client is slow."""

import asyncio
import json
import socket

import httpx
import uvicorn

from llmserve.router import direct_write
from llmserve.router.app import build_app
from llmserve.router.direct_write import RouterHttpProtocol
from llmserve.router.upstream import Origin, UpstreamPool, UpstreamResponse

from llmserve.testing.servers import until

from test_router_upstream import EVENTS, SSE_HEAD, FakeBackend, chunk, connection, json_ok, make_gateway, sync


class Pace:
    """A fake backend sends its next part only once the client has received all it sent before: each part
    reaches the router as a read of its own, on any machine."""

    def __init__(self) -> None:
        self.num_sent = 0
        self.num_received = 0
        self.cond = asyncio.Condition()

    async def caught_up(self) -> None:
        async with self.cond:
            await self.cond.wait_for(lambda: self.num_received >= self.num_sent)

    async def send(self, writer, body: bytes) -> None:
        """One chunk of a chunked body, after the client has everything before it."""
        await self.caught_up()
        self.num_sent += len(body)
        writer.write(chunk(body))
        await writer.drain()

    async def read(self, response: httpx.Response) -> bytes:
        parts = []
        async for part in response.aiter_raw():
            parts.append(part)
            async with self.cond:
                self.num_received += len(part)
                self.cond.notify_all()
        return b"".join(parts)


class _Router:
    """The router app on uvicorn with RouterHttpProtocol, on a loopback port, in this event loop."""

    def __init__(self, gw) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(build_app(gw), http=RouterHttpProtocol, lifespan="off", log_level="warning")
        self.server = uvicorn.Server(config)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    async def __aenter__(self):
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        await until(lambda: self.server.started, what="uvicorn to start", poll_s=0.01)
        return self

    async def __aexit__(self, *exc):
        self.server.should_exit = True
        await self.task
        self.sock.close()


def _count_direct_writes(monkeypatch) -> list[bytes]:
    written = []
    original = direct_write.ChunkedBodyWriter.__call__

    def spy(self, data):
        written.append(data)
        return original(self, data)

    monkeypatch.setattr(direct_write.ChunkedBodyWriter, "__call__", spy)
    return written


def test_stream_written_directly_unchanged_and_connection_reused(monkeypatch):
    written = _count_direct_writes(monkeypatch)

    async def run():
        pace = Pace()

        async def paced_sse(seen, writer, reader) -> bool:
            writer.write(SSE_HEAD)
            for event in EVENTS:
                await pace.send(writer, event)
            await pace.caught_up()
            writer.write(b"0\r\n\r\n")
            return True

        async def answer(seen, writer, reader) -> bool:
            return await (paced_sse if b'"stream": true' in seen.body else json_ok)(seen, writer, reader)

        fake = FakeBackend(answer)  # streams: three events, each once the client has the one before
        url = await fake.start()
        gw = make_gateway([url])
        async with _Router(gw) as router, httpx.AsyncClient(base_url=router.url) as client:
            for _ in range(3):  # one client connection: uvicorn's keep-alive bookkeeping is intact
                body = b'{"model": "m", "prompt": "hi", "stream": true}'
                async with client.stream("POST", "/v1/completions", content=body) as r:
                    assert r.status_code == 200 and await pace.read(r) == b"".join(EVENTS)
                assert r.headers["x-backend-header"] == "yes" and r.headers["transfer-encoding"] == "chunked"
            r = await client.post("/v1/completions", content=b'{"model": "m"}')  # Content-Length: through send
        assert r.status_code == 200 and r.json()["got"] == '{"model": "m"}'
        await gw.close()
        fake.close()

    asyncio.run(asyncio.wait_for(run(), 20))
    assert len(written) >= 2 * 3 and set(written) <= set(EVENTS)  # at least events 2 and 3 of each stream


def test_cut_stream_with_direct_writes_ends_with_sse_error_event(monkeypatch):
    written = _count_direct_writes(monkeypatch)

    pace = Pace()

    async def cut(seen, writer, reader) -> bool:
        writer.write(SSE_HEAD)
        for part in (EVENTS[0], b'data: {"choi'):
            await pace.send(writer, part)
        await pace.caught_up()  # then the backend goes away mid-event
        return False

    async def run():
        fake = FakeBackend(cut)
        url = await fake.start()
        gw = make_gateway([url])
        async with _Router(gw) as router, httpx.AsyncClient(base_url=router.url) as client:
            body = b'{"model": "m", "prompt": "hi", "stream": true}'
            async with client.stream("POST", "/v1/completions", content=body) as r:
                content = await pace.read(r)
        events = content.split(b"\n\n")
        assert events[0] + b"\n\n" == EVENTS[0] and events[1] == b'data: {"choi'
        assert json.loads(events[2][len(b"data: "):])["error"]["code"] == "upstream_disconnected"
        assert events[3] == b"data: [DONE]"
        await gw.close()
        fake.close()

    asyncio.run(asyncio.wait_for(run(), 20))
    assert b'data: {"choi' in written


@sync
async def test_sink_keeps_order_and_hands_over_to_read_when_the_client_is_slow():
    conn, _ = connection(SSE_HEAD + chunk(EVENTS[0]))
    response = UpstreamResponse(UpstreamPool(1.0, 1.0), Origin.parse("http://x"), conn, 1.0)
    taken, is_slow = [], False

    def sink(data: bytes) -> bool:
        taken.append(data)
        return not is_slow

    assert not response.start_sink(sink)  # EVENTS[0] waits for read(): refused, or it would be overtaken
    assert await response.read() == EVENTS[0]
    assert response.start_sink(sink) and response.is_sinking
    conn.data_received(chunk(EVENTS[1]))
    assert taken == [EVENTS[1]] and not conn.chunks and response.is_at_event_boundary
    is_slow = True
    conn.data_received(chunk(b"data: {"))
    assert taken == [EVENTS[1], b"data: {"] and not response.is_sinking  # written, then no more
    assert not response.is_at_event_boundary
    conn.data_received(chunk(b"}\n\n"))
    assert await response.read() == b"}\n\n" and taken[-1] == b"data: {"
    assert response.start_sink(sink)
    conn.data_received(chunk(EVENTS[2]) + b"0\r\n\r\n")  # the end: kept for read(), sent with the end
    assert await response.read() == EVENTS[2] and response.is_complete and taken[-1] == b"data: {"
