"""`llmserve serve --tensor-parallel-size 2` on CPU: it answers the openai client, and a rank killed in
the middle of a stream ends the stream with an error and the server with a non-zero exit, within seconds.
The engine is held at step boundaries (a step gate), so the kill lands while the request is running."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai

from llmserve.testing.servers import StepGateClient, child_pids, start_tiny_server

from test_server_lifecycle import in_thread, read_stream


def _rank_pids(engine_pid: int) -> list[int]:
    """The engine's spawned ranks (its other children, such as a resource tracker, do not spawn_main)."""
    pids = []
    for pid in child_pids(engine_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                pids.append(pid)
    return pids


def test_serves_the_openai_client_and_a_killed_rank_ends_it(tmp_path):
    with StepGateClient() as gate:
        server = start_tiny_server(str(tmp_path), "--tensor-parallel-size", "2", env=gate.env)
        try:
            client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
            model = client.models.list().data[0].id
            done = client.completions.create(model=model, prompt="hello", max_tokens=6, temperature=0)
            assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 6
            ranks = _rank_pids(server.engine_pid())
            assert len(ranks) == 1, f"expected one rank process beside the engine, found {ranks}"
            events, seconds = asyncio.run(_kill_rank_mid_stream(server, gate, ranks[0]))
            assert "error" in events[-2] and events[-1] == "[DONE]"
            assert seconds < 10, f"the stream took {seconds:.1f} s to end after the kill"
            assert server.wait(timeout=30) != 0
        finally:
            server.stop(signal.SIGKILL)


async def _kill_rank_mid_stream(server, gate: StepGateClient, rank_pid: int) -> tuple[list, float]:
    """A stream that has run one step when rank 1 is killed; its events and the seconds until it ended."""
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        start = await in_thread(gate.hold)
        started = asyncio.Event()
        stream = asyncio.create_task(read_stream(http, {"prompt": "stream", "max_tokens": 400, "ignore_eos": True},
                                                 started))
        await in_thread(gate.wait_for, "added", start["added"] + 1)
        await asyncio.wait_for(started.wait(), 30)
        await in_thread(gate.run_steps, 1)
        killed = time.monotonic()
        os.kill(rank_pid, signal.SIGKILL)
        await in_thread(gate.release)
        events = await stream
        return events, time.monotonic() - killed
