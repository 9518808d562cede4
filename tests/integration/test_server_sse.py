"""The SSE wire format byte by byte, and the small endpoints (tokenize, version, metrics, health)."""

from __future__ import annotations

import json

import httpx
import pytest

from llmserve.testing.servers import metric_value, start_tiny_server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def sse_events(http: httpx.Client, path: str, body: dict) -> tuple[httpx.Response, bytes, list[bytes]]:
    with http.stream("POST", path, json=body) as response:
        raw = b"".join(response.iter_raw())
    assert raw.endswith(b"\n\n")
    events = raw[:-2].split(b"\n\n")
    return response, raw, events


def parse(events: list[bytes]) -> list[dict]:
    assert all(e.startswith(b"data: ") for e in events), events
    assert events[-1] == b"data: [DONE]"
    return [json.loads(e[len(b"data: "):]) for e in events[:-1]]


def test_chat_stream_bytes(http):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    response, raw, events = sse_events(http, "/v1/chat/completions", body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert raw.endswith(b"data: [DONE]\n\n")
    chunks = parse(events)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    first, *middle, last_choice, usage = chunks
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["choices"][0]["finish_reason"] is None for c in [first, *middle])
    assert all("role" not in c["choices"][0]["delta"] for c in [*middle, last_choice])
    assert last_choice["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks[:-1])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 5


def test_chat_stream_n2_roles_first(http):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "n": 2, "stream": True,
            "ignore_eos": True}
    chunks = parse(sse_events(http, "/v1/chat/completions", body)[2])
    assert [c["choices"][0]["delta"].get("role") for c in chunks[:2]] == ["assistant", "assistant"]
    assert sorted(c["choices"][0]["index"] for c in chunks[:2]) == [0, 1]
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]
    assert all(c["choices"] for c in chunks)  # no usage chunk without include_usage


def test_completion_stream_bytes(http):
    body = {"prompt": "abc", "max_tokens": 4, "stream": True, "ignore_eos": True}
    chunks = parse(sse_events(http, "/v1/completions", body)[2])
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_completion_stream_usage_last(http):
    body = {"prompt": "abc", "max_tokens": 3, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    chunks = parse(sse_events(http, "/v1/completions", body)[2])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_tgi_stream_bytes(http):
    response, raw, events = sse_events(http, "/generate_stream",
                                       {"inputs": "abc", "parameters": {"max_new_tokens": 3}})
    assert response.status_code == 200 and b"[DONE]" not in raw
    assert all(e.startswith(b"data:") for e in events)
    tokens = [json.loads(e[len(b"data:"):]) for e in events]
    assert [t["index"] for t in tokens] == list(range(len(tokens)))
    assert tokens[-1]["details"]["generated_tokens"] == len(tokens)
    assert all(t["generated_text"] is None for t in tokens[:-1])


def test_tokenize_detokenize(http):
    out = http.post("/tokenize", json={"prompt": "hello world"}).json()
    assert out["count"] == len(out["tokens"]) > 0 and out["max_model_len"] == 2048  # the shared server's (conftest.py)
    assert http.post("/detokenize", json={"tokens": out["tokens"]}).json()["prompt"] == "hello world"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > out["count"] - 2
    bad = http.post("/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400


def test_version_and_health(http):
    assert http.get("/version").json()["version"]
    assert http.get("/health").status_code == 200


def test_metrics(http):
    http.post("/v1/completions", json={"prompt": "metrics", "max_tokens": 4, "ignore_eos": True})
    text = http.get("/metrics").text
    for name in ("llmserve:num_requests_running", "llmserve:num_requests_waiting", "llmserve:kv_cache_usage_perc",
                 "llmserve:prefix_cache_queries_total", "llmserve:prefix_cache_hits_total",
                 "llmserve:num_preemptions_total", "llmserve:prompt_tokens_total",
                 "llmserve:generation_tokens_total", "llmserve:request_success_total",
                 "llmserve:time_to_first_token_seconds_bucket", "llmserve:inter_token_latency_seconds_bucket",
                 "llmserve:e2e_request_latency_seconds_bucket", "llmserve:request_queue_time_seconds_bucket",
                 "llmserve:request_prompt_tokens_bucket", "llmserve:request_generation_tokens_bucket",
                 "llmserve:iteration_tokens_total_bucket"):
        assert name in text, name
    assert metric_value(text, "llmserve:generation_tokens_total") >= 4
    assert metric_value(text, "llmserve:kv_cache_free_blocks") == metric_value(text, "llmserve:kv_cache_blocks")


def test_reset_prefix_cache(http):
    prompt = "cache me please " * 8
    http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert http.post("/reset_prefix_cache").json() == {"success": True}
    out = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_stream_interval_groups_tokens_into_fewer_events(tmp_path):
    server = start_tiny_server(str(tmp_path), "--stream-interval", "4")
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            body = {"prompt": "hello", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            whole = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
            _, _, events = sse_events(client, "/v1/completions", {**body, "stream": True,
                                                                  "stream_options": {"include_usage": True}})
    finally:
        assert server.stop() == 0
    *chunks, usage = parse(events)
    assert 1 <= len(chunks) <= 4  # tokens 1, 2-5, 6-9, 10 (merged into fewer if the client fell behind)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["usage"]["completion_tokens"] == 10
