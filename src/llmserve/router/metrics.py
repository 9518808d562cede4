"""The router's own Prometheus metrics (its own CollectorRegistry; names prefixed `llmserve_router:`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                    60.0, 120.0, 300.0)
P = "llmserve_router:"


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter(P + "requests", "Requests answered, by pool, backend and HTTP status.",
                                ["pool", "backend", "status"], registry=r)
        self.upstream_latency = Histogram(P + "upstream_latency_seconds",
                                          "Upstream request sent to response headers received.",
                                          ["pool", "backend"], buckets=_LATENCY_BUCKETS, registry=r)
        self.request_duration = Histogram(P + "request_duration_seconds", "Request arrival to last byte relayed.",
                                          ["pool"], buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge(P + "queue_depth", "Requests waiting in the gateway queue.", ["pool"], registry=r)
        self.in_flight = Gauge(P + "requests_in_flight", "Requests open on a backend.", ["pool", "backend"],
                               registry=r)
        self.ejections = Counter(P + "ejections", "Backends ejected after consecutive failures.",
                                 ["pool", "backend"], registry=r)
        self.healthy = Gauge(P + "backend_healthy", "1 when the backend is routable.", ["pool", "backend"],
                             registry=r)
        self.decisions = Counter(P + "routing_decisions", "Backends picked by the pool's policy.",
                                 ["pool", "backend", "policy"], registry=r)
        self.auto_routes = Counter(P + "auto_route_decisions", "`auto` model requests by chosen pool and reason.",
                                   ["pool", "reason"], registry=r)
        self.retries = Counter(P + "retries", "Upstream attempts retried (before the first byte).",
                               ["pool", "reason"], registry=r)
        self.rejected = Counter(P + "rejected", "Requests refused by admission (queue_full, queue_timeout, "
                                "rate_limited).", ["reason"], registry=r)
        self.stream_errors = Counter(P + "stream_errors", "Streams cut by the backend after they started.",
                                     ["pool", "backend"], registry=r)
        self.replicas = Gauge(P + "replicas", "Local replicas launched by the autoscaler (not draining).",
                              ["pool"], registry=r)
        self.scale_events = Counter(P + "scale_events", "Autoscaler decisions carried out.", ["pool", "action"],
                                    registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
