"""`llmserve route --autoscale`: one local replica at first, a second under a queue (held in the first one's
engine at a step boundary, so that the second starts on idle CPUs and takes the next request), back to one
after."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from llmserve.testing.router_servers import RouterProcess, sample_value, shared_tiny_model
from llmserve.testing.servers import StepGateClient, is_alive, wait_until

REPLICA_ARGS = "--max-model-len 512 --num-kv-blocks 200 --max-num-seqs 2 --log-level warning"


@pytest.fixture(scope="module")
def router(tmp_path_factory, engine_gates):
    """The router, and after the module: every replica it launched has exited."""
    model_dir = shared_tiny_model(str(tmp_path_factory.getbasetemp()))
    args = ["--autoscale", "--min-replicas", "1", "--max-replicas", "2", "--replica-model", model_dir,
            "--replica-pool", "tiny", "--replica-args", REPLICA_ARGS, "--target-waiting-per-replica", "1",
            "--scale-up-window-s", "1", "--scale-down-idle-s", "2", "--scale-cooldown-s", "1",
            "--health-interval-s", "0.3", "--scrape-interval-s", "0.3"]
    router = RouterProcess(args, env=engine_gates.env).start()  # the replicas it launches inherit the gates
    try:
        yield router
    finally:
        pids = launched_pids(router)
        assert router.stop() == 0
        wait_until(lambda: not any(is_alive(p) for p in pids), 30, "the replicas to exit with the router")
        router.__exit__(None, None, None)  # removes its log


def num_healthy(router) -> float:
    return sample_value(router.metrics(), "llmserve_router:backend_healthy")


def launched_pids(router) -> list[int]:
    return [int(m) for m in re.findall(r"launched replica \S+ \(pid (\d+)", router.log())]


def complete(url: str, prompt: str) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 32, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def test_scales_up_under_a_queue_and_down_after(router, engine_gates):
    wait_until(lambda: num_healthy(router) == 1, 120, "the first replica")
    [addr] = engine_gates.live()
    with ThreadPoolExecutor(6) as pool, StepGateClient(60, addr) as first:
        with first.held():  # released on the way out, even when a wait fails
            added = first.status()["added"]
            queued = [pool.submit(complete, router.url, f"queued {i}") for i in range(6)]
            first.wait_for("added", added + 6)
            first.run_steps(1)  # two running (--max-num-seqs 2), four waiting: what its metrics now say
            wait_until(lambda: num_healthy(router) == 2, 120, "a second replica")
            second = complete(router.url, "next").headers["x-llmserve-backend"]  # the first one is held
        served_first = {f.result().headers["x-llmserve-backend"] for f in queued}
    assert len(served_first) == 1 and second not in served_first
    metrics = router.metrics()
    assert sample_value(metrics, "llmserve_router:scale_events_total", action="up") >= 2  # min, then the queue
    wait_until(lambda: sample_value(router.metrics(), "llmserve_router:replicas") == 1, 60, "the scale-down")
    wait_until(lambda: router.metrics().count("llmserve_router:backend_healthy{") == 1, 30, "the drained replica")
    metrics = router.metrics()
    assert sample_value(metrics, "llmserve_router:scale_events_total", action="down") == 1
    assert num_healthy(router) == 1
    pids = launched_pids(router)
    assert len(pids) == 2
    wait_until(lambda: sum(is_alive(p) for p in pids) == 1, 30, "the drained replica to exit")
    r = httpx.post(f"{router.url}/v1/completions", json={"model": "tiny", "prompt": "after", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200
