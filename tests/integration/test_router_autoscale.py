"""`llmserve route --autoscale`: one local replica at first, a second under a burst, back to one after."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from llmserve.router.testing import RouterProcess, sample_value, shared_tiny_model

REPLICA_ARGS = "--max-model-len 512 --num-kv-blocks 200 --max-num-seqs 2 --log-level warning"


def wait_for(predicate, timeout: float, what: str, step: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(step)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    model_dir = shared_tiny_model(str(tmp_path_factory.getbasetemp()))
    args = ["--autoscale", "--min-replicas", "1", "--max-replicas", "2", "--replica-model", model_dir,
            "--replica-pool", "tiny", "--replica-args", REPLICA_ARGS, "--target-waiting-per-replica", "1",
            "--scale-up-window-s", "1", "--scale-down-idle-s", "2", "--scale-cooldown-s", "1",
            "--health-interval-s", "0.3", "--scrape-interval-s", "0.3"]
    with RouterProcess(args) as router:
        yield router


def num_healthy(router) -> float:
    return sample_value(router.metrics(), "llmserve_router:backend_healthy")


def hammer(url: str, stop: threading.Event, served: set) -> None:
    body = {"model": "tiny", "prompt": "burst", "max_tokens": 48, "ignore_eos": True}
    while not stop.is_set():
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        served.add(r.headers["x-llmserve-backend"])


def test_scales_up_under_a_burst_and_down_after(router):
    wait_for(lambda: num_healthy(router) == 1, 120, "the first replica")
    stop, served = threading.Event(), set()
    with ThreadPoolExecutor(8) as pool:
        workers = [pool.submit(hammer, router.url, stop, served) for _ in range(8)]
        try:
            wait_for(lambda: num_healthy(router) == 2 and len(served) == 2, 120, "a second replica taking traffic")
        finally:
            stop.set()
        for w in workers:
            w.result()
    metrics = router.metrics()
    assert sample_value(metrics, "llmserve_router:scale_events_total", action="up") >= 2  # min, then the burst
    wait_for(lambda: sample_value(router.metrics(), "llmserve_router:replicas") == 1, 60, "the scale-down")
    metrics = router.metrics()
    assert sample_value(metrics, "llmserve_router:scale_events_total", action="down") == 1
    assert num_healthy(router) == 1
    r = httpx.post(f"{router.url}/v1/completions", json={"model": "tiny", "prompt": "after", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200
