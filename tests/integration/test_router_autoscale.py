"""`llmserve route --autoscale`: one local replica at first, a second under a burst, back to one after."""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from llmserve.router.testing import RouterProcess, sample_value, shared_tiny_model
from llmserve.server.testing import is_alive, wait_until

REPLICA_ARGS = "--max-model-len 512 --num-kv-blocks 200 --max-num-seqs 2 --log-level warning"


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    """The router, and after the module: every replica it launched has exited."""
    model_dir = shared_tiny_model(str(tmp_path_factory.getbasetemp()))
    args = ["--autoscale", "--min-replicas", "1", "--max-replicas", "2", "--replica-model", model_dir,
            "--replica-pool", "tiny", "--replica-args", REPLICA_ARGS, "--target-waiting-per-replica", "1",
            "--scale-up-window-s", "1", "--scale-down-idle-s", "2", "--scale-cooldown-s", "1",
            "--health-interval-s", "0.3", "--scrape-interval-s", "0.3"]
    router = RouterProcess(args).start()
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


def hammer(url: str, stop: threading.Event, served: set) -> None:
    body = {"model": "tiny", "prompt": "burst", "max_tokens": 32, "ignore_eos": True}
    while not stop.is_set():
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        served.add(r.headers["x-llmserve-backend"])


def test_scales_up_under_a_burst_and_down_after(router):
    wait_until(lambda: num_healthy(router) == 1, 120, "the first replica")
    stop, served = threading.Event(), set()
    with ThreadPoolExecutor(6) as pool:
        workers = [pool.submit(hammer, router.url, stop, served) for _ in range(6)]
        try:
            wait_until(lambda: num_healthy(router) == 2 and len(served) == 2, 120, "a second replica taking traffic")
        finally:
            stop.set()
        for w in workers:
            w.result()
    metrics = router.metrics()
    assert sample_value(metrics, "llmserve_router:scale_events_total", action="up") >= 2  # min, then the burst
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
