"""POST /v1/embeddings on a real `llmserve serve` of a random-weight Qwen3 embedding model (a bare decoder saved
by transformers, Matryoshka in its config; served as pooling by --runner auto, the default), called by the
official `openai` client:
vectors equal transformers' last hidden states pooled as the checkpoint asks (last token, normalised), as
floats and base64, truncated by `dimensions`, and by the gRPC Embed call; bad inputs are 400s in OpenAI's shape naming the field; the
pooling server refuses generation and a generation server refuses embeddings."""

from __future__ import annotations

import base64
import re

import grpc
import httpx
import numpy as np
import openai
import pytest
import torch

from embedding_cases import embedding_checkpoint, hf_embedding, load_hf
from llmserve.model.loader import load_tokenizer
from llmserve.server.grpc_service import llmserve_pb2 as pb
from llmserve.server.grpc_service import llmserve_pb2_grpc as pb_grpc
from llmserve.testing.servers import SMALL_ENGINE_ARGS, ServerProcess

NAME = "tiny-embed"
MAX_MODEL_LEN = 64
ATOL = 1e-4
TEXTS = ["hello world", "embeddings of a prompt longer than one step's token budget, in several chunks"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return embedding_checkpoint("qwen3", str(tmp_path_factory.mktemp("embed")), is_matryoshka=True)


@pytest.fixture(scope="module")
def pooling_server(model_path):
    args = ["--model", model_path, *SMALL_ENGINE_ARGS, "--served-model-name", NAME,  # --runner auto: pooling
            "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", "16",
            "--grpc-port", "0"]
    with ServerProcess(args) as server:
        yield server


@pytest.fixture(scope="module")
def client(pooling_server):
    return openai.OpenAI(base_url=pooling_server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(pooling_server):
    with httpx.Client(base_url=pooling_server.url, timeout=60) as http:
        yield http


@pytest.fixture(scope="module")
def expected(model_path) -> list[torch.Tensor]:
    """transformers' vectors of TEXTS: the last token's hidden state, normalised."""
    hf, tokenizer = load_hf(model_path), load_tokenizer(model_path)
    return [hf_embedding(hf, tokenizer.encode(text), "LAST", True) for text in TEXTS]


def test_openai_client_embeddings_equal_transformers(client, model_path, expected):
    out = client.embeddings.create(model=NAME, input=TEXTS)  # the client asks for base64 and decodes it
    assert out.object == "list" and out.model == NAME and [d.index for d in out.data] == [0, 1]
    for data, vector in zip(out.data, expected):
        torch.testing.assert_close(torch.tensor(data.embedding), vector, atol=ATOL, rtol=0)
    tokenizer = load_tokenizer(model_path)
    num_tokens = sum(len(tokenizer.encode(t)) for t in TEXTS)
    assert num_tokens > 16, "one prompt must outgrow a step's token budget"
    assert out.usage.prompt_tokens == out.usage.total_tokens == num_tokens


def test_float_and_base64_carry_the_same_float32_values(http, expected):
    floats = http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "float"}).json()
    encoded = http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(np.array(floats["data"][0]["embedding"], dtype="<f4"), decoded)
    assert floats["data"][0]["object"] == "embedding" and floats["usage"]["prompt_tokens"] > 0


def test_dimensions_truncate_and_normalize_again(client, expected):
    out = client.embeddings.create(model=NAME, input=TEXTS[1], dimensions=16)
    vector = torch.tensor(out.data[0].embedding)
    prefix = expected[1][:16]
    torch.testing.assert_close(vector, prefix / prefix.norm(), atol=ATOL, rtol=0)


def test_token_id_inputs(client, model_path, expected):
    ids = load_tokenizer(model_path).encode(TEXTS[0])
    one = client.embeddings.create(model=NAME, input=ids)
    many = client.embeddings.create(model=NAME, input=[ids, ids[:3]])
    torch.testing.assert_close(torch.tensor(one.data[0].embedding), expected[0], atol=ATOL, rtol=0)
    assert one.usage.prompt_tokens == len(ids) and many.usage.prompt_tokens == len(ids) + 3
    assert len(many.data) == 2 and many.data[0].embedding == one.data[0].embedding


BAD = [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": [10**6]}, "input"),
    ({"input": [5] * (MAX_MODEL_LEN + 1)}, "input"),
    ({"input": "x", "dimensions": 65}, "dimensions"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    ({}, "input"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p + str(i) for i, (_, p) in enumerate(BAD)])
def test_bad_inputs_are_400s_naming_the_field(http, body, param):
    response = http.post("/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param or param in error["message"], error


def test_a_pooling_server_refuses_generation(client):
    with pytest.raises(openai.BadRequestError, match="--runner pooling") as info:
        client.completions.create(model=NAME, prompt="hi", max_tokens=2)
    assert info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="another-model", input="x")


def test_a_generation_server_refuses_embeddings(server):
    response = httpx.post(f"{server.url}/v1/embeddings", json={"input": "x"}, timeout=60)  # the shared tiny server
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "model" and "--runner pooling" in error["message"]


@pytest.fixture(scope="module")
def stub(pooling_server):
    port = int(re.search(r"llmserve: gRPC on 127\.0\.0\.1:(\d+)", pooling_server.log()).group(1))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield pb_grpc.GenerationStub(channel)


def test_grpc_embed_gives_the_http_routes_vectors(stub, http, model_path):
    ids = load_tokenizer(model_path).encode(TEXTS[0])
    request = pb.EmbedRequest(inputs=[pb.EmbedInput(text=TEXTS[1]), pb.EmbedInput(token_ids=pb.TokenIds(ids=ids))],
                              dimensions=16)
    out = stub.Embed(request)
    body = http.post("/v1/embeddings", json={"input": [TEXTS[1], TEXTS[0]], "dimensions": 16}).json()
    assert [list(e.values) for e in out.embeddings] == [d["embedding"] for d in body["data"]]
    assert out.prompt_tokens == body["usage"]["prompt_tokens"] and out.request_id.startswith("grpc-embd-")


@pytest.mark.parametrize("request_, word", [
    (pb.EmbedRequest(), "input"),
    (pb.EmbedRequest(inputs=[pb.EmbedInput()]), "text or token_ids"),
    (pb.EmbedRequest(inputs=[pb.EmbedInput(text="x")], dimensions=0), "dimensions"),
])
def test_grpc_embed_errors_are_invalid_argument(stub, request_, word):
    with pytest.raises(grpc.RpcError) as caught:
        stub.Embed(request_)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and word in caught.value.details()
