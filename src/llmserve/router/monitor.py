"""Background loops: active /health probes (which also learn the model a backend serves from its
GET /v1/models), and /metrics scrapes of the backends' load."""

from __future__ import annotations

import asyncio
import logging
import re
import time

from llmserve.router.backends import Backend, ScrapedLoad
from llmserve.router.fetch import fetch
from llmserve.router.gateway import Gateway
from llmserve.router.upstream import UpstreamError

logger = logging.getLogger("llmserve.router")

# Metric names of llmserve replicas (`llmserve:`), and of vLLM, whose /metrics has the same shape.
_WAITING = ("llmserve:num_requests_waiting", "llmserve_num_requests_waiting", "vllm:num_requests_waiting")
_RUNNING = ("llmserve:num_requests_running", "llmserve_num_requests_running", "vllm:num_requests_running")
_KV_USAGE = ("llmserve:kv_cache_usage_perc", "llmserve_kv_cache_usage_perc", "vllm:kv_cache_usage_perc",
             "vllm:gpu_cache_usage_perc")
_ADAPTERS = ("llmserve:lora_adapters",)
_RESIDENT = "llmserve:lora_adapter_resident"


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
    values = parse_metrics(text, {*_WAITING, *_RUNNING, *_KV_USAGE, *_ADAPTERS})

    def first(names: tuple[str, ...]) -> float:
        return next((values[n] for n in names if n in values), 0.0)

    return ScrapedLoad(first(_WAITING), first(_RUNNING), first(_KV_USAGE), first(_ADAPTERS),
                       resident_adapters(text))


_LORA_NAME = re.compile(r'lora_name="((?:[^"\\]|\\.)*)"')


def resident_adapters(text: str) -> frozenset[str]:
    """The adapters whose `llmserve:lora_adapter_resident{lora_name=...}` sample is 1 (in an engine slot)."""
    names = set()
    for line in text.splitlines():
        match = _LORA_NAME.search(line) if line.startswith(_RESIDENT + "{") else None
        if match and line.rsplit(" ", 1)[-1] not in ("0", "0.0"):
            names.add(match.group(1).replace('\\"', '"').replace("\\\\", "\\"))
    return frozenset(names)


async def probe(gw: Gateway, backend: Backend) -> None:
    if not backend.health.should_probe(time.monotonic()):
        return
    try:
        response = await fetch(gw.upstream, backend.url, "/health", gw.config.health_timeout_s)
        is_ok = response.status == 200 and (backend.model_card is not None or await learn_model(gw, backend))
    except UpstreamError:
        is_ok = False
    if is_ok:
        gw.record_success(backend)
    else:
        backend.model_card = None  # learned again once it is back (it may come back serving another model)
        gw.record_failure(backend)


async def learn_model(gw: Gateway, backend: Backend) -> bool:
    """Ask the backend which model it serves (GET /v1/models); False when it serves none the pool can use.
    A backend without that route keeps no card: requests then carry the pool's (or its upstream_model) name."""
    response = await fetch(gw.upstream, backend.url, "/v1/models", gw.config.health_timeout_s)
    try:
        cards = [c for c in response.json()["data"] if isinstance(c, dict) and isinstance(c.get("id"), str)]
    except (ValueError, KeyError, TypeError):
        return True
    pool = gw.pools[backend.pool]
    backend.adapters = frozenset(c["id"] for c in cards if c.get("parent"))
    cards = [c for c in cards if not c.get("parent")]
    card, problem = choose_card(pool.name, pool.upstream_model, cards)
    if problem:
        logger.warning("backend %s of pool `%s` left out: %s", backend.url, pool.name, problem)
        return False
    backend.model_card = card
    if card is not None and card["id"] != pool.name:
        logger.info("backend %s serves `%s` as pool `%s`: model names are rewritten both ways", backend.url,
                    card["id"], pool.name)
    return True


def choose_card(pool: str, upstream_model: str | None, cards: list[dict]) -> tuple[dict | None, str]:
    """The model card the pool uses among a backend's (None when it lists none), or a problem to report."""
    ids = [c["id"] for c in cards]
    if upstream_model is not None:
        if upstream_model in ids:
            return cards[ids.index(upstream_model)], ""
        return None, f"it serves {', '.join(ids) or 'no model'}, not `{upstream_model}` (the pool's upstream_model)"
    if pool in ids:
        return cards[ids.index(pool)], ""
    return (cards[0] if cards else None), ""


async def scrape(gw: Gateway, backend: Backend) -> None:
    if not backend.is_up:
        return
    try:
        response = await fetch(gw.upstream, backend.url, "/metrics", gw.config.health_timeout_s)
        if response.status == 200:
            backend.scraped = scraped_load(response.text)
        if backend.scraped.num_adapters != len(backend.adapters):  # adapters load and unload at run time
            await learn_model(gw, backend)
    except UpstreamError as e:
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


async def probe_all(gw: Gateway) -> None:
    await asyncio.gather(*(probe(gw, b) for b in _all_backends(gw)))
    for pool in gw.pools.values():
        pool.queue.notify_all()  # a cool-down may have ended: queued requests re-check


async def run_monitors(gw: Gateway) -> None:
    """Probe and scrape until cancelled (the router runs one probe round before it takes requests)."""
    async def scrape_all() -> None:
        await asyncio.gather(*(scrape(gw, b) for b in _all_backends(gw)))

    loops = [_every(gw.config.health_interval_s, lambda: probe_all(gw))]
    if gw.config.scrape_interval_s > 0:
        loops.append(_every(gw.config.scrape_interval_s, scrape_all))
    await asyncio.gather(*loops)
