"""`llmserve serve-ray --pd-disaggregation` on a real Ray Serve (the Ray Serve modules' local Ray in this process,
rayserve_app.py): one prefill replica and one decode replica behind the P/D ingress, each role autoscaled by its own
config. A request's prompt runs on the prefill replica, its KV blocks reach the decode replica (which loads them
rather than computing them: its metrics count them), and the greedy tokens, streamed or not, are a colocated
engine's; a prompt under --max-local-prefill-length skips the prefill replica."""

from __future__ import annotations

import json
import random

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from llmserve.engine.llm import LLM  # noqa: E402
from llmserve.rayserve.app import DECODE_DEPLOYMENT, PREFILL_DEPLOYMENT  # noqa: E402
from llmserve.rayserve.messages import REPLICA_HEADER  # noqa: E402
from llmserve.sampling_params import SamplingParams  # noqa: E402
from llmserve.testing.router_servers import sample_value, shared_tiny_model  # noqa: E402
from llmserve.testing.servers import wait_until  # noqa: E402

APP = "llmserve-pd"
LOCAL_PREFILL_LENGTH = 64  # the tests' id prompts are longer
ENGINE_FLAGS = ("--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "128")
FLAGS = (*ENGINE_FLAGS, "--served-model-name", "tiny", "--log-level", "warning", "--replica-num-cpus", "0.5",
         "--ingress-num-cpus", "0.5", "--pd-disaggregation", "--num-prefill-replicas", "1",
         "--decode-min-replicas", "1", "--decode-max-replicas", "2", "--decode-target-ongoing-requests", "32",
         "--max-local-prefill-length", str(LOCAL_PREFILL_LENGTH))
NUM_TOKENS = 10


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return shared_tiny_model(str(tmp_path_factory.getbasetemp()))


@pytest.fixture(scope="module")
def url(model, shared_ray):
    with shared_ray.app(model, FLAGS, APP) as url:
        yield url


def _prompt(seed: int, length: int = 150) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(length)]


@pytest.fixture(scope="module")
def colocated(model):
    """The greedy tokens of one engine doing prefill and decode, per prompt seed."""
    llm = LLM(model, dtype="float32", max_model_len=512, num_kv_blocks=128)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    return {seed: list(llm.generate(_prompt(seed), params)[0].outputs[0].token_ids) for seed in (1, 2)}


def _decode_metrics(url: str, replica: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", headers={REPLICA_HEADER: replica}, timeout=30).text
    return (sample_value(text, "llmserve:kv_offload_hit_tokens_total", tier="host"),
            sample_value(text, "llmserve:kv_transfer_received_blocks_total"))


def test_the_prompt_runs_on_the_prefill_replica_and_the_tokens_are_colocated_ones(url, colocated):
    deployments = serve.status().applications[APP].deployments
    assert {PREFILL_DEPLOYMENT, DECODE_DEPLOYMENT} <= set(deployments)
    body = {"model": "tiny", "prompt": _prompt(1), "max_tokens": NUM_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == colocated[1]
    decode = response.headers[REPLICA_HEADER]
    hits, received = _decode_metrics(url, decode)
    assert hits == 144 and received == 9  # the prompt's 9 full blocks came from the prefill replica, loaded
    # streamed: the decode replica's SSE passes through; its tokens are the colocated ones too
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "prompt": _prompt(2), "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    tokens = [t for line in lines[:-1] for choice in json.loads(line)["choices"] for t in choice.get("token_ids") or []]
    assert tokens == colocated[2]
    assert _decode_metrics(url, decode) == (288, 18)


def test_a_client_error_is_the_clients(url):
    response = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "temperature": -1},
                          timeout=60)
    assert response.status_code == 400 and "temperature" in response.text


def test_other_routes_reach_the_decode_replicas(url):
    wait_until(lambda: httpx.get(f"{url}/v1/models", timeout=10).status_code == 200, 60, "the models route")
    assert [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]] == ["tiny"]


def test_each_role_has_its_own_autoscaling(url):
    from ray.serve.context import _get_global_client

    deployments = _get_global_client().get_serve_details()["applications"][APP]["deployments"]
    prefill, decode = (deployments[name]["deployment_config"] for name in (PREFILL_DEPLOYMENT, DECODE_DEPLOYMENT))
    assert prefill["num_replicas"] == 1 and prefill.get("autoscaling_config") is None
    scaling = decode["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"], scaling["target_ongoing_requests"]) == (1, 2, 32)


def test_a_prompt_under_the_local_prefill_length_skips_the_prefill_replica(url):
    prompt = " ".join("abcdefghijklmnopqrst")  # counted by the decode replica's /tokenize, as the ingress does
    count = httpx.post(f"{url}/tokenize", json={"model": "tiny", "prompt": prompt}, timeout=60).json()["count"]
    assert 16 < count <= LOCAL_PREFILL_LENGTH  # a full KV block at least: a prefill replica would send it
    states = serve.status().applications[APP].deployments[DECODE_DEPLOYMENT].replica_states
    assert dict(states) == {"RUNNING": 1}  # at the minimum: no load made it scale
    decode = httpx.get(f"{url}/v1/models", timeout=10).headers[REPLICA_HEADER]
    before = _decode_metrics(url, decode)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200 and response.headers[REPLICA_HEADER] == decode
    assert response.json()["usage"]["completion_tokens"] == 3
    assert _decode_metrics(url, decode) == before  # no block came from a prefill replica
