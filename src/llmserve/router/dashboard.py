"""The router's GET /dashboard: the server's page (the same static files), fed by GET /dashboard/state,
which reads the router's own registry (RouterMetrics: routed requests, scale events, rejections) and the
Gateway's pools and backends (health state, requests in flight, the load last scraped from each backend).
The router has no API key of its own, so these paths are open like its /metrics."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from llmserve.http.dashboard import STATIC_FILES, asset_response, page_response, state_response
from llmserve.http.dashboard_state import SnapshotRing, Window
from llmserve.router.backends import Backend, Pool
from llmserve.router.gateway import Gateway

P = "llmserve_router:"
SCALE_ACTIONS = ("up", "down")


def router_state(w: Window, gw: Gateway) -> dict:
    """The JSON of the router's /dashboard/state (docs/ui.md describes it)."""
    pools = [_pool_row(w, pool) for pool in gw.pools.values()]
    return {"kind": "router", "models": gw.model_names(), "time": time.time(), "window_s": w.window_s,
            "totals": _totals(w, pools), "pools": pools,
            "backends": [_backend_row(w, b) for pool in gw.pools.values() for b in pool.backends]}


def _totals(w: Window, pools: list[dict]) -> dict:
    return {"requests_per_s": w.rate(P + "requests_total"),
            "in_flight": sum(p["in_flight"] for p in pools), "queued": sum(p["queued"] for p in pools),
            "backends_up": sum(p["backends_up"] for p in pools), "backends": sum(p["backends"] for p in pools),
            "rejected_per_s": w.rate(P + "rejected_total"), "retries_per_s": w.rate(P + "retries_total"),
            "duration": w.latency(P + "request_duration_seconds")}


def _pool_row(w: Window, pool: Pool) -> dict:
    name = pool.name
    return {"name": name, "policy": pool.policy.name, "backends": len(pool.backends),
            "backends_up": sum(1 for b in pool.backends if b.is_up), "queued": pool.queue.num_waiting,
            "in_flight": pool.num_in_flight(), "requests_per_s": w.rate(P + "requests_total", pool=name),
            "duration": w.latency(P + "request_duration_seconds", pool=name),
            "autoscaler": _autoscaler(w, name)}


def _autoscaler(w: Window, pool: str) -> dict | None:
    """Replicas and scale decisions carried out (None for a pool the autoscaler does not manage)."""
    if pool not in w.current.label_values(P + "replicas", "pool"):
        return None
    return {"replicas": w.gauge(P + "replicas", pool=pool),
            **{f"scale_{a}": w.gauge(P + "scale_events_total", pool=pool, action=a) for a in SCALE_ACTIONS},
            "decisions_in_window": w.increase(P + "scale_events_total", pool=pool)}


def _backend_row(w: Window, b: Backend) -> dict:
    labels = {"pool": b.pool, "backend": b.url}
    return {"pool": b.pool, "url": b.url, "health": b.health.state.value, "draining": b.is_draining,
            "up": b.is_up, "in_flight": b.num_in_flight, "waiting": b.scraped.num_waiting,
            "running": b.scraped.num_running, "kv_usage": b.scraped.kv_usage,
            "adapters": sorted(b.adapters), "resident_adapters": sorted(b.scraped.resident_adapters),
            "routed": w.gauge(P + "requests_total", **labels),
            "requests_per_s": w.rate(P + "requests_total", **labels),
            "errors_in_window": _errors(w, labels), "ejections": w.gauge(P + "ejections_total", **labels),
            "latency": w.latency(P + "upstream_latency_seconds", **labels)}


def _errors(w: Window, labels: dict[str, str]) -> float:
    """Answers with a 5xx status and streams cut, over the window."""
    statuses = [s for s in w.current.label_values(P + "requests_total", "status") if s.startswith("5")]
    return (sum(w.increase(P + "requests_total", status=s, **labels) for s in statuses)
            + w.increase(P + "stream_errors_total", **labels))


def dashboard_routes(gw: Gateway) -> list[Route]:
    ring = SnapshotRing(gw.metrics.registry)

    async def dashboard(request: Request) -> Response:
        return page_response()

    async def state(request: Request) -> Response:
        return state_response(router_state(ring.advance(time.monotonic()), gw))

    return [Route("/dashboard", dashboard, methods=["GET"]), Route("/dashboard/state", state, methods=["GET"]),
            *(Route(f"/dashboard/{name}", _asset(name), methods=["GET"]) for name in STATIC_FILES)]


def _asset(name: str):
    async def endpoint(request: Request) -> Response:
        return asset_response(name)

    return endpoint
