"""The dashboards' state from prometheus registries: windowed percentiles from bucket differences, counters
as rates, the snapshot ring, the server's and the router's JSON (clock passed in, no sleeping)."""

import dataclasses
import math

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from llmserve.http.dashboard_state import (SnapshotRing, bucket_increase, histogram_quantile, percentiles,
                                           take_snapshot)
from llmserve.messages import KVTierStats, SchedulerStats, SpecDecodeStats
from llmserve.router.classifier import AutoRouteConfig
from llmserve.router.config import AutoscaleConfig, BackendSpec, PoolSpec, RouterConfig, RouterSetup
from llmserve.router.dashboard import router_state
from llmserve.router.gateway import Gateway
from llmserve.router.health import HealthState
from llmserve.server.dashboard import server_state
from llmserve.server.metrics import ServerMetrics
from router_mock_upstream import MockUpstream

INF = math.inf


def test_quantile_interpolates_inside_its_bucket():
    cumulative = [(0.1, 0.0), (0.2, 10.0), (0.4, 20.0), (INF, 20.0)]
    assert histogram_quantile(0.5, cumulative) == pytest.approx(0.2)
    assert histogram_quantile(0.25, cumulative) == pytest.approx(0.15)
    assert histogram_quantile(0.75, cumulative) == pytest.approx(0.3)


def test_quantile_edges():
    assert histogram_quantile(0.5, [(1.0, 0.0), (INF, 0.0)]) is None
    assert histogram_quantile(0.5, []) is None
    assert histogram_quantile(0.5, [(1.0, 4.0), (INF, 4.0)]) == pytest.approx(0.5)  # first bucket starts at 0
    assert histogram_quantile(0.99, [(1.0, 1.0), (2.0, 1.0), (INF, 10.0)]) == 2.0  # +Inf: highest finite bound


def test_bucket_increase_and_percentiles_of_a_window():
    old = [(0.1, 5.0), (1.0, 5.0), (INF, 5.0)]
    new = [(0.1, 5.0), (1.0, 15.0), (INF, 15.0)]
    window = bucket_increase(new, old)
    assert window == [(0.1, 0.0), (1.0, 10.0), (INF, 10.0)]
    p = percentiles(window)
    assert p["count"] == 10.0 and p["p50"] == pytest.approx(0.55) and p["p99"] == pytest.approx(0.991)


def small_histogram_registry():
    registry = CollectorRegistry()
    hist = Histogram("lat", "", ["model_name"], buckets=(0.01, 0.1, 1.0, 10.0), registry=registry).labels("m")
    tokens = Counter("tok", "", ["model_name"], registry=registry).labels("m")
    return registry, hist, tokens


def test_percentiles_forget_what_is_older_than_the_window():
    registry, hist, _ = small_histogram_registry()
    ring = SnapshotRing(registry, window_s=60.0)
    ring.advance(0.0)
    for _ in range(10):
        hist.observe(5.0)  # slow, at t in (0, 30)
    assert ring.advance(30.0).latency("lat")["p50"] > 1.0
    for _ in range(10):
        hist.observe(0.005)  # fast, at t in (30, 65)
    w = ring.advance(65.0)  # the snapshot at 0 is out of the window; the one at 30 is the baseline
    assert w.window_s == 35.0
    lat = w.latency("lat")
    assert lat["count"] == 10 and lat["p99"] <= 0.01


def test_first_poll_has_no_rate_and_percentiles_since_start():
    registry, hist, tokens = small_histogram_registry()
    hist.observe(0.05)
    tokens.inc(7)
    w = SnapshotRing(registry).advance(100.0)
    assert w.rate("tok_total") is None and w.window_s == 0.0
    assert w.increase("tok_total") == 7 and w.latency("lat")["count"] == 1


def test_counter_rate_over_about_two_seconds():
    registry, _, tokens = small_histogram_registry()
    ring = SnapshotRing(registry, rate_window_s=2.0)
    ring.advance(10.0)
    tokens.inc(100)
    ring.advance(11.0)
    tokens.inc(100)
    assert ring.advance(12.0).rate("tok_total") == pytest.approx(100.0)  # 200 tokens over the 2 s since t=10
    tokens.inc(50)
    assert ring.advance(12.5).rate("tok_total") == pytest.approx(150 / 1.5)  # baseline: t=11, the newest >= 2 s


