"""The router's upstream HTTP/1.1 client: a keep-alive connection pool per backend on asyncio Protocols
(uvloop when the router runs on it), httptools for the response head and the chunked encoding.

Built for relaying: the request goes out as one write of ready bytes; the response body is handed over
as whatever arrived since the last read (all of it, joined), so a relayed stream costs one wake-up and
one read per burst of bytes, not a stack of async generators per chunk. A slow client pauses reading
from the backend (high-water mark), so the router never buffers more than that per request.

Errors are `UpstreamError`s: `UpstreamConnectError` (refused, unreachable, connect timeout),
`UpstreamTimeout` (no byte within the read timeout), `UpstreamDisconnected` (the backend closed the
connection, or sent garbage, before the response ended). A reused keep-alive connection that the backend
had closed meanwhile (it closes idle ones after a few seconds) is replaced by a fresh one once, silently.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import httptools

Header = tuple[bytes, bytes]

IDLE_EXPIRY_S = 4.0  # below uvicorn's default keep-alive timeout (5 s): we let go of a connection first
HIGH_WATER = 1 << 20  # bytes waiting for a slow client before we stop reading from the backend


class UpstreamError(Exception):
    """Any failure talking to a backend."""


class UpstreamConnectError(UpstreamError):
    """No connection: refused, unreachable, or the connect timeout passed."""


class UpstreamTimeout(UpstreamError):
    """The backend sent nothing within the read timeout."""


class UpstreamDisconnected(UpstreamError):
    """The backend closed the connection (or sent a malformed response) before the response ended."""


@dataclass(frozen=True)
class Origin:
    """Where a backend URL points: address, TLS, the Host header and a path prefix."""

    host: str
    port: int
    tls: bool
    host_header: bytes
    path_prefix: bytes

    @staticmethod
    def parse(url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"backend URL {url!r} is not http(s)://HOST[:PORT][/PATH]")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        return Origin(parts.hostname, port, tls, parts.netloc.encode(), parts.path.rstrip("/").encode())


def request_bytes(origin: Origin, path: str, body: bytes, headers: Sequence[Header], method: bytes = b"POST") -> bytes:
    """A request (POST unless told), head and body, ready to write."""
    head = [method, b" ", origin.path_prefix, path.encode(), b" HTTP/1.1\r\nhost: ", origin.host_header,
            b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]
    for name, value in headers:
        head += (name, b": ", value, b"\r\n")
    head += (b"\r\n", body)
    return b"".join(head)


class _Connection(asyncio.Protocol):
    """One TCP connection; the state of the response in progress on it."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.is_closed = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future[bool] | None = None  # result: True when the read timeout passed
        self._timer: asyncio.TimerHandle | None = None
        self._last_event_at = 0.0  # the last read, or the start of the wait
        self.begin()

    def begin(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[Header] = []
        self.chunks: list[bytes] = []
        self.num_buffered = 0
        self.is_paused = False
        self.head_done = self.complete = self.got_bytes = self.keep_alive = self.eof_ends_body = False
        self.error: UpstreamError | None = None
        self.sink: Callable[[bytes], bool] | None = None  # takes body bytes as they arrive (see start_sink)
        self.is_at_event_boundary = True  # the body bytes handed out so far end with a blank line (SSE)

    # ---- asyncio.Protocol -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self._last_event_at = self.loop.time()
        try:
            self.parser.feed_data(data)
        except Exception as e:  # noqa: BLE001 - HttpParserError, HttpParserUpgrade: not a response we relay
            self.error = UpstreamDisconnected(f"malformed response: {type(e).__name__}: {e}")
            self.abort()
        if self.sink is not None and not self.complete and self.error is None:
            if self.chunks and not self.sink(self.take()):
                self.sink = None  # the client is slow (or gone): the reader takes over, with flow control
            return  # nothing for the reader: it waits for the end
        self._wake()

    def eof_received(self) -> bool:
        return False  # close our side too: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_closed = True
        self.stop_timer()
        if self.head_done and self.eof_ends_body and not self.complete:
            self.complete = True  # a body delimited by the end of the connection
        elif not self.complete and self.error is None:
            self.error = UpstreamDisconnected("the backend closed the connection")
        self._wake()

    # ---- httptools callbacks ----------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        names = {name for name, _ in self.headers}
        self.eof_ends_body = (b"content-length" not in names and b"transfer-encoding" not in names
                              and self.status not in (204, 304))
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.num_buffered += len(body)
        if self.num_buffered > HIGH_WATER and not self.is_paused and self.transport is not None:
            self.is_paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.complete = True

    # ---- for the reader -----------------------------------------------------------------------------
    def take(self) -> bytes:
        data = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.is_at_event_boundary = data.endswith(b"\n\n")
        self.chunks.clear()
        self.num_buffered = 0
        if self.is_paused and not self.is_closed:
            self.is_paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]
        return data

    async def wait(self, timeout: float) -> None:
        """Until something happens on the connection; UpstreamTimeout (and the connection closed) after
        `timeout` seconds of silence. One timer per connection, re-armed only when it fires (not one per
        wait: a relayed stream waits once per chunk)."""
        loop = self.loop
        self._last_event_at = loop.time()
        if self._timer is None:
            self._timer = loop.call_at(self._last_event_at + timeout, self._check_timeout, timeout)
        self._waiter = waiter = loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None
        if waiter.result():
            self.abort()
            raise UpstreamTimeout(f"no byte from the backend in {timeout:g} s")

    def _check_timeout(self, timeout: float) -> None:
        self._timer = None
        if self._waiter is None or self._waiter.done():
            return  # not waiting now: the next wait arms the timer again
        remaining = self._last_event_at + timeout - self.loop.time()
        if remaining <= 0:
            self._waiter.set_result(True)
        else:
            self._timer = self.loop.call_later(remaining, self._check_timeout, timeout)

    def stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(False)

    def abort(self) -> None:
        self.is_closed = True
        self.stop_timer()
        if self.transport is not None:
            self.transport.abort()

    @property
    def is_reusable(self) -> bool:
        return self.complete and self.keep_alive and self.error is None and not self.is_closed


