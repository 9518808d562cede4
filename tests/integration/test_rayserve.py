"""llmserve on a real Ray Serve (the Ray Serve modules' local Ray in this process, rayserve_app.py): two tiny
CPU replicas behind the ingress answer the OpenAI client and TGI; the prefix-aware request router keeps a
prefix on one replica (prefix-cache hit rate against a round-robin baseline, read from each replica's
metrics); a replica killed under load is replaced by Ray without losing a request that had not started
answering; autoscaling adds a replica under queued load (held in the engines at a step boundary, so that
the new replica starts on idle CPUs) and removes it when idle. No sleeps: every wait polls a condition (Ray's
serve.status() included) with a deadline."""

from __future__ import annotations

import contextlib
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from llmserve.rayserve.app import REPLICA_DEPLOYMENT  # noqa: E402
from llmserve.rayserve.messages import REPLICA_HEADER  # noqa: E402
from llmserve.testing.router_servers import sample_value, shared_tiny_model  # noqa: E402
from llmserve.testing.servers import StepGateClient, wait_until  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))  # the unit tests' peft helpers
from lora_helpers import make_adapter  # noqa: E402

APP = "llmserve"
MIN_REPLICAS, MAX_REPLICAS, TARGET_ONGOING = 2, 3, 4
# Autoscaling between 2 and 3 replicas, 4 requests per replica targeted, short delays: the tests before the
# autoscaling one keep fewer than 2 x 4 requests open, so that they run on exactly two replicas.
FLAGS = ("--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "200", "--served-model-name", "tiny",
         "--log-level", "warning", "--replica-num-cpus", "0.5", "--ingress-num-cpus", "0.5",
         "--min-replicas", str(MIN_REPLICAS), "--max-replicas", str(MAX_REPLICAS),
         "--target-ongoing-requests", str(TARGET_ONGOING), "--upscale-delay-s", "1", "--downscale-delay-s", "3",
         "--look-back-period-s", "11", "--prefix-chars", "200", "--enable-lora", "--max-lora-rank", "8")


@pytest.fixture(scope="module")
def url(shared_ray, tmp_path_factory):
    # Every replica's engine has a step gate (free-running until a test holds it), and Ray's autoscaling
    # metrics come every second (rayserve_app.py).
    model = shared_tiny_model(str(tmp_path_factory.getbasetemp()))
    with shared_ray.app(model, FLAGS, APP) as url:
        yield url


def replica_ids() -> set[str]:
    """The engine replicas' ids, from their (named) Ray actors."""
    prefix = f"SERVE_REPLICA::{APP}#{REPLICA_DEPLOYMENT}#"
    return {a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)}


def num_running() -> int:
    deployment = serve.status().applications[APP].deployments[REPLICA_DEPLOYMENT]
    return sum(n for state, n in deployment.replica_states.items() if state == "RUNNING")


def settled(n: int):
    """The condition: n replicas running, nothing starting or stopping, the same n actors alive."""
    def check() -> set[str] | None:
        app = serve.status().applications[APP]
        states = app.deployments[REPLICA_DEPLOYMENT].replica_states
        ids = replica_ids()
        return ids if app.status == "RUNNING" and dict(states) == {"RUNNING": n} and len(ids) == n else None
    return check


def pinned(url: str, replica: str, method: str, path: str, **kwargs) -> httpx.Response:
    r = httpx.request(method, f"{url}{path}", headers={REPLICA_HEADER: replica}, timeout=60, **kwargs)
    assert r.headers[REPLICA_HEADER] == replica
    return r


def prefix_counters(url: str, replica: str) -> tuple[float, float]:
    text = pinned(url, replica, "GET", "/metrics").text
    return (sample_value(text, "llmserve:prefix_cache_hits_total"),
            sample_value(text, "llmserve:prefix_cache_queries_total"))