def test_ring_keeps_a_window_of_spaced_snapshots():
    registry, _, _ = small_histogram_registry()
    ring = SnapshotRing(registry, window_s=60.0, rate_window_s=2.0)
    for i in range(400):
        ring.advance(i * 0.1)  # ten polls a second (several viewers): one snapshot every 0.25 s or more
    times = [s.time for s in ring.snapshots]
    assert times[-1] - times[0] <= 62.0 and len(times) <= 62.0 / 0.25 + 1
    assert all(b - a >= 0.25 - 1e-9 for a, b in zip(times, times[1:]))


def test_snapshot_sums_series_and_skips_created():
    registry, hist, tokens = small_histogram_registry()
    tokens.inc(3)
    snap = take_snapshot(registry, 0.0)
    assert snap.total("tok_total") == 3 and snap.total("tok_total", model_name="other") == 0
    assert not any(name.endswith("_created") for name, _ in snap.samples)
    assert [b for b, _ in snap.buckets("lat")] == [0.01, 0.1, 1.0, 10.0, INF]


def test_server_state_reads_the_server_metrics():
    metrics = ServerMetrics("tiny")
    ring = SnapshotRing(metrics.registry)
    metrics.on_scheduler_stats(SchedulerStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, num_kv_blocks=100,
                                              num_free_kv_blocks=75, prefix_cache_queries=100, prefix_cache_hits=40,
                                              num_preemptions=1))
    first = server_state(ring.advance(0.0), "tiny")
    assert first["kind"] == "server" and first["model"] == "tiny"
    assert first["requests"]["running"] == 3 and first["requests"]["waiting"] == 2
    assert first["kv_cache"] == {"blocks": 100, "used_blocks": 25, "free_blocks": 75, "usage": 0.25,
                                 "prefix_hit_rate": 0.4}
    assert first["throughput"]["output_tokens_per_s"] is None and first["preemptions"]["total"] == 1
    assert first["speculative"]["acceptance_rate"] is None and first["grammar_cache"]["hit_rate"] is None

    metrics.generation_tokens.inc(40)
    metrics.ttft.observe(0.03)
    metrics.on_scheduler_stats(SchedulerStats(prefix_cache_queries=100, prefix_cache_hits=100,
                                              spec=SpecDecodeStats(2, 8, 6, [3, 2, 1, 0])))
    later = server_state(ring.advance(2.0), "tiny")
    assert later["throughput"]["output_tokens_per_s"] == pytest.approx(20.0)
    assert later["kv_cache"]["prefix_hit_rate"] == 1.0  # the window starts at the poll at t=0: 100 of 100
    assert later["speculative"]["acceptance_rate"] == pytest.approx(0.75)
    assert later["latency"]["ttft"]["count"] == 1 and 0.02 <= later["latency"]["ttft"]["p50"] <= 0.04


def test_server_state_shows_expert_balance_only_for_moe_models():
    metrics = ServerMetrics("tiny")
    ring = SnapshotRing(metrics.registry)
    metrics.on_scheduler_stats(SchedulerStats(num_running=1))  # a dense model's step: no balance
    assert server_state(ring.advance(0.0), "tiny")["moe"] is None
    for balance in (1.2, 1.2, 1.2, 3.5):
        metrics.on_scheduler_stats(SchedulerStats(num_running=1, expert_balance=balance))
    moe = server_state(ring.advance(1.0), "tiny")["moe"]
    load = moe["load_max_over_mean"]
    assert moe["steps"] == 4 and load["count"] == 4
    assert 1.1 <= load["p50"] <= 1.25 and 3.0 <= load["p99"] <= 4.0


def make_gateway() -> Gateway:
    pools = (PoolSpec("m", (BackendSpec("http://a:1"), BackendSpec("http://b:1"))),)
    setup = RouterSetup(RouterConfig(), pools, AutoRouteConfig(), AutoscaleConfig(), {})
    client = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(200)))
    return Gateway(setup, upstream=MockUpstream(client))