class UpstreamResponse:
    """A response whose head has arrived; read the body with `read()` (b"" at the end), then `aclose()`."""

    def __init__(self, pool: UpstreamPool, origin: Origin, conn: _Connection, read_timeout_s: float) -> None:
        self._pool, self._origin, self._conn, self._timeout = pool, origin, conn, read_timeout_s
        self.status = conn.status
        self.headers = conn.headers
        self._is_open = True

    def header(self, name: bytes) -> bytes | None:
        return next((v for n, v in self.headers if n == name), None)

    @property
    def is_complete(self) -> bool:
        """The whole body has been read."""
        return self._conn.complete and not self._conn.chunks

    @property
    def is_at_event_boundary(self) -> bool:
        """The body handed out so far ends with a blank line (between two SSE events)."""
        return self._conn.is_at_event_boundary

    def start_sink(self, sink: Callable[[bytes], bool]) -> bool:
        """From now on, hand body bytes to `sink` as they arrive (inside the protocol callback: no task
        wake-up, no read), except the response's last bytes, which `read()` still returns with the end.
        `sink(data)` returns False when it wants no more (a slow or gone client): `read()` takes over.
        Refused (False) while bytes wait for `read()`, which keeps the order."""
        conn = self._conn
        if conn.chunks or conn.complete or conn.error is not None:
            return False
        conn.sink = sink
        return True

    @property
    def is_sinking(self) -> bool:
        return self._conn.sink is not None

    async def read(self) -> bytes:
        """The body bytes that arrived since the last read (waiting for some); b"" once it is complete."""
        conn = self._conn
        while True:
            if conn.chunks:
                return conn.take()
            if conn.complete:
                return b""
            if conn.error is not None:
                raise conn.error
            await conn.wait(self._timeout)

    async def read_all(self) -> bytes:
        parts = []
        while chunk := await self.read():
            parts.append(chunk)
        return b"".join(parts)

    async def aclose(self) -> None:
        """Back to the pool when the response was read to its end, else the connection is closed (so the
        backend sees the disconnect and aborts the request)."""
        if self._is_open:
            self._is_open = False
            self._conn.sink = None
            self._pool.release(self._origin, self._conn)


