"""Every class of bad input gets an OpenAI-shaped 4xx (never a 500, never a traceback), each followed by a
healthy request; auth (401) and body size (413); at the end every KV block is free again."""

from __future__ import annotations

import json

import httpx
import pytest

from llmserve.sampling_params import MAX_LOGPROBS, MAX_N, MAX_STOP_STRINGS
from llmserve.testing.servers import metric_value, start_tiny_server

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_tiny_server(str(tmp_path_factory.mktemp("model")), "--max-body-size", str(MAX_BODY),
                               env={"LLMSERVE_API_KEY": KEY})
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as client:
        yield client


def msgs(content="hi"):
    return [{"role": "user", "content": content}]


CMPL, CHAT, TGI = "/v1/completions", "/v1/chat/completions", "/generate"
LONG = "word " * 600

BAD_INPUTS = [
    # (id, path, raw body or JSON-able, expected status, text expected in the message)
    ("malformed-json", CMPL, b'{"prompt": "x", ', 400, "JSON"),
    ("not-json", CHAT, b"hello", 400, "JSON"),
    ("array-body", CMPL, b"[1, 2]", 400, "object"),
    ("string-body", CHAT, b'"hi"', 400, "object"),
    ("empty-body", CMPL, b"", 400, ""),
    ("max-tokens-string", CMPL, {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    ("temperature-string", CHAT, {"messages": msgs(), "temperature": "hot"}, 400, "temperature"),
    ("messages-string", CHAT, {"messages": "hi"}, 400, "messages"),
    ("nan", CMPL, b'{"prompt": "x", "temperature": NaN}', 400, ""),
    ("infinity", CMPL, b'{"prompt": "x", "top_p": Infinity}', 400, ""),
    ("huge-float", CMPL, b'{"prompt": "x", "temperature": 1e999}', 400, "temperature"),
    ("negative-temperature", CMPL, {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("top-p-over-1", CHAT, {"messages": msgs(), "top_p": 2}, 400, "top_p"),
    ("n-zero", CMPL, {"prompt": "x", "n": 0}, 400, "n"),
    ("max-tokens-zero", CMPL, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("presence-penalty", CHAT, {"messages": msgs(), "presence_penalty": 5}, 400, "presence_penalty"),
    ("seed-huge", CMPL, {"prompt": "x", "seed": 2**70}, 400, "seed"),
    # found by fuzzing: an int beyond 64 bits cannot cross to the engine (msgpack) and was a 500
    ("top-k-huge", CMPL, {"prompt": "x", "top_k": 2**70}, 400, "top_k"),
    ("priority-huge", CHAT, {"messages": msgs(), "priority": -(2**70)}, 400, "priority"),
    ("tgi-top-k-huge", TGI, {"inputs": "x", "parameters": {"top_k": 2**70}}, 400, "top_k"),
    ("empty-prompt", CMPL, {"prompt": ""}, 400, "empty"),
    ("empty-prompt-list", CMPL, {"prompt": []}, 400, "empty"),
    ("no-prompt", CMPL, {"max_tokens": 3}, 400, "prompt"),
    ("mixed-prompt", CMPL, {"prompt": ["a", 1]}, 400, "prompt"),
    ("empty-messages", CHAT, {"messages": []}, 400, "messages"),
    ("over-context", CMPL, {"prompt": "x", "max_tokens": 600}, 400, "512"),
    ("prompt-over-context", CMPL, {"prompt": LONG, "max_tokens": 1}, 400, "tokens"),
    ("out-of-vocab", CMPL, {"prompt": [1, 2, 10**6]}, 400, "vocabulary"),
    ("negative-token", CMPL, {"prompt": [-1]}, 400, "vocabulary"),
    ("too-many-stops", CMPL, {"prompt": "x", "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, 400, "stop"),
    ("n-over-cap", CMPL, {"prompt": "x", "n": MAX_N + 1}, 400, "n"),
    ("logprobs-over-cap", CMPL, {"prompt": "x", "logprobs": MAX_LOGPROBS + 1}, 400, "logprobs"),
    ("top-logprobs-over-cap", CHAT, {"messages": msgs(), "logprobs": True, "top_logprobs": MAX_LOGPROBS + 1},
     400, "top_logprobs"),
    ("top-logprobs-without-logprobs", CHAT, {"messages": msgs(), "top_logprobs": 2}, 400, "logprobs"),
    ("logit-bias-key", CMPL, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("logit-bias-oov", CMPL, {"prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("suffix", CMPL, {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("response-format", CHAT, {"messages": msgs(), "response_format": {"type": "xml"}}, 400, "response_format"),
    ("tools-type", CHAT, {"messages": msgs(), "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, 400,
     "tools[0].type"),
    ("image-part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "text"),
    ("tool-role-without-id", CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400, "tool_call_id"),
    ("stream-options-no-stream", CHAT, {"messages": msgs(), "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("unknown-model", CMPL, {"prompt": "x", "model": "gpt-9"}, 404, "gpt-9"),
    ("tgi-no-inputs", TGI, {"parameters": {}}, 400, "inputs"),
    ("tgi-grammar", TGI, {"inputs": "x", "parameters": {"grammar": {"type": "ebnf", "value": "x"}}}, 400, "grammar"),
    ("stream-over-context", CHAT, {"messages": msgs(LONG), "stream": True}, 400, "tokens"),
    ("unknown-route", "/v1/nothing", {}, 404, "no route POST /v1/nothing"),
]


def healthy(http: httpx.Client) -> None:
    out = http.post(CMPL, json={"prompt": "ok", "max_tokens": 2})
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["finish_reason"] in ("length", "stop")


def check_error(response: httpx.Response, status: int, text: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert text.lower() in error["message"].lower() + str(error["param"]).lower()
    assert "Traceback" not in error["message"] and 'File "' not in error["message"]
    return error


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input(http, case):
    _, path, body, status, text = case
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    error = check_error(response, status, text)
    assert error["type"] == "invalid_request_error"
    healthy(http)


def test_wrong_method(http):
    check_error(http.get(CMPL), 405, f"method not allowed: GET {CMPL}")
    healthy(http)


def test_missing_and_wrong_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}):
        response = httpx.post(f"{server.url}{CMPL}", json={"prompt": "x", "max_tokens": 1}, headers=headers)
        assert check_error(response, 401, "key")["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    assert httpx.get(f"{server.url}/openapi.json").status_code == 200  # a browser on /docs cannot send the key
    assert httpx.get(f"{server.url}/docs").status_code == 200
    assert httpx.get(f"{server.url}/info").status_code == 401


def test_body_too_large(http):
    big = json.dumps({"prompt": "x" * (MAX_BODY + 10), "max_tokens": 1}).encode()
    check_error(http.post(CMPL, content=big, headers={"Content-Type": "application/json"}), 413, "body")
    healthy(http)

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(8):
            yield b" " * (MAX_BODY // 4)

    check_error(http.post(CMPL, content=chunks(), headers={"Content-Type": "application/json"}), 413, "body")
    healthy(http)


def test_all_blocks_free_at_the_end(http):
    healthy(http)
    metrics = http.get("/metrics").text
    assert metric_value(metrics, "llmserve:kv_cache_free_blocks") == metric_value(metrics, "llmserve:kv_cache_blocks")
    assert metric_value(metrics, "llmserve:num_requests_in_flight") == 0
