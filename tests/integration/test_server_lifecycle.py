"""Backpressure (queue full -> 503 + Retry-After), SIGTERM drain (exit 0, no orphan engine) and the engine
process dying (errors, 503, non-zero exit). The engine is held at step boundaries (a step gate), so what
runs, what waits and what is aborted does not depend on the machine's speed."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest

from llmserve.testing.servers import StepGateClient, is_alive, start_tiny_server, wait_until

LONG = {"max_tokens": 450, "ignore_eos": True}
SHORT_TOKENS = 8  # one prefill step gives the first token, each later step one more (async scheduling: a
# step's tokens are reported by the next step)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(model_dir, gate):
    """One running sequence at a time, three more may wait: four in flight at most."""
    server = start_tiny_server(model_dir, "--max-num-seqs", "1", "--max-queued-requests", "3",
                               "--shutdown-timeout", "2", env=gate.env)
    yield server
    server.stop()


async def read_stream(http: httpx.AsyncClient, body: dict, started: asyncio.Event | None = None) -> list[dict]:
    """The stream's JSON events (the [DONE] marker as the string "[DONE]"); `started` is set once the
    response's head arrived (the stream is open, with or without tokens)."""
    events: list = []
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        if started is not None:
            started.set()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return events


def finish_reason(events: list) -> str | None:
    return next((e["choices"][0]["finish_reason"] for e in reversed(events)
                 if isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"]), None)


async def in_thread(fn, *args):
    """A blocking gate call from async code."""
    return await asyncio.to_thread(fn, *args)


async def wait_done(tasks: list[asyncio.Task], num: int) -> None:
    """Until `num` of the tasks finished."""
    while sum(t.done() for t in tasks) < num:
        await asyncio.wait([t for t in tasks if not t.done()], return_when=asyncio.FIRST_COMPLETED)


def test_queue_full_gets_503_while_admitted_complete(server, gate):
    """Held engine: exactly four requests are admitted (one running, three queued), six get 503."""
    body = {"prompt": "queue", "max_tokens": 20, "ignore_eos": True}

    async def main(start):
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            tasks = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(10)]
            await wait_done(tasks, 6)  # the refused ones
            await in_thread(gate.wait_for, "added", start["added"] + 4)
            assert (await in_thread(gate.status))["added"] == start["added"] + 4
            await in_thread(gate.release)
            return await asyncio.gather(*tasks)

    with gate.held() as start:
        responses = asyncio.run(main(start))
    ok = [r for r in responses if r.status_code == 200]
    busy = [r for r in responses if r.status_code == 503]
    assert len(ok) == 4 and len(busy) == 6
    assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in ok)
    for r in busy:
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "service_unavailable"
    after = httpx.post(f"{server.url}/v1/completions", json={"prompt": "again", "max_tokens": 2}, timeout=60)
    assert after.status_code == 200


def test_sigterm_drains_then_exits_zero(server, gate):
    engine_pid = server.engine_pid()
    children = server.children()

    async def main():
        """`short` runs when the drain starts and finishes in it; the long ones wait behind it (held) until
        the shutdown timeout aborts them."""
        start = await in_thread(gate.hold)
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            short = asyncio.create_task(read_stream(http, {"prompt": "short", "max_tokens": SHORT_TOKENS,
                                                           "ignore_eos": True}))
            await in_thread(gate.wait_for, "added", start["added"] + 1)
            long = [asyncio.create_task(read_stream(http, {"prompt": f"long {i}", **LONG})) for i in range(3)]
            await in_thread(gate.wait_for, "added", start["added"] + 4)
            await in_thread(gate.run_steps, SHORT_TOKENS - 1)  # short is one token from its end
            server.send_signal(signal.SIGTERM)
            refused = await _refused_while_draining(http)
            # Short's last token, within the drain: one step, or two where async scheduling (CUDA's
            # default) reports a step's tokens at the next one. A second step only starts a long one.
            await in_thread(gate.run_steps, 2)
            await in_thread(gate.wait_for, "aborted", start["aborted"] + 3)  # the shutdown timeout
            await in_thread(gate.release)  # the step that reports the aborts
            return await short, await asyncio.gather(*long), refused

    short, long, refused = asyncio.run(main())
    assert refused
    assert finish_reason(short) == "length" and short[-1] == "[DONE]"
    assert all(events[-1] == "[DONE]" for events in long)
    assert [finish_reason(events) for events in long] == ["abort"] * 3
    assert server.wait(timeout=30) == 0
    assert not is_alive(engine_pid), "the engine process outlived the server"
    wait_until(lambda: not [pid for pid in children if is_alive(pid)], 10, "the server's children to exit")