class UpstreamPool:
    """Keep-alive connections to every backend, most recently used first."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float, idle_expiry_s: float = IDLE_EXPIRY_S) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.idle_expiry_s = idle_expiry_s
        self._origins: dict[str, Origin] = {}
        self._idle: dict[Origin, list[_Connection]] = {}
        self._tls: ssl.SSLContext | None = None

    async def send(self, url: str, path: str, body: bytes, headers: Sequence[Header],
                   method: bytes = b"POST") -> UpstreamResponse:
        """Send the request (a POST unless `method` says otherwise) and wait for the response head."""
        origin = self._origins.get(url) or self._origins.setdefault(url, Origin.parse(url))
        request = request_bytes(origin, path, body, headers, method)
        conn = self._take_idle(origin)
        if conn is not None:
            try:
                return await self._exchange(origin, conn, request)
            except UpstreamDisconnected:
                if conn.got_bytes:
                    raise
                # a stale keep-alive connection (closed by the backend meanwhile): once more, on a fresh one
        return await self._exchange(origin, await self._connect(origin), request)

    async def _exchange(self, origin: Origin, conn: _Connection, request: bytes) -> UpstreamResponse:
        try:
            conn.transport.write(request)  # type: ignore[union-attr]
            while not conn.head_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait(self.read_timeout_s)
        except BaseException:
            conn.abort()
            raise
        return UpstreamResponse(self, origin, conn, self.read_timeout_s)

    async def _connect(self, origin: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = self._tls_context() if origin.tls else None
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_Connection, origin.host, origin.port, ssl=tls,
                                       server_hostname=origin.host if tls else None),
                self.connect_timeout_s)
        except (OSError, asyncio.TimeoutError) as e:
            raise UpstreamConnectError(f"cannot connect to {origin.host}:{origin.port}: {e or type(e).__name__}") from e
        return conn

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def _take_idle(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        oldest_ok = time.monotonic() - self.idle_expiry_s
        while idle:
            conn = idle.pop()
            if not conn.is_closed and not conn.transport.is_closing() and conn.idle_since > oldest_ok:
                conn.begin()
                return conn
            conn.abort()
        return None

    def release(self, origin: Origin, conn: _Connection) -> None:
        if not conn.is_reusable:
            conn.abort()
            return
        conn.stop_timer()
        conn.idle_since = time.monotonic()
        self._idle.setdefault(origin, []).append(conn)

    def forget(self, url: str) -> None:
        """Close the idle connections to a backend that left."""
        origin = self._origins.pop(url, None)
        for conn in self._idle.pop(origin, ()) if origin else ():
            conn.abort()

    def num_idle(self, url: str) -> int:
        origin = self._origins.get(url)
        return sum(not c.is_closed for c in self._idle.get(origin, ())) if origin else 0

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
        self._idle.clear()


class Response(Protocol):
    """What the proxy needs of an upstream response (UpstreamResponse; the tests' in-memory backends have their own)."""

    status: int
    headers: list[Header]  # names lower-case

    is_complete: bool  # the whole body has been read (may stay False until read() returns b"")
    is_at_event_boundary: bool  # the body read so far ends with a blank line (between SSE events)

    def header(self, name: bytes) -> bytes | None: ...

    async def read(self) -> bytes: ...

    async def read_all(self) -> bytes: ...

    def start_sink(self, sink: Callable[[bytes], bool]) -> bool: ...

    async def aclose(self) -> None: ...


class Upstream(Protocol):
    """Sends a request (POST unless `method` says otherwise) to a backend and returns once the response head
    arrived (raises UpstreamError)."""

    async def send(self, url: str, path: str, body: bytes, headers: Sequence[Header],
                   method: bytes = b"POST") -> Response: ...

    def forget(self, url: str) -> None: ...

    async def aclose(self) -> None: ...
