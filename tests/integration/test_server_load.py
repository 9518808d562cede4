"""Many streams at once with half of them cancelled (queued or decoding), and non-streaming disconnects
(the engine held at a step boundary, so they cannot finish first on any machine): the rest complete and
every KV block comes back."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from llmserve.testing.servers import metric_value, start_tiny_server, wait_until

NUM_STREAMS = 200
MAX_TOKENS = 32
CANCELLED_MAX_TOKENS = 400


@pytest.fixture(scope="module")
def server(tmp_path_factory, gate):
    server = start_tiny_server(str(tmp_path_factory.mktemp("model")), "--max-num-seqs", "64",
                               "--num-kv-blocks", "1024", env=gate.env)
    yield server
    assert server.stop() == 0


def metrics(server) -> str:
    return httpx.get(f"{server.url}/metrics", timeout=30).text


def at_baseline(server) -> str | None:
    """The metrics text when every KV block is free and nothing is in flight, else None."""
    text = metrics(server)
    is_free = metric_value(text, "llmserve:kv_cache_free_blocks") == metric_value(text, "llmserve:kv_cache_blocks")
    return text if is_free and metric_value(text, "llmserve:num_requests_in_flight") == 0 else None


def wait_for_baseline(server, timeout: float = 30.0) -> str:
    return wait_until(lambda: at_baseline(server), timeout, "KV blocks back to baseline")


def num_logged(server, text: str) -> int:
    return server.log().count(text)


def aborted(text: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("llmserve:request_success_total{") and 'finished_reason="abort"' in line)


async def one_stream(http: httpx.AsyncClient, i: int) -> tuple[str, int]:
    """Even i: read to the end. i % 4 == 1: leave after the role chunk (most are queued then).
    i % 4 == 3: leave after 3 content chunks (decoding)."""
    # Streams that leave ask for many more tokens, so none can finish before its abort reaches the engine.
    max_tokens = MAX_TOKENS if i % 2 == 0 else CANCELLED_MAX_TOKENS
    body = {"messages": [{"role": "user", "content": f"stream {i}"}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}
    num_content, finish = 0, None
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            num_content += bool(choice["delta"].get("content"))
            finish = choice["finish_reason"] or finish
            if (i % 4 == 1) or (i % 4 == 3 and num_content >= 3):
                return "cancelled", num_content
    return finish, num_content


def test_half_of_200_streams_cancelled(server):
    before = aborted(wait_for_baseline(server))

    async def main():
        limits = httpx.Limits(max_connections=NUM_STREAMS + 10, max_keepalive_connections=NUM_STREAMS + 10)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
            return await asyncio.gather(*(one_stream(http, i) for i in range(NUM_STREAMS)))

    results = asyncio.run(main())
    completed = [r for i, r in enumerate(results) if i % 2 == 0]
    assert all(finish == "length" for finish, _ in completed), completed
    assert sum(finish == "cancelled" for finish, _ in results) == NUM_STREAMS // 2
    after = wait_for_baseline(server)
    assert aborted(after) - before == NUM_STREAMS // 2
    wait_until(lambda: num_logged(server, "cut short after") == NUM_STREAMS // 2, 10, "a log line per cut stream")
    assert num_logged(server, ": the client disconnected") == NUM_STREAMS // 2


def test_non_streaming_disconnect_aborts(server, gate):
    """Three clients leave while the engine is held: each request is aborted, not finished."""
    before = aborted(wait_for_baseline(server))
    body = {"prompt": "long", "max_tokens": 450, "ignore_eos": True}

    async def main(start):
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            posts = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(3)]
            await asyncio.to_thread(gate.wait_for, "added", start["added"] + 3)
            for post in posts:
                post.cancel()  # the client goes away: httpx closes the connection
            return await asyncio.gather(*posts, return_exceptions=True)

    with gate.held() as start:
        assert all(isinstance(r, asyncio.CancelledError) for r in asyncio.run(main(start)))
        gate.wait_for("aborted", start["aborted"] + 3)
        assert gate.status()["steps"] == start["steps"]  # nothing ran: the aborts beat every token
    after = wait_for_baseline(server)
    assert aborted(after) - before == 3
    assert num_logged(server, "cut short: the client disconnected before the response") == 3
    out = httpx.post(f"{server.url}/v1/completions", json={"prompt": "ok", "max_tokens": 2}, timeout=30)
    assert out.status_code == 200


def test_metrics_while_held_come_from_the_last_step(server, gate):
    """/metrics asks nothing of the engine: scraped while the engine is held, it answers with the state
    of the last step reported (two requests running, their blocks taken); once released, the step
    reporting their aborts brings it back to the baseline."""
    wait_for_baseline(server)
    body = {"prompt": "metrics", "max_tokens": 50, "ignore_eos": True}

    async def main(start):
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            posts = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(2)]
            await asyncio.to_thread(gate.wait_for, "added", start["added"] + 2)
            await asyncio.to_thread(gate.run_steps, 2)  # two: async scheduling reports a step at the next
            text = await asyncio.to_thread(metrics, server)
            for post in posts:
                post.cancel()
            await asyncio.gather(*posts, return_exceptions=True)
            return text

    with gate.held() as start:
        text = asyncio.run(main(start))
        assert metric_value(text, "llmserve:num_requests_running") == 2
        assert metric_value(text, "llmserve:kv_cache_usage_perc") > 0
        assert metric_value(text, "llmserve:kv_cache_free_blocks") < metric_value(text, "llmserve:kv_cache_blocks")
        gate.wait_for("aborted", start["aborted"] + 2)
        assert at_baseline(server) is None  # no step since: the gauges still show the last one
    wait_for_baseline(server)  # released: the step that reports the aborts shows their blocks freed
    assert metric_value(metrics(server), "llmserve:num_requests_running") == 0