async def _wait_draining(http: httpx.AsyncClient, timeout: float = 30.0) -> None:
    """Until /health says the server drains (polled, with a deadline)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while (await http.get("/health")).status_code != 503:
        assert asyncio.get_running_loop().time() < deadline, "the server did not start draining"


async def _refused_while_draining(http: httpx.AsyncClient) -> bool:
    """New requests get 503 during the drain (and /health too)."""
    async def is_refused() -> bool:
        return (await http.post("/v1/completions", json={"prompt": "late", "max_tokens": 1})).status_code == 503

    for _ in range(1000):  # the signal is handled within a few requests
        if await is_refused():
            return (await http.get("/health")).status_code == 503
    return False


def test_stalled_engine_unhealthy_then_death_fails_requests_and_exits_nonzero(model_dir):
    with StepGateClient() as gate:
        server = start_tiny_server(model_dir, "--health-stall-timeout", "1", env=gate.env)
        try:
            engine_pid = server.engine_pid()
            asyncio.run(_check_stall_turns_health_503(server, gate))
            events, plain = asyncio.run(_kill_engine_mid_request(server, gate, engine_pid))
            assert "error" in events[-2] and events[-1] == "[DONE]"
            assert plain.status_code == 503 and "engine" in plain.json()["error"]["message"]
            try:
                assert httpx.get(f"{server.url}/health", timeout=5).status_code == 503
            except httpx.TransportError:
                pass  # already gone
            assert server.wait(timeout=30) != 0
        finally:
            server.stop(signal.SIGKILL)


async def _check_stall_turns_health_503(server, gate: StepGateClient) -> None:
    """An engine that has work but sends nothing (held) is unhealthy; it recovers once released."""
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        start = await in_thread(gate.hold)
        stream = asyncio.create_task(read_stream(http, {"prompt": "stall", "max_tokens": 150, "ignore_eos": True}))
        await in_thread(gate.wait_for, "added", start["added"] + 1)
        await in_thread(gate.run_steps, 1)
        assert (await http.get("/health")).status_code == 200  # making progress until the stall timeout
        await in_thread(wait_until, lambda: httpx.get(f"{server.url}/health").status_code == 503, 30,
                        "/health to turn 503")
        await in_thread(gate.release)
        assert finish_reason(await stream) == "length"
        assert (await http.get("/health")).status_code == 200


async def _kill_engine_mid_request(server, gate: StepGateClient, engine_pid: int):
    """A stream (open) and a plain request in flight, both held before any step, when the engine dies."""
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        stream, plain = await _two_held_requests(http, gate, LONG)
        os.kill(engine_pid, signal.SIGKILL)
        return await stream, await plain


async def _two_held_requests(http: httpx.AsyncClient, gate: StepGateClient, body: dict):
    """A stream (open: its head arrived) and a plain request, both in the held engine."""
    start = await in_thread(gate.hold)
    started = asyncio.Event()
    stream = asyncio.create_task(read_stream(http, {"prompt": "stream", **body}, started))
    plain = asyncio.create_task(http.post("/v1/completions", json={"prompt": "plain", **body}))
    await in_thread(gate.wait_for, "added", start["added"] + 2)
    await asyncio.wait_for(started.wait(), 30)
    return stream, plain


def test_second_sigint_ends_open_requests_with_an_error_and_exits_without_a_traceback(model_dir):
    with StepGateClient() as gate:
        server = start_tiny_server(model_dir, "--max-model-len", "2048", "--num-kv-blocks", "512", env=gate.env)
        try:
            engine_pid = server.engine_pid()
            events, plain = asyncio.run(_sigint_twice(server, gate))
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "service_unavailable", events[-2:]
            assert plain.status_code == 503 and "shutting down" in plain.json()["error"]["message"]
            assert server.wait(timeout=30) == 0
            assert not is_alive(engine_pid), "the engine process outlived the server"
            log = server.log()
            assert "Traceback" not in log and "ERROR" not in log and "Error" not in log, log
        finally:
            server.stop(signal.SIGKILL)


async def _sigint_twice(server, gate: StepGateClient):
    """Two requests held in the engine (they cannot finish), SIGINT, the drain under way, SIGINT."""
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        stream, plain = await _two_held_requests(http, gate, {"max_tokens": 2000, "ignore_eos": True})
        server.send_signal(signal.SIGINT)
        await _wait_draining(http)  # two signals sent at once could arrive as one
        server.send_signal(signal.SIGINT)
        return await stream, await plain
