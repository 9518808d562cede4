"""The router's upstream interface over an httpx.AsyncClient, for the tests' in-memory backends
(httpx.MockTransport): `Gateway(setup, upstream=MockUpstream(c))`, `PDRouter(config, MockUpstream(c))`.
The router itself has one upstream client, the connection pool of router/upstream.py (docs/benchmarks.md,
"One upstream client")."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import anyio
import httpx

from llmserve.router.upstream import (Header, UpstreamConnectError, UpstreamDisconnected, UpstreamError,
                                      UpstreamTimeout)


def _upstream_error(e: httpx.TransportError) -> UpstreamError:
    message = f"{type(e).__name__}: {e}"
    if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
        return UpstreamConnectError(message)
    if isinstance(e, httpx.TimeoutException):
        return UpstreamTimeout(message)
    return UpstreamDisconnected(message)


async def _whole(content: bytes) -> AsyncIterator[bytes]:
    """The body of a response made with its content (httpx.Response(json=...)), which httpx has read already."""
    yield content


class HttpxResponse:
    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status = response.status_code
        self.headers: list[Header] = [(name.lower(), value) for name, value in response.headers.raw]
        is_read = response.is_stream_consumed
        self._chunks: AsyncIterator[bytes] = _whole(response.content) if is_read else response.aiter_raw()
        self.is_complete = False  # known only once read() returned b""
        self.is_at_event_boundary = True

    def header(self, name: bytes) -> bytes | None:
        return next((v for n, v in self.headers if n == name), None)

    async def read(self) -> bytes:
        try:
            chunk = await anext(self._chunks, b"")
        except httpx.TransportError as e:
            raise _upstream_error(e) from e
        if chunk:
            self.is_at_event_boundary = chunk.endswith(b"\n\n")
        return chunk

    def start_sink(self, sink) -> bool:
        return False  # bytes come through read() only

    async def read_all(self) -> bytes:
        parts = []
        while chunk := await self.read():
            parts.append(chunk)
        return b"".join(parts)

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):  # a cancelled relay must still close the upstream connection
            await self._response.aclose()


class MockUpstream:
    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def send(self, url: str, path: str, body: bytes, headers: Sequence[Header],
                   method: bytes = b"POST") -> HttpxResponse:
        request = self.client.build_request(method.decode(), url + path, content=body, headers=list(headers))
        try:
            return HttpxResponse(await self.client.send(request, stream=True))
        except httpx.TransportError as e:
            raise _upstream_error(e) from e

    def forget(self, url: str) -> None:
        pass  # httpx closes idle connections itself

    async def aclose(self) -> None:
        pass  # the client belongs to the caller (the Gateway closes it)