def test_openai_client_and_tgi_through_ray_serve(url):
    wait_until(settled(MIN_REPLICAS), 60, "two running replicas")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=5, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, stream=True, temperature=0, logprobs=True,
                                                 extra_body={"ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason == "length"
    # Streamed, not one lump. Counted by the tokens each chunk carries: a random model's byte-level tokens
    # may leave a chunk without text (an unfinished UTF-8 sequence), and which do depends on the CPU's kernels.
    token_counts = [len(c.choices[0].logprobs.content) for c in chunks if c.choices[0].logprobs]
    assert sum(token_counts) == 6 and sum(n > 0 for n in token_counts) >= 2
    stream = client.completions.create(model="tiny", prompt="hello", max_tokens=7, stream=True,
                                       extra_body={"ignore_eos": True})
    assert [c.choices[0].finish_reason for c in stream][-1] == "length"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=1)
    tgi = httpx.post(f"{url}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 4}}, timeout=60)
    assert tgi.status_code == 200 and isinstance(tgi.json()["generated_text"], str)
    assert tgi.headers[REPLICA_HEADER] in replica_ids()
    with httpx.stream("POST", f"{url}/generate_stream", timeout=60,
                      json={"inputs": "hi", "parameters": {"max_new_tokens": 4}}) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert len(events) == 4 and events[-1]["details"]["generated_tokens"] == 4


def test_an_adapter_loaded_on_one_replica_gets_its_requests(url, tmp_path_factory):
    """Loaded at run time on one replica (pinned), a LoRA adapter's requests all go there once Ray's routing
    stats tell the request router (every ROUTING_STATS_PERIOD_S); the other replica would answer 404."""
    wait_until(settled(MIN_REPLICAS), 60, "two running replicas")
    holder = sorted(replica_ids())[0]
    model = shared_tiny_model(str(tmp_path_factory.getbasetemp()))
    adapter = make_adapter(model, str(tmp_path_factory.mktemp("ray-lora") / "sql"), seed=3, rank=4)
    body = {"lora_name": "sql", "lora_path": adapter}
    assert pinned(url, holder, "POST", "/v1/load_lora_adapter", json=body).status_code == 200
    request = {"model": "sql", "prompt": "hello", "max_tokens": 2}

    def answered_by_holder_in_a_row() -> bool:  # 8 in a row: by chance 1 in 256 with two replicas
        answers = [httpx.post(f"{url}/v1/completions", json=request, timeout=60) for _ in range(8)]
        return all(r.status_code == 200 and r.headers[REPLICA_HEADER] == holder for r in answers)

    wait_until(answered_by_holder_in_a_row, 30, "the adapter's requests on the replica holding it")
    answer = httpx.post(f"{url}/v1/completions", json=request, timeout=60).json()
    assert answer["model"] == "sql" and answer["usage"]["completion_tokens"] == 2
    assert pinned(url, holder, "POST", "/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200


def test_a_client_leaving_a_stream_aborts_it_in_the_replica(url, shared_ray):
    replica = sorted(wait_until(settled(MIN_REPLICAS), 60, "two running replicas"))[0]
    addrs = wait_until(lambda: len(live := shared_ray.gates.live()) == MIN_REPLICAS and live, 60,
                       "one live engine gate per replica")

    def num_aborted() -> float:
        return sample_value(pinned(url, replica, "GET", "/metrics").text, "llmserve:request_success_total",
                            finished_reason="abort")

    def leave_after_a_chunk() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={REPLICA_HEADER: replica},
                          timeout=60) as r:
            assert next(r.iter_raw())  # under way; then the client goes

    before = num_aborted()
    body = {"model": "tiny", "prompt": "leave me", "max_tokens": 480, "stream": True, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool, contextlib.ExitStack() as stack:  # the gates released first
        engines = [stack.enter_context(StepGateClient(60, addr)) for addr in addrs]
        for gate in engines:  # held between steps: the request cannot finish before the client leaves
            stack.enter_context(gate.held())
        added = [gate.status()["added"] for gate in engines]
        left = pool.submit(leave_after_a_chunk)
        wait_until(lambda: sum(g.status()["added"] - a for g, a in zip(engines, added)) == 1, 60, "the request")
        for gate in engines:
            gate.run_steps(2)  # the prompt and a token: a chunk reaches the client
        left.result(timeout=60)
    wait_until(lambda: num_aborted() == before + 1, 30, "the replica to abort the request", poll_s=0.2)


SYSTEMS = [f"System prompt number {i}: you are assistant {i}, answer briefly and kindly. " * 4 for i in range(8)]


def run_rounds(url: str, pin) -> tuple[dict[int, set[str]], float]:
    """Three rounds over the 8 shared prefixes (a round's 8 requests 4 at a time; each prefix's request
    waits for the one before it), pinned to `pin(prefix, round)` (None: the request router decides).
    Returns the replicas that served each prefix and the prefix-cache hit rate of the three rounds."""
    ids = sorted(replica_ids())
    for replica in ids:
        assert pinned(url, replica, "POST", "/reset_prefix_cache").json() == {"success": True}
    before = {r: prefix_counters(url, r) for r in ids}
    served: dict[int, set[str]] = {i: set() for i in range(len(SYSTEMS))}

    def send(i: int, round_: int) -> None:
        replica = pin(i, round_)
        r = httpx.post(f"{url}/v1/completions", timeout=60, headers={REPLICA_HEADER: replica} if replica else {},
                       json={"model": "tiny", "prompt": f"{SYSTEMS[i]} question {round_}?", "max_tokens": 2})
        assert r.status_code == 200
        served[i].add(r.headers[REPLICA_HEADER])

    with ThreadPoolExecutor(4) as pool:
        for round_ in range(3):
            list(pool.map(send, range(len(SYSTEMS)), [round_] * len(SYSTEMS)))
    after = {r: prefix_counters(url, r) for r in ids}
    hits = sum(after[r][0] - before[r][0] for r in ids)
    queries = sum(after[r][1] - before[r][1] for r in ids)
    return served, hits / queries


def test_prefix_aware_router_beats_round_robin(url):
    ids = sorted(wait_until(settled(MIN_REPLICAS), 60, "two running replicas"))
    _, round_robin = run_rounds(url, lambda i, round_: ids[(i + round_) % len(ids)])
    served, prefix_aware = run_rounds(url, lambda i, round_: None)
    assert all(len(replicas) == 1 for replicas in served.values()), served  # each prefix stayed on one replica
    assert {r for replicas in served.values() for r in replicas} == set(ids)  # and the prefixes spread
    assert prefix_aware >= 1.5 * round_robin, (prefix_aware, round_robin)


def completion(url: str, i: int, stream: bool) -> tuple[str, int]:
    """("ok" | "lost" (failed before any byte) | "cut" (failed after some), bytes received)."""
    body = {"model": "tiny", "prompt": f"request {i} " * 8, "max_tokens": 48, "ignore_eos": True, "stream": stream}
    chunks: list[bytes] = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for chunk in r.iter_raw():
                chunks.append(chunk)
            if r.status_code != 200:
                return "lost", len(b"".join(chunks))
    except httpx.HTTPError:
        return ("cut" if chunks else "lost"), len(b"".join(chunks))
    raw = b"".join(chunks)
    complete = raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw if stream else bool(raw)
    return ("ok" if complete else "cut"), len(raw)


def test_killed_replica_is_replaced_and_unstarted_requests_survive(url):
    ids = wait_until(settled(MIN_REPLICAS), 60, "two running replicas")
    victim = sorted(ids)[0]
    results: list[tuple[str, int]] = []
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(completion, url, i, stream=i % 3 == 0) for i in range(36)]
        wait_until(lambda: sum(f.done() for f in futures) >= 6, 60, "the load to be under way")
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#{REPLICA_DEPLOYMENT}#{victim}", namespace="serve"))
        results = [f.result() for f in futures]
    outcomes = [outcome for outcome, _ in results]
    assert "lost" not in outcomes, outcomes  # not one request that had received nothing failed
    assert outcomes.count("ok") >= len(outcomes) - 6  # at most the streams open on the victim were cut
    new_ids = wait_until(settled(MIN_REPLICAS), 120, "Ray to replace the killed replica")
    assert victim not in new_ids and len(new_ids & ids) == 1


def test_autoscaling_adds_a_replica_under_load_and_removes_it_when_idle(url, shared_ray):
    wait_until(settled(MIN_REPLICAS), 120, "two running replicas")
    # The engines that were there when the test began (a killed replica's engine is gone with it).
    addrs = wait_until(lambda: len(live := shared_ray.gates.live()) == MIN_REPLICAS and live, 60,
                       "one live engine gate per replica")
    with ThreadPoolExecutor(16) as pool, contextlib.ExitStack() as stack:  # the gates released first
        engines = [stack.enter_context(StepGateClient(60, addr)) for addr in addrs]
        for gate in engines:
            stack.enter_context(gate.held())  # released on the way out, even when the wait fails
        added = [gate.status()["added"] for gate in engines]
        # 16 requests held in the two engines: twice the target of 2 replicas x 4, and the CPUs stay idle
        # for the new replica to import torch and start its engine.
        responses = [pool.submit(httpx.post, f"{url}/v1/completions", timeout=300, json={
            "model": "tiny", "prompt": f"busy {i}", "max_tokens": 8, "ignore_eos": True}) for i in range(16)]
        wait_until(lambda: sum(g.status()["added"] - a for g, a in zip(engines, added)) == 16, 60,
                   "the 16 requests in the engines")
        wait_until(lambda: num_running() == MAX_REPLICAS, 240, "a third replica under load")
    assert [r.result().status_code for r in responses] == [200] * 16
    wait_until(settled(MIN_REPLICAS), 60, "the extra replica removed after idle")
