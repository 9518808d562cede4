"""The router's lean upstream client (router/upstream.py) against fake backends on loopback sockets, through
the real app: bytes relayed unchanged (chunked and Content-Length), keep-alive reuse, a stale pooled
connection replaced silently, connect errors and timeouts retried, a cut stream ending with the SSE error
event, and a client disconnect closing the upstream connection."""

import asyncio
import functools
import json
from dataclasses import dataclass, field

import httpx

from llmserve.router.app import build_app
from llmserve.router.classifier import AutoRouteConfig
from llmserve.router.config import AutoscaleConfig, BackendSpec, PoolSpec, RouterConfig, RouterSetup
from llmserve.router.gateway import Gateway
from llmserve.router.upstream import HIGH_WATER, Origin, _Connection, request_bytes

SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-backend-header: yes\r\ntransfer-encoding: chunked\r\n\r\n"
EVENTS = (b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"b"}]}\n\n', b"data: [DONE]\n\n")


def sync(fn):
    @functools.wraps(fn)
    def wrapper():
        return asyncio.run(asyncio.wait_for(fn(), 20))

    return wrapper


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: bytes
    connection: int  # index of the connection it came on
    number: int  # its number on that connection (0: first)


@dataclass
class FakeBackend:
    """An HTTP/1.1 server whose answers a script writes: `script(seen, writer, reader) -> keep the connection`."""

    script: object
    requests: list = field(default_factory=list)
    num_connections: int = 0
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader, writer) -> None:
        index, self.num_connections = self.num_connections, self.num_connections + 1
        try:
            for number in range(1000):
                head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
                headers = {name.lower(): value for name, value in (line.split(": ", 1) for line in head[1:] if line)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                seen = Seen(head[0].split()[1], headers, body, index, number)
                self.requests.append(seen)
                if not await self.script(seen, writer, reader):
                    break
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.set()
            writer.close()

    def close(self) -> None:
        self.server.close()


async def sse_ok(seen, writer, reader) -> bool:
    writer.write(SSE_HEAD)
    for event in EVENTS:
        writer.write(chunk(event))
        await writer.drain()
    writer.write(b"0\r\n\r\n")
    return True


async def json_ok(seen, writer, reader) -> bool:
    body = json.dumps({"path": seen.path, "got": seen.body.decode()}).encode()
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    return True


def make_gateway(urls, **router) -> Gateway:
    pools = (PoolSpec("m", tuple(BackendSpec(u) for u in urls), policy="round-robin"),)
    config = RouterConfig(**{"retry_backoff_s": 0.0, "queue_timeout_s": 1.0, **router})
    return Gateway(RouterSetup(config, pools, AutoRouteConfig(), AutoscaleConfig(), {}))


async def call(gw, body, headers=None):
    transport = httpx.ASGITransport(app=build_app(gw))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        return await client.post("/v1/completions", content=body, headers=headers or {})


def backend(gw, url):
    return next(b for p in gw.pools.values() for b in p.backends if b.url == url)


def test_origin_and_request_bytes():
    origin = Origin.parse("http://example.org:8001/prefix/")
    assert (origin.host, origin.port, origin.tls, origin.path_prefix) == ("example.org", 8001, False, b"/prefix")
    assert Origin.parse("https://h").port == 443
    raw = request_bytes(origin, "/v1/completions", b"{}", [(b"authorization", b"Bearer k")])
    assert raw == (b"POST /prefix/v1/completions HTTP/1.1\r\nhost: example.org:8001\r\ncontent-length: 2\r\n"
                   b"authorization: Bearer k\r\n\r\n{}")


@sync
async def test_sse_relayed_unchanged_over_one_kept_alive_connection():
    fake = FakeBackend(sse_ok)
    url = await fake.start()
    gw = make_gateway([url])
    body = b'{"model": "m", "prompt": "hi", "stream": true}'
    for _ in range(3):
        r = await call(gw, body, headers={"authorization": "Bearer k", "x-request-id": "r1", "cookie": "no"})
        assert r.status_code == 200 and r.content == b"".join(EVENTS)
        assert r.headers["x-backend-header"] == "yes" and r.headers["x-llmserve-backend"] == url
    assert fake.num_connections == 1 and [s.number for s in fake.requests] == [0, 1, 2]
    seen = fake.requests[0]
    assert seen.body == body and seen.path == "/v1/completions"  # the body's bytes, not a re-encoding
    assert seen.headers["authorization"] == "Bearer k" and seen.headers["x-request-id"] == "r1"
    assert "cookie" not in seen.headers and seen.headers["host"] == url.removeprefix("http://")
    assert backend(gw, url).num_in_flight == 0 and gw.upstream.num_idle(url) == 1
    await gw.close()
    fake.close()


@sync
async def test_content_length_response_and_stale_connection_replaced_silently():
    async def closes_second(seen, writer, reader) -> bool:
        if seen.number == 1:
            return False  # a keep-alive connection the backend let go of: closed without an answer
        return await json_ok(seen, writer, reader)

    fake = FakeBackend(closes_second)
    url = await fake.start()
    gw = make_gateway([url])
    for i in range(2):
        r = await call(gw, b'{"model": "m", "prompt": "%d"}' % i)
        assert r.status_code == 200 and r.json()["got"] == '{"model": "m", "prompt": "%d"}' % i
        assert r.headers["content-length"] == str(len(r.content))
    assert fake.num_connections == 2 and backend(gw, url).health.num_consecutive_failures == 0
    assert b"retries_total{" not in gw.metrics.render()  # the replacement is no retry
    await gw.close()
    fake.close()


@sync
async def test_connect_error_and_timeout_retried_on_another_backend():
    async def silent(seen, writer, reader) -> bool:
        await reader.read()  # no answer, until the router gives up and closes the connection
        return False

    good, slow = FakeBackend(json_ok), FakeBackend(silent)
    good_url, slow_url = await good.start(), await slow.start()
    refused = "http://127.0.0.1:9"  # the discard port: nothing listens
    for first, reason in ((refused, b"connect"), (slow_url, b"disconnect")):  # round-robin tries `first` first
        gw = make_gateway([first, good_url], upstream_timeout_s=0.5)  # must fire on the silent one only
        r = await call(gw, b'{"model": "m", "prompt": "x"}')
        assert r.status_code == 200 and r.headers["x-llmserve-backend"] == good_url
        assert b'retries_total{pool="m",reason="%s"} 1.0' % reason in gw.metrics.render()
        assert backend(gw, first).health.num_consecutive_failures == 1
        assert all(b.num_in_flight == 0 for b in gw.pools["m"].backends)
        await gw.close()
    good.close(), slow.close()


class ManualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock moves only when told (`advance`): timeouts measured on it do not depend
    on how fast this machine runs the test."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def time(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_read_timeout_is_between_bytes_not_for_the_whole_stream():
    """The clock moves (by hand) 0.6 x the read timeout while the router waits for each event: the
    stream lasts 1.8 timeouts, no gap reaches one, it is not cut. With gaps of 1.1 timeouts it is."""
    assert relay_with_gaps(0.6) == b"".join(EVENTS)
    cut = relay_with_gaps(1.1)
    assert b"UpstreamTimeout" in cut and cut.endswith(b"data: [DONE]\n\n") and EVENTS[0] not in cut, cut


def relay_with_gaps(gap: float, timeout: float = 0.2) -> bytes:
    async def run() -> bytes:
        loop = asyncio.get_running_loop()
        relayed: asyncio.Queue[str] = asyncio.Queue()

        async def steady(seen, writer, reader) -> bool:
            writer.write(SSE_HEAD)
            for event in EVENTS:
                await relayed.get()  # the router sent on what came before and waits for more
                loop.advance(gap * timeout)
                await next_turn()  # the router's timer, due or not at the new time, runs first
                writer.write(chunk(event))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            return True

        fake = FakeBackend(steady)
        url = await fake.start()
        gw = make_gateway([url], upstream_timeout_s=timeout)
        body = await relay_through(gw, b'{"model": "m", "prompt": "hi", "stream": true}', relayed.put_nowait)
        assert loop.time() > timeout
        await gw.close()
        fake.close()
        return body

    with asyncio.Runner(loop_factory=ManualClockLoop) as runner:
        return runner.run(run())


async def next_turn() -> None:
    """One turn of the event loop (what is ready now runs, then timers due): ordering, not waiting."""
    await asyncio.sleep(0)


async def relay_through(gw, body: bytes, on_message) -> bytes:
    """The router app called directly; `on_message(type)` after each message it sends; returns the body."""
    messages = [{"type": "http.request", "body": body}]
    chunks = []

    async def receive():
        return messages.pop() if messages else await asyncio.Future()  # no disconnect

    async def send(message):
        chunks.append(message.get("body", b""))
        on_message(message["type"])

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    await build_app(gw)(scope, receive, send)
    return b"".join(chunks)


@sync
async def test_cut_stream_ends_with_sse_error_event():
    async def cut(seen, writer, reader) -> bool:
        writer.write(SSE_HEAD + chunk(EVENTS[0]) + chunk(b'data: {"choi'))
        await writer.drain()
        return False

    fake = FakeBackend(cut)
    url = await fake.start()
    gw = make_gateway([url])
    r = await call(gw, b'{"model": "m", "prompt": "hi", "stream": true}')
    events = r.content.split(b"\n\n")
    assert events[0] + b"\n\n" == EVENTS[0] and events[1] == b'data: {"choi'
    assert json.loads(events[2][len(b"data: "):])["error"]["code"] == "upstream_disconnected"
    assert events[3] == b"data: [DONE]"
    assert backend(gw, url).health.num_consecutive_failures == 1 and backend(gw, url).num_in_flight == 0
    await gw.close()
    fake.close()


@sync
async def test_client_disconnect_closes_the_upstream_connection():
    async def endless(seen, writer, reader) -> bool:
        writer.write(SSE_HEAD + chunk(EVENTS[0]))
        await writer.drain()
        await reader.read()  # until the router closes the connection
        return False

    fake = FakeBackend(endless)
    url = await fake.start()
    gw = make_gateway([url])
    first_byte, messages = asyncio.Event(), []

    async def receive():
        if not messages:
            messages.append("body")
            return {"type": "http.request", "body": b'{"model": "m", "prompt": "x", "stream": true}'}
        await first_byte.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        messages.append(message)
        if message.get("body"):
            first_byte.set()

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    await build_app(gw)(scope, receive, send)
    await asyncio.wait_for(fake.closed.wait(), 2)
    assert messages[2]["body"] == EVENTS[0] and backend(gw, url).num_in_flight == 0
    await gw.close()
    fake.close()


class FakeTransport:
    def __init__(self):
        self.calls = []

    def pause_reading(self):
        self.calls.append("pause")

    def resume_reading(self):
        self.calls.append("resume")

    def abort(self):
        self.calls.append("abort")


def connection(data: bytes = b""):
    conn, transport = _Connection(), FakeTransport()
    conn.connection_made(transport)
    if data:
        conn.data_received(data)
    return conn, transport


@sync
async def test_slow_client_pauses_reading_above_the_high_water_mark():
    conn, transport = connection(SSE_HEAD)
    part = b"x" * (HIGH_WATER // 4)
    for _ in range(5):
        conn.data_received(chunk(part))
    assert transport.calls == ["pause"] and conn.num_buffered == 5 * len(part)
    assert conn.take() == part * 5 and transport.calls == ["pause", "resume"]


@sync
async def test_body_until_eof_malformed_response_and_keep_alive():
    conn, _ = connection(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nsome body")
    conn.connection_lost(None)
    assert conn.complete and conn.error is None and conn.take() == b"some body" and not conn.is_reusable
    conn, transport = connection(b"NOT HTTP\r\n\r\n")
    assert conn.error is not None and "malformed" in str(conn.error) and transport.calls == ["abort"]
    conn, _ = connection(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
    assert conn.complete and conn.is_reusable and conn.headers == [(b"content-length", b"2")]
    conn, _ = connection(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nok")
    conn.connection_lost(None)
    assert conn.error is not None and not conn.complete  # cut short
