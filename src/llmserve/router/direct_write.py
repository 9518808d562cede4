"""Relayed body bytes written straight onto the client's socket.

A relayed SSE event through ASGI costs a task wake-up (the relay waits on the upstream read), a read,
a message dict and uvicorn's `send` coroutine, for bytes the router passes on unchanged. Instead, the
router's uvicorn protocol (`RouterHttpProtocol`, uvicorn's httptools protocol) also puts its transport
into each request's scope (`scope["extensions"]["llmserve.transport"]`), and once a chunked response has
started through `send`, a `ChunkedBodyWriter` writes the body chunks onto that transport from inside
the upstream connection's data callback. The response's start and end still go through `send`, so
uvicorn's own bookkeeping (keep-alive, the closing chunk) is untouched. Any other ASGI server (or the
h11 protocol) leaves the extension out and the relay stays on `send`.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from llmserve.router.upstream import HIGH_WATER  # also the most bytes queued for a client on direct writes

TRANSPORT_EXTENSION = "llmserve.transport"


class RouterHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, plus its transport in the scope's extensions."""

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {TRANSPORT_EXTENSION: self.transport}


def client_transport(scope) -> asyncio.Transport | None:
    return scope.get("extensions", {}).get(TRANSPORT_EXTENSION)


class ChunkedBodyWriter:
    """Writes body chunks of a response whose head uvicorn sent with chunked transfer encoding."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def __call__(self, data: bytes) -> bool:
        """Write `data` as one chunk; False when the client is gone or slow (queued past HIGH_WATER)."""
        if self.transport.is_closing():
            return False
        self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))
        return self.can_write()

    def can_write(self) -> bool:
        return not self.transport.is_closing() and self.transport.get_write_buffer_size() < HIGH_WATER
