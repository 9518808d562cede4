"""Background loops: active /health probes, and /metrics scrapes of the backends' load."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from llmserve.router.backends import Backend, ScrapedLoad
from llmserve.router.gateway import Gateway

logger = logging.getLogger("llmserve.router")

# Metric names of llmserve replicas (`llmserve:`), and of vLLM, whose /metrics has the same shape.
_WAITING = ("llmserve:num_requests_waiting", "llmserve_num_requests_waiting", "vllm:num_requests_waiting")
_RUNNING = ("llmserve:num_requests_running", "llmserve_num_requests_running", "vllm:num_requests_running")
_KV_USAGE = ("llmserve:kv_cache_usage_perc", "llmserve_kv_cache_usage_perc", "vllm:kv_cache_usage_perc",
             "vllm:gpu_cache_usage_perc")


def parse_metrics(text: str, names: set[str]) -> dict[str, float]:
    """Sum of each wanted metric's samples in Prometheus text format."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            try:
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except (ValueError, IndexError):
                continue
    return values


def scraped_load(text: str) -> ScrapedLoad:
    values = parse_metrics(text, {*_WAITING, *_RUNNING, *_KV_USAGE})

    def first(names: tuple[str, ...]) -> float:
        return next((values[n] for n in names if n in values), 0.0)

    return ScrapedLoad(first(_WAITING), first(_RUNNING), first(_KV_USAGE))


async def probe(gw: Gateway, backend: Backend) -> None:
    if not backend.health.should_probe(time.monotonic()):
        return
    try:
        response = await gw.client.get(backend.url + "/health", timeout=gw.config.health_timeout_s)
        is_ok = response.status_code == 200
    except httpx.HTTPError:
        is_ok = False
    if is_ok:
        gw.record_success(backend)
    else:
        gw.record_failure(backend)


async def scrape(gw: Gateway, backend: Backend) -> None:
    if not backend.is_up:
        return
    try:
        response = await gw.client.get(backend.url + "/metrics", timeout=gw.config.health_timeout_s)
        if response.status_code == 200:
            backend.scraped = scraped_load(response.text)
    except httpx.HTTPError as e:
        logger.debug("scrape of %s failed: %s", backend.url, e)


def _all_backends(gw: Gateway) -> list[Backend]:
    return [b for pool in gw.pools.values() for b in pool.backends]


async def _every(interval_s: float, step) -> None:
    while True:
        started = time.monotonic()
        try:
            await step()
        except Exception:  # noqa: BLE001 - a background loop must survive one bad round
            logger.exception("router background loop failed a round")
        await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))


async def run_monitors(gw: Gateway) -> None:
    """Probe and scrape until cancelled."""
    async def probe_all() -> None:
        await asyncio.gather(*(probe(gw, b) for b in _all_backends(gw)))
        for pool in gw.pools.values():
            pool.queue.notify_all()  # a cool-down may have ended: queued requests re-check

    async def scrape_all() -> None:
        await asyncio.gather(*(scrape(gw, b) for b in _all_backends(gw)))

    loops = [_every(gw.config.health_interval_s, probe_all)]
    if gw.config.scrape_interval_s > 0:
        loops.append(_every(gw.config.scrape_interval_s, scrape_all))
    await asyncio.gather(*loops)