def test_router_state_has_a_row_per_pool_and_backend():
    gw = make_gateway()
    ring = SnapshotRing(gw.metrics.registry)
    router_state(ring.advance(0.0), gw)
    a, b = gw.pools["m"].backends
    a.num_in_flight = 2
    b.health.state = HealthState.EJECTED
    for _ in range(6):
        gw.metrics.requests.labels("m", a.url, "200").inc()
    gw.metrics.requests.labels("m", a.url, "503").inc()
    gw.metrics.request_duration.labels("m").observe(0.3)
    state = router_state(ring.advance(2.0), gw)
    assert [p["name"] for p in state["pools"]] == ["m"] and state["models"] == ["m"]
    pool = state["pools"][0]
    assert pool["backends"] == 2 and pool["backends_up"] == 1 and pool["in_flight"] == 2
    assert pool["requests_per_s"] == pytest.approx(3.5) and pool["autoscaler"] is None
    rows = {row["url"]: row for row in state["backends"]}
    assert rows[a.url]["health"] == "healthy" and rows[a.url]["routed"] == 7 and rows[a.url]["errors_in_window"] == 1
    assert rows[b.url]["health"] == "ejected" and not rows[b.url]["up"] and rows[b.url]["routed"] == 0
    assert state["totals"]["backends_up"] == 1 and state["totals"]["duration"]["count"] == 1
    assert rows[a.url]["adapters"] == [] and rows[a.url]["resident_adapters"] == []


def test_router_state_lists_each_backends_adapters_and_those_in_its_slots():
    gw = make_gateway()
    a, b = gw.pools["m"].backends
    a.adapters = frozenset({"sql", "chat", "legal"})
    a.scraped = dataclasses.replace(a.scraped, resident_adapters=frozenset({"sql"}))
    rows = {row["url"]: row for row in router_state(SnapshotRing(gw.metrics.registry).advance(0.0), gw)["backends"]}
    assert rows[a.url]["adapters"] == ["chat", "legal", "sql"] and rows[a.url]["resident_adapters"] == ["sql"]
    assert rows[b.url]["adapters"] == [] and rows[b.url]["resident_adapters"] == []


def test_router_state_shows_the_autoscaler_of_its_pool():
    gw = make_gateway()
    gw.metrics.replicas.labels("m").set(2)
    gw.metrics.scale_events.labels("m", "up").inc(3)
    gw.metrics.scale_events.labels("m", "down").inc()
    state = router_state(SnapshotRing(gw.metrics.registry).advance(0.0), gw)
    assert state["pools"][0]["autoscaler"] == {"replicas": 2, "scale_up": 3, "scale_down": 1,
                                               "decisions_in_window": 4}


def test_server_state_shows_the_kv_tiers_only_once_they_moved():
    metrics = ServerMetrics("tiny")
    ring = SnapshotRing(metrics.registry)
    assert server_state(ring.advance(0.0), "tiny")["kv_tiers"] is None
    metrics.on_scheduler_stats(SchedulerStats(kv_tiers=KVTierStats(num_host_hit_tokens=32, num_disk_hit_tokens=16,
                                                                   num_offloaded_blocks=5, num_received_blocks=3)))
    tiers = server_state(ring.advance(2.0), "tiny")["kv_tiers"]
    assert tiers == {"host_hit_tokens": 32, "disk_hit_tokens": 16, "offloaded_blocks": 5, "corrupt_blocks": 0,
                     "sent_blocks": 0, "received_blocks": 3, "hit_tokens_per_s": 24.0}


def test_server_state_shows_adapters_and_their_traffic_only_with_lora():
    from types import SimpleNamespace

    from llmserve.lora_request import LoRARequest
    from llmserve.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason

    metrics = ServerMetrics("tiny")
    ring = SnapshotRing(metrics.registry)
    assert server_state(ring.advance(0.0), "tiny")["lora"] is None
    metrics.num_lora_adapters.set(2)
    for request_id, lora in (("1", LoRARequest("sql", 1, "/a")), ("2", None)):
        metrics.on_request_added(SimpleNamespace(request_id=request_id, arrival_time=0.0, prompt_token_ids=[1, 2],
                                                 lora=lora))
    assert server_state(ring.advance(1.0), "tiny")["lora"] == {"served": 2, "adapters": []}
    done = FinishReason.LENGTH
    metrics.on_engine_outputs(EngineCoreOutputs(outputs=[EngineCoreOutput("1", [5, 6, 7], finish_reason=done),
                                                         EngineCoreOutput("2", [5], finish_reason=done)]))
    lora = server_state(ring.advance(3.0), "tiny")["lora"]
    assert lora["served"] == 2 and [a["name"] for a in lora["adapters"]] == ["sql"]
    sql = lora["adapters"][0]
    assert sql["finished"] == 1 and sql["output_tokens"] == 3
