"""Runtime state of pools and backends: health, in-flight counts, scraped load, draining."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.router.admission import GatewayQueue
from llmserve.router.config import BackendSpec
from llmserve.router.health import BackendHealth, HealthState
from llmserve.router.policies import BackendLoad, RouteRequest, RoutingPolicy


@dataclass(frozen=True)
class ScrapedLoad:
    """What the backend's /metrics said last (zeros until the first scrape)."""

    num_waiting: float = 0.0
    num_running: float = 0.0
    kv_usage: float = 0.0
    num_adapters: float = 0.0  # LoRA adapters it serves by name
    resident_adapters: frozenset[str] = frozenset()  # those in its engine's slots (a request there swaps none)


@dataclass(eq=False)
class Backend:
    spec: BackendSpec
    pool: str
    health: BackendHealth
    num_in_flight: int = 0
    scraped: ScrapedLoad = field(default_factory=ScrapedLoad)
    is_draining: bool = False  # taking no new requests (autoscaler scale-down); stopped when empty
    model_card: dict | None = None  # its entry of GET /v1/models, learned by the health probes
    adapters: frozenset[str] = frozenset()  # the LoRA adapters it serves (GET /v1/models cards with a parent)

    @property
    def served_model(self) -> str | None:
        return self.model_card.get("id") if self.model_card else None

    @property
    def url(self) -> str:
        return self.spec.url

    def load(self) -> BackendLoad:
        s = self.scraped
        return BackendLoad(self.url, self.num_in_flight, s.num_waiting, s.num_running, s.kv_usage)

    def is_routable(self, now: float, max_in_flight: int) -> bool:
        return (not self.is_draining and self.num_in_flight < max_in_flight
                and self.health.is_routable(now))

    @property
    def is_up(self) -> bool:
        return self.health.state in (HealthState.HEALTHY, HealthState.HALF_OPEN) and not self.is_draining


class Pool:
    """One model name's backends behind one policy, with its gateway queue."""

    def __init__(self, name: str, upstream_model: str | None, policy: RoutingPolicy, max_in_flight_per_backend: int,
                 max_queued_requests: int) -> None:
        self.name = name
        self.upstream_model = upstream_model  # configured: the name its backends must serve (None: any)
        self.policy = policy
        self.max_in_flight_per_backend = max_in_flight_per_backend
        self.backends: list[Backend] = []
        self.queue = GatewayQueue(max_queued_requests)

    def add(self, backend: Backend) -> None:
        self.backends.append(backend)
        self.queue.notify_all()

    def remove(self, backend: Backend) -> None:
        self.backends.remove(backend)

    def pick(self, request: RouteRequest, now: float, exclude: frozenset[str] = frozenset()) -> Backend | None:
        """The policy's choice among routable backends (those not yet tried first; for a LoRA adapter's
        request, those that serve it first, and among them those holding it in a slot), marked dispatched."""
        routable = [b for b in self.backends if b.is_routable(now, self.max_in_flight_per_backend)]
        fresh = [b for b in routable if b.url not in exclude]
        candidates = fresh or routable
        holders = [b for b in candidates if request.model in b.adapters]
        resident = [b for b in holders if request.model in b.scraped.resident_adapters]
        candidates = resident or holders or candidates
        if not candidates:
            return None
        name = self.policy.choose(request, [b.load() for b in candidates])
        backend = next(b for b in candidates if b.url == name)
        backend.health.on_dispatch()
        backend.num_in_flight += 1
        return backend

    def model_of(self, backend: Backend, requested: str | None = None) -> str:
        """The model name to send `backend`: the adapter `requested` where it serves one by that name, else
        the configured one, else the one it serves, else the pool's."""
        if requested is not None and requested in backend.adapters:
            return requested
        return self.upstream_model or backend.served_model or self.name

    def has_adapter(self, name: str) -> bool:
        return any(name in backend.adapters for backend in self.backends)

    def release(self, backend: Backend) -> None:
        backend.num_in_flight -= 1
        self.queue.notify()

    def num_waiting(self) -> float:
        """Backends' scraped scheduler queues plus the gateway queue."""
        return sum(b.scraped.num_waiting for b in self.backends if b.is_up) + self.queue.num_waiting

    def num_in_flight(self) -> int:
        return sum(b.num_in_flight for b in self.backends)
