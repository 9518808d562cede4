"""Backpressure (queue full -> 503 + Retry-After), SIGTERM drain (exit 0, no orphan engine) and the engine
process dying (errors, 503, non-zero exit)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from llmserve.server.testing import is_alive, metric_value, start_tiny_server

LONG = {"max_tokens": 450, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(model_dir):
    """One running sequence at a time, three more may wait: four in flight at most."""
    server = start_tiny_server(model_dir, "--max-num-seqs", "1", "--max-queued-requests", "3",
                               "--shutdown-timeout", "1")
    yield server
    server.stop()


async def read_stream(http: httpx.AsyncClient, body: dict, started: asyncio.Event | None = None) -> list[dict]:
    """The stream's JSON events (the [DONE] marker as the string "[DONE]")."""
    events: list = []
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                if started is not None:
                    started.set()
    return events


def finish_reason(events: list) -> str | None:
    return next((e["choices"][0]["finish_reason"] for e in reversed(events)
                 if isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"]), None)


def test_queue_full_gets_503_while_admitted_complete(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            body = {"prompt": "queue", "max_tokens": 100, "ignore_eos": True}
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(10)))

    responses = asyncio.run(main())
    ok = [r for r in responses if r.status_code == 200]
    busy = [r for r in responses if r.status_code == 503]
    assert len(ok) + len(busy) == 10 and len(ok) >= 4 and busy
    assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in ok)
    for r in busy:
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "service_unavailable"
    after = httpx.post(f"{server.url}/v1/completions", json={"prompt": "again", "max_tokens": 2}, timeout=60)
    assert after.status_code == 200


def test_sigterm_drains_then_exits_zero(server):
    engine_pid = server.engine_pid()
    children = server.children()

    async def main():
        """`short` runs when the drain starts (it can finish in time); the long ones wait behind it."""
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            started = asyncio.Event()
            short = asyncio.create_task(read_stream(http, {"prompt": "short", "max_tokens": 100, "ignore_eos": True},
                                                    started))
            await asyncio.wait_for(started.wait(), 30)
            long = [asyncio.create_task(read_stream(http, {"prompt": f"long {i}", **LONG})) for i in range(3)]
            await _wait_in_flight(http, 4)
            server.send_signal(signal.SIGTERM)
            refused = await _refused_while_draining(http)
            return await short, await asyncio.gather(*long), refused

    short, long, refused = asyncio.run(main())
    assert refused
    assert finish_reason(short) == "length" and short[-1] == "[DONE]"
    reasons = [finish_reason(events) for events in long]
    assert all(events[-1] == "[DONE]" for events in long)
    assert set(reasons) <= {"length", "abort"} and "abort" in reasons, reasons
    assert server.wait(timeout=30) == 0
    assert not is_alive(engine_pid), "the engine process outlived the server"
    time.sleep(0.5)
    assert not [pid for pid in children if is_alive(pid)], "a child process outlived the server"


async def _wait_in_flight(http: httpx.AsyncClient, num: int) -> None:
    deadline = time.monotonic() + 10
    while metric_value((await http.get("/metrics")).text, "llmserve:num_requests_in_flight") < num:
        assert time.monotonic() < deadline, "requests did not reach the engine"
        await asyncio.sleep(0.01)


async def _wait_draining(http: httpx.AsyncClient) -> None:
    deadline = time.monotonic() + 10
    while (await http.get("/health")).status_code != 503:
        assert time.monotonic() < deadline, "the server did not start draining"
        await asyncio.sleep(0.01)


async def _refused_while_draining(http: httpx.AsyncClient) -> bool:
    """New requests get 503 during the drain (and /health too)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        response = await http.post("/v1/completions", json={"prompt": "late", "max_tokens": 1})
        if response.status_code == 503:
            return (await http.get("/health")).status_code == 503
        await asyncio.sleep(0.02)
    return False


def test_stalled_engine_unhealthy_then_death_fails_requests_and_exits_nonzero(model_dir):
    server = start_tiny_server(model_dir, "--health-stall-timeout", "1")
    try:
        engine_pid = server.engine_pid()
        asyncio.run(_check_stall_turns_health_503(server, engine_pid))

        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                started = asyncio.Event()
                stream = asyncio.create_task(read_stream(http, {"prompt": "doomed", **LONG}, started))
                plain = asyncio.create_task(http.post("/v1/completions", json={"prompt": "doomed too", **LONG}))
                await asyncio.wait_for(started.wait(), 30)
                os.kill(engine_pid, signal.SIGKILL)
                return await stream, await plain

        events, plain = asyncio.run(main())
        assert "error" in events[-2] and events[-1] == "[DONE]"
        assert plain.status_code == 503 and "engine" in plain.json()["error"]["message"]
        try:
            assert httpx.get(f"{server.url}/health", timeout=5).status_code == 503
        except httpx.TransportError:
            pass  # already gone
        assert server.wait(timeout=30) != 0
    finally:
        server.stop(signal.SIGKILL)


async def _check_stall_turns_health_503(server, engine_pid: int) -> None:
    """An engine that has work but sends nothing (SIGSTOP) is unhealthy; it recovers after SIGCONT."""
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        started = asyncio.Event()
        body = {"prompt": "stall", "max_tokens": 150, "ignore_eos": True}
        stream = asyncio.create_task(read_stream(http, body, started))
        await asyncio.wait_for(started.wait(), 30)
        os.kill(engine_pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(1.5)
            assert (await http.get("/health")).status_code == 503
        finally:
            os.kill(engine_pid, signal.SIGCONT)
        assert finish_reason(await stream) == "length"
        assert (await http.get("/health")).status_code == 200


def test_second_sigint_ends_open_requests_with_an_error_and_exits_without_a_traceback(model_dir):
    server = start_tiny_server(model_dir, "--max-model-len", "2048", "--num-kv-blocks", "512")
    try:
        engine_pid = server.engine_pid()
        endless = {"prompt": "endless", "max_tokens": 2000, "ignore_eos": True}

        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                started = asyncio.Event()
                stream = asyncio.create_task(read_stream(http, endless, started))
                plain = asyncio.create_task(http.post("/v1/completions", json=endless))
                await asyncio.wait_for(started.wait(), 30)
                await _wait_in_flight(http, 2)
                server.send_signal(signal.SIGINT)
                await _wait_draining(http)  # two signals sent at once could arrive as one
                server.send_signal(signal.SIGINT)
                return await stream, await plain

        events, plain = asyncio.run(main())
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "service_unavailable", events[-2:]
        assert plain.status_code == 503 and "shutting down" in plain.json()["error"]["message"]
        assert server.wait(timeout=30) == 0
        assert not is_alive(engine_pid), "the engine process outlived the server"
        log = server.log()
        assert "Traceback" not in log and "ERROR" not in log and "Error" not in log, log
    finally:
        server.stop(signal.SIGKILL)
