"""The router in front of two real tiny replicas on loopback: the OpenAI client through it, prefix-aware
stickiness (the replicas' prefix-cache hit counters), cancellation, and a replica killed mid-run. The
replicas' engines are held at step boundaries (step gates) where a test must know that a request is still
running when its client leaves or its replica dies."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from llmserve.testing.router_servers import RouterProcess, sample_value, shared_tiny_model
from llmserve.testing.servers import ServerProcess, StepGateClient, wait_until

REPLICA_ARGS = ("--max-model-len", "512", "--num-kv-blocks", "200", "--served-model-name", "tiny",
                "--log-level", "warning")
FAST_HEALTH = ("--health-interval-s", "0.3", "--failure-threshold", "2", "--cooldown-s", "1")


def start_replicas(model_dir: str, gates: list[StepGateClient], ports=None) -> list[ServerProcess]:
    servers = [ServerProcess(["--model", model_dir, *REPLICA_ARGS, *(["--port", str(p)] if p else [])], env=g.env)
               for g, p in zip(gates, ports or [None] * len(gates))]
    with ThreadPoolExecutor(len(servers)) as pool:
        list(pool.map(lambda s: s.start(), servers))
    return servers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return shared_tiny_model(str(tmp_path_factory.getbasetemp()))


@pytest.fixture(scope="module")
def gates():
    gates = [StepGateClient(), StepGateClient()]
    yield gates
    for gate in gates:
        gate.__exit__()


@pytest.fixture(scope="module")
def replicas(model_dir, gates):
    servers = start_replicas(model_dir, gates)
    yield servers
    for s in servers:
        s.stop()


@contextlib.contextmanager
def all_held(gates: list[StepGateClient]):
    """Both replicas' engines held (released on the way out); yields their start statuses."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(gate.held()) for gate in gates]


def total(gates: list[StepGateClient], key: str) -> int:
    return sum(gate.status()[key] for gate in gates)


def backend_args(replicas) -> list[str]:
    return [arg for s in replicas for arg in ("--backend", f"tiny={s.url}")]


@pytest.fixture(scope="module")
def prefix_router(replicas):
    with RouterProcess([*backend_args(replicas), "--policy", "prefix-aware", "--prefix-chars", "200"]) as router:
        yield router


def replica_metrics(server: ServerProcess) -> str:
    return httpx.get(f"{server.url}/metrics", timeout=10).text


def test_openai_client_through_router(prefix_router):
    client = openai.OpenAI(base_url=f"{prefix_router.url}/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=5, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=1)


def test_sse_bytes_pass_through_unchanged(prefix_router, replicas):
    body = {"model": "tiny", "prompt": "same bytes", "max_tokens": 8, "stream": True, "ignore_eos": True,
            "seed": 1, "temperature": 0}
    with httpx.stream("POST", f"{prefix_router.url}/v1/completions", json=body, timeout=60) as r:
        via_router = b"".join(r.iter_raw())
        backend = r.headers["x-llmserve-backend"]
    with httpx.stream("POST", f"{backend}/v1/completions", json=body, timeout=60) as r:
        direct = b"".join(r.iter_raw())

    def text(raw):  # ids, timestamps and the grouping of tokens into chunks differ per request
        events = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
        return "".join(e["choices"][0]["text"] for e in events), events[-1]["choices"][0]["finish_reason"]

    assert via_router.endswith(b"data: [DONE]\n\n") and text(via_router) == text(direct)


def test_prefix_aware_keeps_a_prefix_on_one_replica(prefix_router, replicas):
    for s in replicas:
        httpx.post(f"{s.url}/reset_prefix_cache", timeout=10)
    before = {s.url: sample_value(replica_metrics(s), "llmserve:prefix_cache_hits_total") for s in replicas}
    system = "You are a helpful assistant who answers in rhyme. " * 5  # ~250 chars: > 200 hashed
    served = []
    for i in range(6):
        r = httpx.post(f"{prefix_router.url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": f"{system} question {i}?", "max_tokens": 2})
        assert r.status_code == 200
        served.append(r.headers["x-llmserve-backend"])
    assert len(set(served)) == 1
    home = served[0]
    hits = {s.url: sample_value(replica_metrics(s), "llmserve:prefix_cache_hits_total") - before[s.url]
            for s in replicas}
    assert hits[home] >= 5 * 96  # each later request found the shared prefix cached (6+ blocks of 16 tokens)
    assert all(v == 0 for url, v in hits.items() if url != home)
    others = {httpx.post(f"{prefix_router.url}/v1/completions", timeout=60,
                         json={"model": "tiny", "prompt": f"prefix number {i} " * 12, "max_tokens": 1}
                         ).headers["x-llmserve-backend"] for i in range(12)}
    assert others == {s.url for s in replicas}  # other prefixes still spread


def by_url(replicas, url) -> ServerProcess:
    return next(s for s in replicas if s.url == url)


def aborted(server) -> float:
    return sample_value(replica_metrics(server), "llmserve:request_success_total", finished_reason="abort")


def idle(server, kv_baseline: float) -> bool:
    text = replica_metrics(server)
    return (sample_value(text, "llmserve:num_requests_running") == 0
            and sample_value(text, "llmserve:kv_cache_usage_perc") <= kv_baseline)


