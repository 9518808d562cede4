"""The router's configuration: frozen records, CLI flags generated from them, and the YAML file.

Precedence: a flag given on the command line (a value other than its default) beats the YAML file,
which beats the default. Pools come from the YAML `pools:` section and from `--backend MODEL=URL`.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from llmserve.config import check, check_min
from llmserve.router.classifier import AutoRouteConfig, DifficultyRule
from llmserve.router.policies import POLICY_NAMES
from llmserve.router.ratelimit import RateLimit
from llmserve.router.requests import PrefixConfig
from llmserve.router.upstream import Origin


@dataclass(frozen=True)
class RouterConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind (loopback by default)"})
    port: int = field(default=8080, metadata={"help": "TCP port (0: any free port, logged at startup)"})
    policy: str = field(default="least-load", metadata={"help": "routing policy of every pool (a pool may set its own)",
                                                        "choices": list(POLICY_NAMES)})
    load_factor: float = field(default=1.0, metadata={
        "help": "prefix-aware: epsilon of the bounded load; no backend takes more than (1+eps) x its share"})
    prefix_chars: int = field(default=256, metadata={"help": "prefix-aware: leading prompt characters hashed"})
    prefix_tokens: int = field(default=64, metadata={"help": "prefix-aware: leading token ids hashed (id prompts)"})
    auto_model: str = field(default="auto", metadata={"help": "model name routed by difficulty"})
    health_interval_s: float = field(default=2.0, metadata={"help": "seconds between /health probes"})
    health_timeout_s: float = field(default=2.0, metadata={"help": "timeout of one /health probe"})
    failure_threshold: int = field(default=3, metadata={"help": "consecutive failures that eject a backend"})
    cooldown_s: float = field(default=5.0, metadata={"help": "seconds an ejected backend rests before a trial"})
    scrape_interval_s: float = field(default=1.0, metadata={"help": "seconds between /metrics scrapes (0: off)"})
    max_retries: int = field(default=2, metadata={"help": "retries before the first byte (connect errors, 503)"})
    retry_backoff_s: float = field(default=0.05, metadata={"help": "first retry delay; doubles per retry"})
    connect_timeout_s: float = field(default=2.0, metadata={"help": "upstream connect timeout"})
    upstream_timeout_s: float = field(default=600.0, metadata={"help": "upstream read timeout (between bytes)"})
    max_in_flight_per_backend: int = field(default=1024, metadata={
        "help": "requests open on one backend; more wait in the gateway queue"})
    max_queued_requests: int = field(default=1024, metadata={
        "help": "requests waiting in the gateway queue; more get 503 + Retry-After"})
    queue_timeout_s: float = field(default=30.0, metadata={"help": "longest wait in the gateway queue (then 503)"})
    rate_limit_rps: float = field(default=0.0, metadata={"help": "requests/s per API key (0: no limit)"})
    rate_limit_burst: float = field(default=0.0, metadata={"help": "token-bucket size per key (0: max(1, rps))"})
    log_level: str = field(default="info", metadata={"help": "debug | info | warning | error",
                                                     "choices": ["debug", "info", "warning", "error"]})

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _check_nonnegative(self, ("load_factor", "cooldown_s", "scrape_interval_s",
                                  "max_retries", "retry_backoff_s", "max_queued_requests", "queue_timeout_s",
                                  "rate_limit_rps", "rate_limit_burst"))
        check(self.policy in POLICY_NAMES, "policy",
              f"unknown routing policy {self.policy!r} (choose from {', '.join(POLICY_NAMES)})")
        check(0 <= self.port < 65536, "port", f"must be in 0..65535, got {self.port}")
        _check_positive(self, ("health_interval_s", "health_timeout_s", "connect_timeout_s", "upstream_timeout_s"))
        for name in ("failure_threshold", "max_in_flight_per_backend", "prefix_chars", "prefix_tokens"):
            check_min(name.replace("_", "-"), getattr(self, name), 1)

    @property
    def prefix(self) -> PrefixConfig:
        return PrefixConfig(self.prefix_chars, self.prefix_tokens)

    @property
    def default_rate_limit(self) -> RateLimit | None:
        if self.rate_limit_rps == 0:
            return None
        return RateLimit(self.rate_limit_rps, self.rate_limit_burst or max(1.0, self.rate_limit_rps))


@dataclass(frozen=True)
class AutoscaleConfig:
    autoscale: bool = field(default=False, metadata={"help": "launch and stop local `llmserve serve` replicas"})
    min_replicas: int = field(default=1, metadata={"help": "autoscale: fewest replicas"})
    max_replicas: int = field(default=4, metadata={"help": "autoscale: most replicas"})
    target_waiting_per_replica: float = field(default=4.0, metadata={
        "help": "autoscale: add a replica when waiting requests per replica stay above this"})
    scale_up_window_s: float = field(default=10.0, metadata={"help": "autoscale: how long above target"})
    scale_down_idle_s: float = field(default=60.0, metadata={"help": "autoscale: idle seconds before removing one"})
    scale_cooldown_s: float = field(default=10.0, metadata={"help": "autoscale: seconds between decisions"})
    replica_model: str | None = field(default=None, metadata={
        "help": "autoscale: --model of the replicas (default: the embedded demo model, as `llmserve serve`)"})
    replica_pool: str = field(default="default", metadata={"help": "autoscale: model name (pool) they serve"})
    replica_args: str = field(default="", metadata={"help": "autoscale: more `llmserve serve` flags, one string"})
    replica_startup_timeout_s: float = field(default=300.0, metadata={"help": "autoscale: startup limit"})

    def validate(self) -> None:
        """Checked by the router's launch (loading.check_setup)."""
        check_min("min-replicas", self.min_replicas, 0)
        check(self.max_replicas >= max(1, self.min_replicas), "max-replicas",
              f"must be >= 1 and >= --min-replicas ({self.min_replicas}), got {self.max_replicas}")
        _check_nonnegative(self, ("target_waiting_per_replica", "scale_up_window_s", "scale_down_idle_s",
                                  "scale_cooldown_s"))
        _check_positive(self, ("replica_startup_timeout_s",))
        check(bool(self.replica_pool), "replica-pool", "must not be empty")


