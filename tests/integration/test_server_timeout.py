"""--request-timeout: a request that runs longer is aborted (its KV blocks freed) and the client gets an
OpenAI-shaped error: HTTP 504 when not streamed, an error event then [DONE] when streamed. The engine is held at
a step boundary once the request has run a few steps, so that it outlasts the timeout whatever the machine's
speed."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from llmserve.testing.servers import StepGateClient, metric_value, start_tiny_server

ENDLESS = {"prompt": "never done", "max_tokens": 2000, "ignore_eos": True}
STEPS_BEFORE_HOLD = 3  # the prompt and two tokens: the request holds KV blocks, a stream has sent tokens


@pytest.fixture(scope="module")
def gate():
    with StepGateClient() as gate:
        yield gate


@pytest.fixture(scope="module")
def server(tmp_path_factory, gate):
    server = start_tiny_server(str(tmp_path_factory.mktemp("model")), "--request-timeout", "1",
                               "--max-model-len", "2048", "--num-kv-blocks", "512", env=gate.env)
    yield server
    server.stop()


def _past_the_timeout(gate, send):
    """`send()` in a thread while the engine runs STEPS_BEFORE_HOLD steps of it and is then held until the answer
    comes (the timeout's); the engine then steps freely until idle (the abort reported, the blocks freed)."""
    with ThreadPoolExecutor(1) as pool:
        with gate.held():
            added = gate.status()["added"]
            answer = pool.submit(send)
            gate.wait_for("added", added + 1)
            gate.run_steps(STEPS_BEFORE_HOLD)
            result = answer.result(timeout=60)
        gate.wait()
    return result


def check_all_blocks_free(server) -> None:
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert metric_value(metrics, "llmserve:num_requests_in_flight") == 0
    assert metric_value(metrics, "llmserve:kv_cache_free_blocks") == metric_value(metrics, "llmserve:kv_cache_blocks")


def test_a_non_streamed_request_past_the_timeout_gets_504(server, gate):
    response = _past_the_timeout(gate, lambda: httpx.post(f"{server.url}/v1/completions", json=ENDLESS, timeout=60))
    assert response.status_code == 504
    error = response.json()["error"]
    assert error["code"] == "request_timeout" and "timeout" in error["message"]
    check_all_blocks_free(server)


def test_a_stream_past_the_timeout_ends_with_an_error_event(server, gate):
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": 2000, "ignore_eos": True}

    def stream():
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]

    events = _past_the_timeout(gate, stream)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "request_timeout"
    assert any("choices" in json.loads(e) for e in events[:-2]), "the stream sent tokens before the timeout"
    check_all_blocks_free(server)


def test_a_short_request_is_untouched(server):
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "quick", "max_tokens": 4}, timeout=60)
    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")