def test_cancelled_stream_aborts_in_the_replica(prefix_router, replicas, gates):
    body = {"model": "tiny", "prompt": "cancel me", "max_tokens": 480, "stream": True, "ignore_eos": True}
    with all_held(gates) as starts:
        with httpx.stream("POST", f"{prefix_router.url}/v1/completions", json=body, timeout=60) as r:
            server = by_url(replicas, r.headers["x-llmserve-backend"])
            gate, start = gates[replicas.index(server)], starts[replicas.index(server)]
            gate.wait_for("added", start["added"] + 1)
            num_aborted = aborted(server)
            gate.run_steps(2)  # prefilled and decoding: its KV blocks are in use
            assert sample_value(replica_metrics(server), "llmserve:kv_cache_usage_perc") > 0.0
        gate.wait_for("aborted", start["aborted"] + 1)  # the client left; the replica aborts it
    wait_until(lambda: aborted(server) == num_aborted + 1 and idle(server, 0.0), 10, "the abort")


def test_cancelled_non_streamed_request_aborts_in_the_replica(prefix_router, replicas, gates):
    before = {s.url: aborted(s) for s in replicas}
    body = {"model": "tiny", "prompt": "cancel me too", "max_tokens": 480, "ignore_eos": True}

    async def leave_while_held(num_added: int) -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            post = asyncio.create_task(http.post(f"{prefix_router.url}/v1/completions", json=body))
            await asyncio.to_thread(wait_until, lambda: total(gates, "added") == num_added + 1, 30, "the request")
            post.cancel()  # the client goes away before any token
            await asyncio.gather(post, return_exceptions=True)

    with all_held(gates) as starts:
        asyncio.run(leave_while_held(sum(s["added"] for s in starts)))
        num_aborted = sum(s["aborted"] for s in starts)
        wait_until(lambda: total(gates, "aborted") == num_aborted + 1, 30, "the abort to reach the replica")
        assert total(gates, "steps") == sum(s["steps"] for s in starts)  # not a step ran
    wait_until(lambda: sum(aborted(s) - before[s.url] for s in replicas) == 1
               and all(idle(s, 0.0) for s in replicas), 10, "the abort")


def read_stream(url: str, body: dict, out: list, index: int, started: threading.Event) -> None:
    """`started` is set once the response head arrived (the stream is open on a replica)."""
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            started.set()
            out[index] = (r.headers.get("x-llmserve-backend"), b"".join(r.iter_raw()))
    except httpx.HTTPError as e:
        out[index] = (None, repr(e).encode())
    finally:
        started.set()


def kill(server: ServerProcess) -> None:
    children = server.children()
    server.proc.kill()
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    server.proc.wait()


def test_replica_killed_mid_run(replicas, gates, model_dir):
    """Both replicas held with two streams (open) and two posts each, none past its first step, when one
    replica is killed: its streams end with an error event, its posts are retried on the survivor."""
    with RouterProcess([*backend_args(replicas), "--policy", "round-robin", *FAST_HEALTH]) as router:
        victim, survivor = replicas[1], replicas[0]
        starts = [gate.hold() for gate in gates]
        streams: list = [None] * 4
        stream_body = {"model": "tiny", "prompt": "long story", "max_tokens": 480, "stream": True,
                       "ignore_eos": True}
        started = [threading.Event() for _ in range(4)]
        threads = [threading.Thread(target=read_stream, args=(router.url, stream_body, streams, i, started[i]))
                   for i in range(4)]
        with ThreadPoolExecutor(4) as pool:
            for t in threads:
                t.start()
            assert all(event.wait(30) for event in started)  # the streams are open on both replicas
            posts = [pool.submit(httpx.post, f"{router.url}/v1/completions", timeout=120,
                                 json={"model": "tiny", "prompt": f"q{i}", "max_tokens": 400, "ignore_eos": True})
                     for i in range(4)]
            for gate, start in zip(gates, starts):  # round-robin: two streams and two posts each
                gate.wait_for("added", start["added"] + 4)
            kill(victim)
            later = [pool.submit(httpx.post, f"{router.url}/v1/completions", timeout=120,
                                 json={"model": "tiny", "prompt": f"r{i}", "max_tokens": 4}) for i in range(4)]
            gates[0].release()
            for t in threads:
                t.join()
            results = [f.result() for f in posts + later]
        assert all(r.status_code == 200 for r in results), [r.text for r in results]
        assert all(r.headers["x-llmserve-backend"] == survivor.url for r in results[4:])
        check_streams(streams, victim, survivor)
        metrics = router.metrics()
        assert sample_value(metrics, "llmserve_router:ejections_total", backend=victim.url) >= 1
        assert sample_value(metrics, "llmserve_router:retries_total") >= 1
        assert sample_value(metrics, "llmserve_router:backend_healthy", backend=victim.url) == 0
        replicas[1] = start_replicas(model_dir, gates[1:], ports=[victim.port])[0]
        check_back_in_rotation(router, survivor, replicas[1])


def check_streams(streams: list, victim: ServerProcess, survivor: ServerProcess) -> None:
    """The victim's two streams end with the router's error event, the survivor's two complete."""
    cut = [raw for backend, raw in streams if backend == victim.url]
    whole = [raw for backend, raw in streams if backend == survivor.url]
    assert len(cut) == 2 and len(whole) == 2
    for raw in cut:
        events = raw.rstrip(b"\n").split(b"\n\n")
        assert events[-1] == b"data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["code"] == "upstream_disconnected"
    assert all(b'"finish_reason":"length"' in raw for raw in whole)


def check_back_in_rotation(router: RouterProcess, survivor: ServerProcess, restarted: ServerProcess) -> None:
    wait_until(lambda: sample_value(router.metrics(), "llmserve_router:backend_healthy",
                                    backend=restarted.url) == 1, 20, "the restarted replica to come back")
    served = {httpx.post(f"{router.url}/v1/completions", timeout=60,
                         json={"model": "tiny", "prompt": "back?", "max_tokens": 1}).headers["x-llmserve-backend"]
              for _ in range(4)}
    assert served == {survivor.url, restarted.url}
