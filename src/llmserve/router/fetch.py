"""Whole-body requests over the router's one upstream client (router/upstream.py): the health, model and
metrics probes, the P/D router's prefill call, the fan-out of admin routes. Each call has its own overall
timeout, shorter than the relay's read timeout, and comes back as a small record with the whole body."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmserve.router.upstream import Header, Upstream, UpstreamTimeout

JSON_HEADERS: tuple[Header, ...] = ((b"content-type", b"application/json"),)


@dataclass(frozen=True)
class Fetched:
    """A response read to its end."""

    status: int
    headers: list[Header]  # names lower-case
    body: bytes

    def header(self, name: bytes) -> bytes | None:
        return next((v for n, v in self.headers if n == name), None)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body as JSON (ValueError when it is not)."""
        return json.loads(self.body)


async def fetch(upstream: Upstream, url: str, path: str, timeout_s: float, *, method: bytes = b"GET",
                body: bytes = b"", headers: Sequence[Header] = ()) -> Fetched:
    """Send one request and read the whole response within `timeout_s` (UpstreamTimeout past it; any
    other failure is an UpstreamError). A response cut short closes its connection rather than reusing it."""
    try:
        return await asyncio.wait_for(_exchange(upstream, url, path, method, body, headers), timeout_s)
    except asyncio.TimeoutError as e:
        raise UpstreamTimeout(f"{method.decode()} {url}{path}: no whole response in {timeout_s:g} s") from e


async def fetch_json(upstream: Upstream, url: str, path: str, timeout_s: float, obj: Any,
                     headers: Sequence[Header] = ()) -> Fetched:
    """POST `obj` as JSON (the caller's content-type, if any, replaced)."""
    kept = [(n, v) for n, v in headers if n.lower() != b"content-type"]
    return await fetch(upstream, url, path, timeout_s, method=b"POST", body=json.dumps(obj).encode(),
                       headers=[*JSON_HEADERS, *kept])


async def _exchange(upstream: Upstream, url: str, path: str, method: bytes, body: bytes,
                    headers: Sequence[Header]) -> Fetched:
    response = await upstream.send(url, path, body, headers, method)
    try:
        return Fetched(response.status, list(response.headers), await response.read_all())
    finally:
        await response.aclose()
