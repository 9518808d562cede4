"""The gRPC API (--grpc-port) with a client generated from llmserve.proto: the same engine, key and rules as
HTTP; the tokens equal the HTTP route's; errors map to gRPC status codes; a cancelled stream frees its request."""

from __future__ import annotations

import re

import grpc
import httpx
import pytest

from llmserve.server.grpc_service import llmserve_pb2 as pb
from llmserve.server.grpc_service import llmserve_pb2_grpc as pb_grpc
from llmserve.testing.servers import metric_value, start_tiny_server

KEY = "grpc-test-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
GREEDY = pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_tiny_server(str(tmp_path_factory.mktemp("grpc")), "--served-model-name", "tiny",
                               "--grpc-port", "0", "--api-key", KEY)
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def stub(server):
    port = int(re.search(r"llmserve: gRPC on 127\.0\.0\.1:(\d+)", server.log()).group(1))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield pb_grpc.GenerationStub(channel)


def test_model_info_and_health(stub):
    info = stub.ModelInfo(pb.ModelInfoRequest(), metadata=AUTH)
    assert info.model == "tiny" and info.max_model_len > 0 and info.vocab_size > 0 and list(info.eos_token_ids)
    assert stub.Health(pb.HealthRequest(), metadata=AUTH).is_healthy


def test_generate_gives_the_http_routes_tokens(server, stub):
    out = stub.Generate(pb.GenerateRequest(text="Hello there", sampling=GREEDY), metadata=AUTH)
    assert len(out.token_ids) == 8 and out.finish_reason == "length" and out.request_id.startswith("grpc-")
    assert (out.usage.completion_tokens, out.usage.prompt_tokens > 0) == (8, True)
    http = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"prompt": "Hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                            "return_token_ids": True}).json()
    assert list(out.token_ids) == http["choices"][0]["token_ids"] and out.text == http["choices"][0]["text"]
    by_ids = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=http["choices"][0]["prompt_token_ids"]),
                                              sampling=GREEDY), metadata=AUTH)
    assert by_ids.token_ids == out.token_ids


def test_a_stream_sends_the_tokens_as_they_come_then_the_finish(stub):
    whole = stub.Generate(pb.GenerateRequest(text="Once upon", sampling=GREEDY), metadata=AUTH)
    messages = list(stub.GenerateStream(pb.GenerateRequest(text="Once upon", sampling=GREEDY), metadata=AUTH))
    assert [t for m in messages for t in m.token_ids] == list(whole.token_ids)
    assert all(m.finish_reason == "" and not m.HasField("usage") for m in messages[:-1])
    assert messages[-1].finish_reason == "length" and messages[-1].usage.completion_tokens == 8


@pytest.mark.parametrize("request_, metadata, code, word", [
    (pb.GenerateRequest(text="x"), (), grpc.StatusCode.UNAUTHENTICATED, "API key"),
    (pb.GenerateRequest(text="x"), (("authorization", "Bearer wrong"),), grpc.StatusCode.UNAUTHENTICATED, "key"),
    (pb.GenerateRequest(sampling=GREEDY), AUTH, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (pb.GenerateRequest(text="x", model="nope"), AUTH, grpc.StatusCode.NOT_FOUND, "nope"),
    (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(max_tokens=10**6)), AUTH,
     grpc.StatusCode.INVALID_ARGUMENT, "tokens"),
    (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(top_p=0.0)), AUTH, grpc.StatusCode.INVALID_ARGUMENT,
     "top_p"),
])
def test_errors_map_to_status_codes(stub, request_, metadata, code, word):
    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(request_, metadata=metadata)
    assert caught.value.code() == code and word in caught.value.details()


def test_a_generation_model_refuses_embed(stub):
    with pytest.raises(grpc.RpcError) as caught:
        stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(text="x")]), metadata=AUTH)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--runner pooling" in caught.value.details()


def test_a_cancelled_stream_frees_its_request(server, stub):
    long = pb.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    call = stub.GenerateStream(pb.GenerateRequest(text="Tell me", sampling=long), metadata=AUTH)
    assert next(call).token_ids  # generating
    call.cancel()
    metrics = ""
    for _ in range(200):  # the engine hears of the abort at its next step
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        if metric_value(metrics, "llmserve:num_requests_in_flight") == 0:
            break
        stub.Health(pb.HealthRequest(), metadata=AUTH)  # a round trip between looks, no sleep
    assert metric_value(metrics, "llmserve:num_requests_in_flight") == 0
    assert metric_value(metrics, "llmserve:kv_cache_free_blocks") == metric_value(metrics, "llmserve:kv_cache_blocks")
