"""Fuzzing the demo model server (docs/reliability.md).

Schemathesis against /openapi.json: every route gets generated cases, valid and invalid for its schema;
none may answer 5xx, a JSON answer must match its documented schema, and /health must stay 200 after
each case. Then hypothesis strategies of requests we implement (every sampling field in range, streamed
or not): each must be valid for the documented schema and succeed. At the end every KV block is free
again with nothing in flight. Bounded for CI (about a minute): a 128-token context (larger max_tokens
are 400 at once), a few dozen cases per route, derandomized so that a failure reproduces.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator

import httpx
import jsonschema_rs
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from llmserve.testing.servers import ServerProcess, metric_value

EXAMPLES_PER_ROUTE = 30
VALID_EXAMPLES_PER_ROUTE = 60
DEMO_ARGS = ["--max-model-len", "128", "--num-kv-blocks", "256", "--max-num-seqs", "16"]
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(DEMO_ARGS) as server:  # no --model: the demo model, served as llmserve-demo
        yield server
        assert server.stop() == 0


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def tally(http: httpx.Client) -> Iterator[Counter]:
    """Cases run and their statuses; checked (and printed) once every route has been fuzzed."""
    counts: Counter = Counter()
    yield counts
    assert http.get("/health").status_code == 200
    metrics = http.get("/metrics").text
    assert metric_value(metrics, "llmserve:kv_cache_free_blocks") == metric_value(metrics, "llmserve:kv_cache_blocks")
    assert metric_value(metrics, "llmserve:num_requests_in_flight") == 0
    statuses = {k: v for k, v in counts.items() if k != "cases"}
    print(f"\nfuzz: {counts['cases']} cases, statuses {dict(sorted(statuses.items()))}")
    assert not any(status >= 500 for status in statuses)


@pytest.fixture(scope="module")
def api_schema(server: ServerProcess):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


POST_ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/generate",
               "/generate_stream", "/", "/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize",
               "/reset_prefix_cache", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"]
GET_ROUTES = ["/health", "/version", "/v1/models", "/v1/models/{model_id}", "/info", "/metrics",
              "/tokenizer_info", "/v1/responses/{response_id}", "/kv_transfer"]
OPERATIONS = [("POST", path) for path in POST_ROUTES] + [("GET", path) for path in GET_ROUTES]


def test_every_route_is_fuzzed(http: httpx.Client) -> None:
    paths = http.get("/openapi.json").json()["paths"]
    assert {(method.upper(), path) for path, item in paths.items() for method in item} == set(OPERATIONS)


def case_strategy(api_schema, method: str, path: str) -> st.SearchStrategy:
    """Valid cases for the route's schema and, where it has a body, invalid ones too."""
    operation = api_schema.find_operation_by_label(f"{method} {path}")
    assert operation is not None, f"{method} {path} is not in /openapi.json"
    strategies = [operation.as_strategy(GenerationMode.POSITIVE)]
    if method == "POST" and path != "/reset_prefix_cache":
        strategies.append(operation.as_strategy(GenerationMode.NEGATIVE))
    return st.one_of(strategies)


@pytest.mark.parametrize("method, path", OPERATIONS)
def test_route(api_schema, http: httpx.Client, tally: Counter, method: str, path: str) -> None:
    @given(case=case_strategy(api_schema, method, path))
    @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def fuzz(case) -> None:
        response = case.call(timeout=60)
        tally["cases"] += 1
        tally[response.status_code] += 1
        case.validate_response(response, checks=CHECKS)
        assert http.get("/health").status_code == 200, f"unhealthy after {method} {path}: {case.body!r}"

    fuzz()


# ---- valid requests: every one must succeed, and must be valid for the documented schema ---------------

VOCAB = 256  # token ids below this exist in any byte-level vocabulary, the demo model's too
short_text = st.text(min_size=1, max_size=10)


@st.composite
def sampling_fields(draw: st.DrawFn) -> dict:
    """Any combination of the sampling fields we implement, in range (prompt + output fit 128 tokens)."""
    max_tokens = draw(st.integers(1, 16))
    optional = {
        "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
        "min_p": st.floats(0, 1), "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.5, 2), "seed": st.integers(0, 2**32), "n": st.integers(1, 3),
        "stop": st.one_of(short_text, st.lists(short_text, max_size=3)), "ignore_eos": st.booleans(),
        "min_tokens": st.integers(0, max_tokens), "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
        "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=3),
        "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(), "user": short_text,
    }
    names = draw(st.sets(st.sampled_from(sorted(optional))))
    body = {"max_tokens": max_tokens, **{name: draw(optional[name]) for name in sorted(names)}}
    if draw(st.booleans()):
        body.update(stream=True, stream_options={"include_usage": draw(st.booleans())})
    return body


@st.composite
def completion_bodies(draw: st.DrawFn) -> dict:
    token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20)
    prompt = draw(st.one_of(short_text, st.lists(short_text, min_size=1, max_size=2), token_ids,
                            st.lists(token_ids, min_size=1, max_size=2)))
    extra = draw(st.fixed_dictionaries({}, optional={"logprobs": st.integers(0, 5), "echo": st.booleans()}))
    return {"model": "llmserve-demo", "prompt": prompt, **extra, **draw(sampling_fields())}


@st.composite
def chat_bodies(draw: st.DrawFn) -> dict:
    message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                                     "content": st.one_of(short_text, st.just([{"type": "text", "text": "hi"}]))})
    body = {"messages": draw(st.lists(message, min_size=1, max_size=2)), **draw(sampling_fields())}
    if draw(st.booleans()):
        body.update(logprobs=True, top_logprobs=draw(st.integers(0, 5)))
    return body


def schema_validator(openapi: dict, name: str) -> jsonschema_rs.Validator:
    return jsonschema_rs.validator_for({"$ref": f"#/components/schemas/{name}", "components": openapi["components"]})


def check_success(response: httpx.Response, body: dict) -> None:
    assert response.status_code == 200, f"{response.status_code} {response.text} for {body}"
    if not body.get("stream"):
        return
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events
    assert not any("error" in json.loads(event) for event in events[:-1]), events


VALID_REQUESTS = [("/v1/completions", "CompletionRequest", completion_bodies()),
                  ("/v1/chat/completions", "ChatCompletionRequest", chat_bodies())]


@pytest.mark.parametrize("path, schema_name, bodies", VALID_REQUESTS, ids=["completions", "chat"])
def test_valid_requests_succeed(http: httpx.Client, tally: Counter, path: str, schema_name: str,
                                bodies: st.SearchStrategy) -> None:
    validator = schema_validator(http.get("/openapi.json").json(), schema_name)

    @given(body=bodies)
    @settings(max_examples=VALID_EXAMPLES_PER_ROUTE, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def fuzz(body: dict) -> None:
        assert validator.is_valid(body), f"the documented schema refuses {body}"
        response = http.post(path, json=body)
        tally["cases"] += 1
        tally[response.status_code] += 1
        check_success(response, body)

    fuzz()
