"""GET /dashboard: a live page of the server's state, fed by GET /dashboard/state (JSON), which reads the
ServerMetrics registry that /metrics renders (http/dashboard_state.py). The page, its script and style are
the files the router's dashboard serves too (http/dashboard.py); nothing loads from outside the server.

Like /metrics, these paths are open when an API key is set (middleware.OPEN_PATHS): the state says no
more than /metrics does. The page still sends `Authorization: Bearer` when the state answers 401 (it
asks for the key once), so it keeps working if the state is ever put behind the key.
"""

from __future__ import annotations

import time
from starlette.requests import Request
from starlette.responses import Response

from llmserve.http.dashboard import STATIC_FILES, asset_response, page_response, state_response
from llmserve.http.dashboard_state import SnapshotRing, Window, ratio

DASHBOARD_PATHS = frozenset({"/dashboard", "/dashboard/state", *(f"/dashboard/{name}" for name in STATIC_FILES)})
P = "llmserve:"


def server_state(w: Window, model_name: str) -> dict:
    """The JSON of /dashboard/state (docs/ui.md describes it)."""
    return {"kind": "server", "model": model_name, "time": time.time(), "window_s": w.window_s,
            "requests": _requests(w), "kv_cache": _kv_cache(w), "throughput": _throughput(w),
            "latency": {"ttft": w.latency(P + "time_to_first_token_seconds"),
                        "itl": w.latency(P + "inter_token_latency_seconds"),
                        "e2e": w.latency(P + "e2e_request_latency_seconds")},
            "preemptions": {"total": w.gauge(P + "num_preemptions_total"),
                            "per_s": w.rate(P + "num_preemptions_total")},
            "speculative": _speculative(w), "grammar_cache": _grammar_cache(w), "moe": _moe(w),
            "kv_tiers": _kv_tiers(w), "lora": _lora(w)}


def _requests(w: Window) -> dict:
    return {"running": w.gauge(P + "num_requests_running"), "waiting": w.gauge(P + "num_requests_waiting"),
            "in_flight": w.gauge(P + "num_requests_in_flight"),
            "finished_per_s": w.rate(P + "request_success_total")}


def _kv_cache(w: Window) -> dict:
    total, free = w.gauge(P + "kv_cache_blocks"), w.gauge(P + "kv_cache_free_blocks")
    return {"blocks": total, "used_blocks": max(0.0, total - free), "free_blocks": free,
            "usage": w.gauge(P + "kv_cache_usage_perc"),
            "prefix_hit_rate": ratio(w.increase(P + "prefix_cache_hits_total"),
                                     w.increase(P + "prefix_cache_queries_total"))}


def _throughput(w: Window) -> dict:
    return {"output_tokens_per_s": w.rate(P + "generation_tokens_total"),
            "prompt_tokens_per_s": w.rate(P + "prompt_tokens_total")}


def _speculative(w: Window) -> dict:
    drafts = w.increase(P + "spec_decode_num_draft_tokens_total")
    return {"draft_tokens": drafts,
            "acceptance_rate": ratio(w.increase(P + "spec_decode_num_accepted_tokens_total"), drafts)}


def _grammar_cache(w: Window) -> dict:
    queries = w.increase(P + "grammar_cache_queries_total")
    return {"queries": queries, "hit_rate": ratio(w.increase(P + "grammar_cache_hits_total"), queries)}


def _moe(w: Window) -> dict | None:
    """Expert load balance (tokens per expert, max over mean) over the window; None until a step has
    recorded one, which only a Mixture-of-Experts model does (the page then draws no panel)."""
    name = P + "moe_expert_load_max_over_mean"
    if w.gauge(name + "_count") <= 0:
        return None
    return {"load_max_over_mean": w.latency(name), "steps": w.gauge(name + "_count")}


def _kv_tiers(w: Window) -> dict | None:
    """The KV tiers below the device and the blocks a disaggregated pair moved, since start; None while none
    of their counters moved (a server without tiers or a role: the page then draws no tile)."""
    counts = {"host_hit_tokens": w.gauge(P + "kv_offload_hit_tokens_total", tier="host"),
              "disk_hit_tokens": w.gauge(P + "kv_offload_hit_tokens_total", tier="disk"),
              "offloaded_blocks": w.gauge(P + "kv_offload_saved_blocks_total"),
              "corrupt_blocks": w.gauge(P + "kv_offload_corrupt_blocks_total"),
              "sent_blocks": w.gauge(P + "kv_transfer_sent_blocks_total"),
              "received_blocks": w.gauge(P + "kv_transfer_received_blocks_total")}
    if not any(counts.values()):
        return None
    return {**counts, "hit_tokens_per_s": w.rate(P + "kv_offload_hit_tokens_total")}


def _lora(w: Window) -> dict | None:
    """The LoRA adapters served and each adapter's traffic (finished requests and output tokens: since start,
    and per second), the adapters that ran first; None while none is served and none ran (LoRA off: no tile)."""
    tokens, finished = P + "lora_generation_tokens_total", P + "lora_request_success_total"
    names = sorted({*w.current.label_values(tokens, "lora_name"), *w.current.label_values(finished, "lora_name")})
    num_served = w.gauge(P + "lora_adapters")
    if not names and not num_served:
        return None
    adapters = [{"name": name, "finished": w.gauge(finished, lora_name=name),
                 "finished_per_s": w.rate(finished, lora_name=name),
                 "output_tokens": w.gauge(tokens, lora_name=name),
                 "output_tokens_per_s": w.rate(tokens, lora_name=name)} for name in names]
    return {"served": num_served, "adapters": adapters}


def add_dashboard_routes(app, metrics) -> None:
    """/dashboard, its two assets, and /dashboard/state over `metrics` (a ServerMetrics)."""
    ring = SnapshotRing(metrics.registry)

    async def dashboard(request: Request) -> Response:
        return page_response()

    async def state(request: Request) -> Response:
        return state_response(server_state(ring.advance(time.monotonic()), metrics.model_name))

    app.add_route("/dashboard", dashboard, methods=["GET"], include_in_schema=False)
    app.add_route("/dashboard/state", state, methods=["GET"], include_in_schema=False)
    for name in STATIC_FILES:
        app.add_route(f"/dashboard/{name}", _asset(name), methods=["GET"], include_in_schema=False)


def _asset(name: str):
    async def endpoint(request: Request) -> Response:
        return asset_response(name)

    return endpoint
