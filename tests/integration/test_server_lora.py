"""Multi-LoRA over HTTP with the openai client: adapters picked by `model`, listed under their base, loaded
and unloaded at run time behind the API key; greedy tokens equal transformers + peft's."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import openai
import pytest

from llmserve.testing.servers import ServerProcess, metric_value, tiny_model

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))  # the unit tests' peft helpers
from lora_helpers import make_adapter, peft_greedy  # noqa: E402

KEY = "lora-test-key"
NUM_OUT = 6
# greedy as peft's reference: none of generation_config.json's defaults (its repetition penalty)
GREEDY = {"ignore_eos": True, "return_token_ids": True, "repetition_penalty": 1.0}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 43, 44], [100, 7, 100, 7, 3, 9, 12, 13]]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    base = tiny_model(str(root / "base"))
    adapters = [make_adapter(base, str(root / f"a{i}"), seed=30 + i, rank=[4, 8, 16][i]) for i in range(3)]
    too_wide = make_adapter(base, str(root / "wide"), seed=40, rank=32)
    return base, adapters, too_wide


@pytest.fixture(scope="module")
def server(paths):
    base, adapters, _ = paths
    server = ServerProcess(["--model", base, "--served-model-name", "base", "--dtype", "float32",
                            "--max-model-len", "512", "--num-kv-blocks", "256", "--api-key", KEY, "--enable-lora", "--lora-modules",
                            f"a0={adapters[0]}", f"a1={adapters[1]}", "--max-loras", "2", "--max-lora-rank", "16",
                            "--block-size", "4"]).start()
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)


def _tokens(client, model: str, prompt: list[int]) -> list[int]:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=NUM_OUT, temperature=0.0,
                                    extra_body=GREEDY)
    assert out.model == model
    return out.choices[0].token_ids


def test_models_lists_the_adapters_under_their_base(client, paths):
    models = client.models.list().data
    assert [(m.id, getattr(m, "parent", None)) for m in models] == [("base", None), ("a0", "base"), ("a1", "base")]
    assert client.models.retrieve("a1").root == paths[1][1]


def test_concurrent_requests_of_two_adapters_and_the_base_match_peft(server, paths):
    base, adapters, _ = paths
    aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)
    cases = [(model, i) for i in range(len(PROMPTS)) for model in ("a0", "a1", "base")]

    async def run():
        async def one(model, i):
            out = await aclient.completions.create(model=model, prompt=PROMPTS[i], max_tokens=NUM_OUT,
                                                   temperature=0.0, extra_body=GREEDY)
            return out.choices[0].token_ids
        return await asyncio.gather(*(one(model, i) for model, i in cases))

    got = asyncio.run(run())
    paths_of = {"a0": adapters[0], "a1": adapters[1], "base": None}
    assert got == [peft_greedy(base, paths_of[model], PROMPTS[i], NUM_OUT) for model, i in cases]


def test_load_and_unload_at_run_time(client, paths):
    base, adapters, _ = paths
    with pytest.raises(openai.NotFoundError):
        _tokens(client, "a2", PROMPTS[0])
    client.post("/load_lora_adapter", body={"lora_name": "a2", "lora_path": adapters[2]}, cast_to=httpx.Response)
    assert "a2" in [m.id for m in client.models.list().data]
    assert _tokens(client, "a2", PROMPTS[0]) == peft_greedy(base, adapters[2], PROMPTS[0], NUM_OUT)
    chat = client.chat.completions.create(model="a2", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.model == "a2"
    client.post("/unload_lora_adapter", body={"lora_name": "a2"}, cast_to=httpx.Response)
    with pytest.raises(openai.NotFoundError):
        _tokens(client, "a2", PROMPTS[0])
    with pytest.raises(openai.NotFoundError, match="cannot be found"):
        client.post("/unload_lora_adapter", body={"lora_name": "a2"}, cast_to=httpx.Response)


def test_a_bad_adapter_is_refused_with_its_problem(client, paths):
    with pytest.raises(openai.BadRequestError, match="over --max-lora-rank 16"):
        client.post("/load_lora_adapter", body={"lora_name": "wide", "lora_path": paths[2]}, cast_to=httpx.Response)
    with pytest.raises(openai.BadRequestError, match="already loaded"):
        client.post("/load_lora_adapter", body={"lora_name": "a0", "lora_path": paths[1][0]}, cast_to=httpx.Response)


def test_adapter_routes_need_the_api_key(server, paths):
    response = httpx.post(f"{server.base_url}/load_lora_adapter", json={"lora_name": "x", "lora_path": paths[1][2]})
    assert response.status_code == 401


def test_metrics_count_requests_per_adapter(server, client):
    _tokens(client, "a1", PROMPTS[1])
    text = httpx.get(f"{server.url}/metrics").text
    assert metric_value(text, 'llmserve:lora_request_success_total{finished_reason="length",lora_name="a1",'
                              'model_name="base"}') >= 1
    assert metric_value(text, "llmserve:lora_adapters") == 2  # a0 and a1 (a2 came and went)


def test_unloading_an_adapter_under_traffic_loses_no_request(client, paths):
    """A stream running with an adapter that is unloaded meanwhile finishes with it."""
    base, adapters, _ = paths
    client.post("/load_lora_adapter", body={"lora_name": "a2", "lora_path": adapters[2]}, cast_to=httpx.Response)
    stream = client.completions.create(model="a2", prompt=PROMPTS[2], max_tokens=40, temperature=0.0, stream=True,
                                       extra_body=GREEDY)
    chunks = [next(stream)]  # running
    client.post("/unload_lora_adapter", body={"lora_name": "a2"}, cast_to=httpx.Response)
    chunks += list(stream)
    token_ids = [t for c in chunks if c.choices for t in (c.choices[0].token_ids or [])]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert token_ids == peft_greedy(base, adapters[2], PROMPTS[2], 40)
