"""The API's surface against a real server: /openapi.json and /docs, unknown fields refused by name (ignored
bookkeeping fields accepted), TGI's /info, the models routes, the /v1 tokenizer aliases with return_token_strs,
/tokenizer_info."""

from __future__ import annotations

import httpx
import openai
import pytest
from huggingface_hub import InferenceClient

from llmserve.server.protocol import IGNORED_FIELDS

NAME = "tiny"
MAX_MODEL_LEN = 2048  # the shared server's (conftest.py)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def openapi(http) -> dict:
    response = http.get("/openapi.json")
    assert response.status_code == 200
    return response.json()


def test_openapi_lists_every_route(openapi):
    assert openapi["openapi"].startswith("3.1")
    assert set(openapi["paths"]) == {"/", "/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions",
                                     "/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize", "/health",
                                     "/version", "/v1/models", "/v1/models/{model_id}", "/info", "/metrics",
                                     "/reset_prefix_cache", "/tokenizer_info", "/v1/responses",
                                     "/v1/responses/{response_id}", "/v1/embeddings", "/kv_transfer",
                                     "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}


def _request_schema(openapi: dict, path: str) -> dict:
    ref = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return openapi["components"]["schemas"][ref.rsplit("/", 1)[1]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_openapi_request_schema_is_what_the_server_accepts(openapi, path):
    schema = _request_schema(openapi, path)
    assert schema["additionalProperties"] is False  # unknown fields are refused
    assert set(IGNORED_FIELDS) <= set(schema["properties"])
    assert {"max_tokens", "temperature", "top_k", "min_p", "stop", "stream_options"} <= set(schema["properties"])
    assert {"response_format", "structured_outputs", "guided_json"} <= set(schema["properties"])
    assert ("prompt_logprobs" in schema["properties"]) == (path == "/v1/completions")  # vLLM's, completions only
    assert schema["properties"]["max_tokens"]["anyOf"] == [{"type": "integer", "minimum": 1}, {"type": "null"}]
    assert schema["properties"]["top_p"]["anyOf"][0] == {"type": "number", "exclusiveMinimum": 0.0, "maximum": 1.0}
    assert schema["properties"]["n"] == {"type": "integer", "minimum": 1, "maximum": 16, "default": 1}
    assert "prompt" in schema["required"] or "messages" in schema["required"]


def test_openapi_refs_resolve(openapi):
    text = str(openapi)
    names = set(openapi["components"]["schemas"])
    refs = {part.split("'")[0] for part in text.split("#/components/schemas/")[1:]}
    assert refs <= names


def test_docs_page(http):
    response = http.get("/docs")
    assert response.status_code == 200 and "/static/docs/docs.js" in response.text
    assert "/openapi.json" in http.get("/static/docs/docs.js").text


UNIMPLEMENTED = ["guided_json_object", "use_beam_search",
                 "length_penalty", "allowed_token_ids", "bad_words", "reasoning_effort", "logits_processors"]


@pytest.mark.parametrize("field", UNIMPLEMENTED)
def test_unimplemented_field_is_400_naming_it(client, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x", max_tokens=1, extra_body={field: 1})
    assert e.value.body["param"] == field and e.value.body["code"] == "unsupported_parameter"
    assert field in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                       extra_body={field: True})
    assert e.value.body["param"] == field


def test_best_of_other_than_n_and_chat_prompt_logprobs_are_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x", max_tokens=1, extra_body={"best_of": 2})
    assert "best_of" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                       extra_body={"prompt_logprobs": 1})
    assert e.value.body["param"] == "prompt_logprobs"


def test_ignored_fields_are_accepted(client):
    out = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                         user="u-1", metadata={"k": "v"}, store=False, service_tier="auto",
                                         parallel_tool_calls=False, extra_body={"prompt_cache_key": "c",
                                                                                "safety_identifier": "s"})
    assert out.choices[0].message.role == "assistant"
    out = client.completions.create(model=NAME, prompt="x", max_tokens=2, user="u-1")
    assert out.usage.completion_tokens >= 1


def test_tgi_info(server, http):
    info = http.get("/info").json()
    assert info["model_id"] == NAME and info["max_total_tokens"] == MAX_MODEL_LEN
    assert info["max_input_tokens"] == info["max_input_length"] == MAX_MODEL_LEN - 1
    assert info["max_best_of"] == 1 and info["version"] and info["router"] == "llmserve"
    assert InferenceClient(model=server.url, provider="hf-inference").get_endpoint_info() == info


@pytest.mark.parametrize("prefix", ["", "/v1"])
def test_tokenize_round_trip(http, prefix):
    out = http.post(f"{prefix}/tokenize", json={"prompt": "Hello there", "return_token_strs": True}).json()
    assert out["count"] == len(out["tokens"]) == len(out["token_strs"]) and out["max_model_len"] == MAX_MODEL_LEN
    assert all(isinstance(s, str) and s for s in out["token_strs"])
    plain = http.post(f"{prefix}/tokenize", json={"prompt": "Hello there"}).json()
    assert plain["tokens"] == out["tokens"] and plain["token_strs"] is None
    text = http.post(f"{prefix}/detokenize", json={"tokens": out["tokens"]}).json()["prompt"]
    assert text.endswith("Hello there")


def test_tokenize_aliases_agree(http):
    body = {"messages": [{"role": "user", "content": "hi"}], "return_token_strs": True}
    assert http.post("/tokenize", json=body).json() == http.post("/v1/tokenize", json=body).json()


@pytest.mark.parametrize("path, body, param", [("/v1/tokenize", {"prompt": "x", "chat_template": "y"}, "chat_template"),
                                               ("/v1/detokenize", {"tokens": [1], "extra": 1}, "extra")])
def test_tokenizer_unknown_fields_are_400(http, path, body, param):
    response = http.post(path, json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_detokenize_out_of_vocabulary_is_400(http):
    response = http.post("/v1/detokenize", json={"tokens": [1, 10**9]})
    assert response.status_code == 400 and "vocabulary" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "tokens"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**7}, "max_tokens"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "min_tokens": 10**6}, "min_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"999999": 1}},
     "logit_bias"),
    ("/generate", {"inputs": "x", "parameters": {"max_new_tokens": 10**7}}, "parameters.max_new_tokens"),
])
def test_the_engines_checks_name_the_field(http, path, body, param):
    """What the engine checks (context length, vocabulary, sampling ranges) names the request's field too."""
    response = http.post(path, json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_models_retrieve_names_the_served_model_and_404s_any_other(client):
    card = client.models.retrieve(NAME)
    assert card.id == NAME and card.object == "model" and card.model_extra["max_model_len"] == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-9")
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"


def test_tokenizer_info_gives_what_a_remote_tokenizer_reads(http):
    """lm-eval's remote tokenizer: the special tokens and the chat template, then /tokenize."""
    from transformers import AutoTokenizer

    info = http.get("/tokenizer_info").json()
    root = http.get("/v1/models").json()["data"][0]["root"]
    tokenizer = AutoTokenizer.from_pretrained(root)
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template
    assert info["vocab_size"] == len(tokenizer) and info["model_max_length"] == MAX_MODEL_LEN
    assert info["tokenizer_class"] == type(tokenizer).__name__
    eos = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert eos == [tokenizer.eos_token_id]

