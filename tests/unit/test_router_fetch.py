"""Whole-body requests over the router's upstream pool (router/fetch.py), against fake backends on loopback
sockets: a GET probe and a JSON POST read whole on a reused connection, and a backend that never answers cut
off at the call's own timeout with its connection closed."""

import asyncio
import pytest

from llmserve.router.fetch import fetch, fetch_json
from llmserve.router.upstream import UpstreamPool, UpstreamTimeout
from test_router_upstream import FakeBackend, json_ok, sync


@sync
async def test_a_probe_and_a_json_post_come_back_whole_on_one_connection():
    backend = FakeBackend(json_ok)
    url = await backend.start()
    pool = UpstreamPool(connect_timeout_s=5.0, read_timeout_s=60.0)
    try:
        probe = await fetch(pool, url, "/health", 5.0)
        posted = await fetch_json(pool, url, "/v1/completions", 5.0, {"prompt": "hi"},
                                  [(b"content-type", b"text/plain"), (b"x-request-id", b"r1")])
    finally:
        await pool.aclose()
        backend.close()
    assert probe.status == 200 and probe.json() == {"path": "/health", "got": ""}
    assert probe.header(b"content-type") == b"application/json"
    assert posted.json() == {"path": "/v1/completions", "got": '{"prompt": "hi"}'}
    sent = backend.requests[1].headers
    assert sent["content-type"] == "application/json" and sent["x-request-id"] == "r1"  # the caller's type replaced
    assert backend.num_connections == 1  # the probe's connection went back to the pool


@sync
async def test_a_backend_that_never_answers_times_out_at_the_calls_own_timeout():
    async def silent(seen, writer, reader) -> bool:
        await reader.read()  # until the router closes the connection
        return False

    backend = FakeBackend(silent)
    url = await backend.start()
    pool = UpstreamPool(connect_timeout_s=5.0, read_timeout_s=600.0)
    try:
        with pytest.raises(UpstreamTimeout):
            await fetch(pool, url, "/health", 0.2)
        await asyncio.wait_for(backend.closed.wait(), 10)  # the connection was closed, not pooled
        assert pool.num_idle(url) == 0
    finally:
        await pool.aclose()
        backend.close()
