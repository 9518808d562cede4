"""The router in front of a real tiny replica that serves its model under its own name (no
--served-model-name), as in `llmserve route --help`'s first example: the pool `tiny` works with the real
OpenAI client, streamed and not, and answers carry `tiny`; the replica's other routes (tokenizer, TGI's
generate API, /version, /info) pass through."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from llmserve.testing.router_servers import RouterProcess, shared_tiny_model
from llmserve.testing.servers import ServerProcess

REPLICA_ARGS = ("--max-model-len", "512", "--num-kv-blocks", "200", "--log-level", "warning")


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    model_dir = shared_tiny_model(str(tmp_path_factory.getbasetemp()))
    with ServerProcess(["--model", model_dir, *REPLICA_ARGS]) as server:
        yield server


@pytest.fixture(scope="module")
def served_name(replica) -> str:
    name = httpx.get(f"{replica.url}/v1/models", timeout=10).json()["data"][0]["id"]
    assert name != "tiny"
    return name


@pytest.fixture(scope="module")
def router(replica):
    with RouterProcess(["--backend", f"tiny={replica.url}", "--policy", "prefix-aware"]) as router:
        yield router


@pytest.fixture(scope="module")
def client(router):
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0)


def test_models_list_the_pool_with_the_replicas_card(client, replica, served_name):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    direct = httpx.get(f"{replica.url}/v1/models", timeout=10).json()["data"][0]
    assert models[0].model_extra["max_model_len"] == direct["max_model_len"] == 512
    assert client.models.retrieve("tiny").id == "tiny"


def test_pool_name_differs_from_served_name_not_streamed(client, served_name):
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=5, extra_body={"ignore_eos": True})
    assert out.model == "tiny" and out.usage.completion_tokens == 5
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          extra_body={"ignore_eos": True})
    assert chat.model == "tiny" and chat.choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=served_name, prompt="x", max_tokens=1)  # clients use the pool's name


def test_pool_name_differs_from_served_name_streamed(client):
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert {c.model for c in chunks} == {"tiny"}
    assert chunks[-1].usage.completion_tokens == 6
    text = client.completions.create(model="tiny", prompt="hello", max_tokens=5, stream=True,
                                     extra_body={"ignore_eos": True})
    pieces = list(text)
    assert {c.model for c in pieces} == {"tiny"} and pieces[-1].choices[0].finish_reason == "length"


def post(router, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{router.url}{path}", json=body, timeout=60)


def test_tokenizer_routes_pass_through(router, replica):
    for prefix in ("", "/v1"):
        tokens = post(router, f"{prefix}/tokenize", {"model": "tiny", "prompt": "hello world"})
        assert tokens.status_code == 200, tokens.text
        direct = httpx.post(f"{replica.url}/tokenize", json={"prompt": "hello world"}, timeout=60).json()
        assert tokens.json()["tokens"] == direct["tokens"] and tokens.headers["x-llmserve-backend"] == replica.url
        text = post(router, f"{prefix}/detokenize", {"model": "tiny", "tokens": direct["tokens"]})
        assert text.json()["prompt"] == httpx.post(f"{replica.url}/detokenize", json={"tokens": direct["tokens"]},
                                                   timeout=60).json()["prompt"]
    assert post(router, "/tokenize", {"prompt": "hi"}).status_code == 200  # no model: the only pool
    assert post(router, "/tokenize", {"model": "nope", "prompt": "hi"}).status_code == 404


def test_embeddings_pass_through(router):
    """To the replica, which answers as a generation server does (embeddings need --runner pooling)."""
    response = post(router, "/v1/embeddings", {"model": "tiny", "input": "hello"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"
    assert "--runner pooling" in response.json()["error"]["message"]


def test_tgi_generate_routes_pass_through(router):
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 4}}
    generated = post(router, "/generate", body)
    assert generated.status_code == 200 and isinstance(generated.json()["generated_text"], str)
    assert isinstance(post(router, "/", body).json()[0]["generated_text"], str)
    with httpx.stream("POST", f"{router.url}/generate_stream", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(e[5:]) for e in r.read().split(b"\n\n") if e.startswith(b"data:")]
    assert len(events) == 4 and all("token" in e for e in events)
    assert events[-1]["generated_text"] is not None and events[-1]["details"]["generated_tokens"] == 4


def test_get_routes_pass_through(router, replica):
    version = httpx.get(f"{router.url}/version", timeout=10)
    assert version.json() == httpx.get(f"{replica.url}/version", timeout=10).json()
    info = httpx.get(f"{router.url}/info", timeout=10)
    assert info.json()["model_id"] == "tiny" and info.json()["max_total_tokens"] == 512
    page = httpx.get(f"{router.url}/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert httpx.post(f"{router.url}/reset_prefix_cache", timeout=10).json() == {"success": True}