@dataclass(frozen=True)
class BackendSpec:
    url: str
    api_key: str | None = None  # sent upstream as Bearer (default: the client's Authorization header)

    def __post_init__(self) -> None:
        Origin.parse(self.url)  # a bad URL fails at startup (ValueError), not per request


@dataclass(frozen=True)
class PoolSpec:
    name: str  # the model name clients send
    backends: tuple[BackendSpec, ...] = ()
    policy: str | None = None  # None: RouterConfig.policy
    upstream_model: str | None = None  # the model name the backends serve (None: the pool's name)


@dataclass(frozen=True)
class RouterSetup:
    router: RouterConfig
    pools: tuple[PoolSpec, ...]
    auto: AutoRouteConfig
    autoscale: AutoscaleConfig
    key_rate_limits: dict[str, RateLimit]


def _check_nonnegative(obj: Any, names: tuple[str, ...]) -> None:
    for name in names:
        check_min(name.replace("_", "-"), getattr(obj, name), 0)


def _check_positive(obj: Any, names: tuple[str, ...]) -> None:
    for name in names:
        check(getattr(obj, name) > 0, name.replace("_", "-"), f"must be > 0, got {getattr(obj, name)}")


def build_record(cls: type, values: dict[str, Any], where: str):
    """A dataclass from a mapping, rejecting unknown keys (typos fail loudly)."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(names))})")
    hints = typing.get_type_hints(cls)
    return cls(**{k: tuple(v) if _is_tuple(hints[k]) and isinstance(v, list) else v for k, v in values.items()})


def _is_tuple(tp: Any) -> bool:
    return typing.get_origin(tp) is tuple
