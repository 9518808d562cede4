"""The router's state, in one object the routes share: pools, the upstream HTTP client (one for relayed
requests and background probes alike), metrics, rate limiter, and the health bookkeeping that both active
probes and real requests feed."""

from __future__ import annotations

import logging
import time

from llmserve.http.errors import APIError
from llmserve.router.backends import Backend, Pool
from llmserve.router.classifier import RouteDecision, classify
from llmserve.router.config import BackendSpec, RouterConfig, RouterSetup
from llmserve.router.health import BackendHealth, HealthState
from llmserve.router.metrics import RouterMetrics
from llmserve.router.policies import RouteRequest, make_policy
from llmserve.router.ratelimit import RateLimiter
from llmserve.router.upstream import Upstream, UpstreamPool

logger = logging.getLogger("llmserve.router")


class Gateway:
    def __init__(self, setup: RouterSetup, upstream: Upstream | None = None) -> None:
        """Requests, probes and scrapes go through `upstream` (by default the connection pool of
        upstream.py); tests pass in-memory ones."""
        self.setup = setup
        self.config = setup.router
        self.metrics = RouterMetrics()
        self.limiter = RateLimiter(self.config.default_rate_limit, setup.key_rate_limits)
        self.upstream: Upstream = upstream or UpstreamPool(self.config.connect_timeout_s,
                                                           self.config.upstream_timeout_s)
        self.pools: dict[str, Pool] = {}
        for spec in setup.pools:
            pool = self.ensure_pool(spec.name, spec.policy, spec.upstream_model)
            for backend in spec.backends:
                self.add_backend(pool, backend)
        if setup.autoscale.autoscale:
            self.ensure_pool(setup.autoscale.replica_pool)

    def ensure_pool(self, name: str, policy: str | None = None, upstream_model: str | None = None) -> Pool:
        if name not in self.pools:
            self.pools[name] = Pool(name, upstream_model, make_policy(policy or self.config.policy,
                                                                             self.config.load_factor),
                                    self.config.max_in_flight_per_backend, self.config.max_queued_requests)
        return self.pools[name]

    def add_backend(self, pool: Pool, spec: BackendSpec, state: HealthState = HealthState.HEALTHY) -> Backend:
        health = BackendHealth(self.config.failure_threshold, self.config.cooldown_s, state=state)
        backend = Backend(spec, pool.name, health)
        pool.add(backend)
        return backend

    def remove_backend(self, pool: Pool, backend: Backend) -> None:
        pool.remove(backend)
        self.upstream.forget(backend.url)
        for gauge in (self.metrics.healthy, self.metrics.in_flight):
            try:
                gauge.remove(pool.name, backend.url)
            except KeyError:
                pass

    # ---- health, fed by probes (monitor.py) and by requests (proxy.py) ----------------------------

    def record_success(self, backend: Backend) -> None:
        """A success; a backend back from ejection is logged once (its trial passed)."""
        was_state = backend.health.state
        backend.health.record_success()
        if was_state is not HealthState.HEALTHY and backend.health.state is HealthState.HEALTHY:
            self.pools[backend.pool].queue.notify_all()
            if was_state is HealthState.HALF_OPEN:
                logger.info("backend %s (model %s) recovered after %.1f s ejected: routable again", backend.url,
                            backend.pool, time.monotonic() - backend.health.ejected_at)

    def record_failure(self, backend: Backend) -> None:
        """A failure; an ejection from the healthy state is logged once (not each failed trial after it)."""
        was_state = backend.health.state
        if backend.health.record_failure(time.monotonic()):
            self.metrics.ejections.labels(backend.pool, backend.url).inc()
            if was_state is HealthState.HEALTHY:
                logger.warning("backend %s (model %s) ejected after %d consecutive failures; a trial every %.0f s "
                               "until one succeeds", backend.url, backend.pool,
                               backend.health.num_consecutive_failures, backend.health.cooldown_s)

    # ---- routing -----------------------------------------------------------------------------

    def resolve(self, request: RouteRequest) -> tuple[Pool, RouteDecision | None]:
        """The pool a request goes to: its model's, or the classifier's choice for the auto model."""
        auto = self.setup.auto
        if auto.is_enabled and request.model == auto.model:
            decision = classify(auto, request)
            self.metrics.auto_routes.labels(decision.pool, decision.reason).inc()
            return self.pools[decision.pool], decision
        if not request.model:
            return self.default_pool(), None
        pool = self.pools.get(request.model) or self._adapter_pool(request.model)
        if pool is None:
            raise APIError(404, f"The model `{request.model}` does not exist (this router serves "
                                f"{', '.join(self.model_names())}).", param="model", code="model_not_found")
        return pool, None

    def _adapter_pool(self, name: str) -> Pool | None:
        """The first pool some backend of which serves a LoRA adapter called `name` (learned from /v1/models)."""
        return next((pool for pool in self.pools.values() if pool.has_adapter(name)), None)

    def default_pool(self) -> Pool:
        """The pool of requests that name no model: the autoscaled one, else the first configured."""
        if self.setup.autoscale.autoscale:
            return self.pools[self.setup.autoscale.replica_pool]
        return next(iter(self.pools.values()))

    def any_pool(self) -> Pool:
        """For requests any replica can answer (GET /version, /info): the default pool while one of its
        backends is up, else the first pool with one up."""
        pools = [self.default_pool(), *self.pools.values()]
        return next((p for p in pools if any(b.is_up for b in p.backends)), pools[0])

    def model_names(self) -> list[str]:
        names = list(self.pools)
        return names + [self.setup.auto.model] if self.setup.auto.is_enabled else names

    def is_healthy(self) -> bool:
        return any(b.is_up for pool in self.pools.values() for b in pool.backends)

    def refresh_gauges(self) -> None:
        for pool in self.pools.values():
            self.metrics.queue_depth.labels(pool.name).set(pool.queue.num_waiting)
            for b in pool.backends:
                self.metrics.in_flight.labels(pool.name, b.url).set(b.num_in_flight)
                self.metrics.healthy.labels(pool.name, b.url).set(int(b.is_up))

    async def close(self) -> None:
        await self.upstream.aclose()
