"""Routing policies: one interface, `choose(request, candidates) -> backend name`, pluggable by name.

A policy sees only routable backends (healthy or half-open, not draining, under their in-flight cap)
as `BackendLoad` snapshots, and never an empty list. Policies keep only their own bookkeeping (a
round-robin counter, a cached hash ring); health, retries and queueing live elsewhere.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from llmserve.router.hashring import HashRing, load_cap


@dataclass(frozen=True)
class RouteRequest:
    """What a policy (and the difficulty classifier) may look at of one request."""

    model: str
    prefix: bytes = b""  # the prompt's leading blocks (see requests.prefix_key); b"" when unknown
    user: str | None = None
    num_prompt_chars: int = 0
    max_tokens: int | None = None
    prompt_text: str = ""  # for the classifier's keyword rules (token-id prompts: "")
    is_stream: bool = False


@dataclass(frozen=True)
class BackendLoad:
    """One backend's load as the router knows it: its own count plus what the backend's /metrics said."""

    name: str
    num_in_flight: int = 0  # requests this router has open on it
    num_waiting: float = 0.0  # scraped: requests queued in the backend's scheduler
    num_running: float = 0.0  # scraped
    kv_usage: float = 0.0  # scraped: fraction of KV blocks in use (0..1)


class RoutingPolicy(ABC):
    """Picks one of the candidates for a request. Contract: `candidates` is non-empty, names unique;
    the result is one of their names. May keep state across calls; must not block."""

    name: ClassVar[str]

    @abstractmethod
    def choose(self, request: RouteRequest, candidates: Sequence[BackendLoad]) -> str: ...


class RoundRobin(RoutingPolicy):
    name = "round-robin"

    def __init__(self) -> None:
        self.num_routed = 0

    def choose(self, request: RouteRequest, candidates: Sequence[BackendLoad]) -> str:
        picked = candidates[self.num_routed % len(candidates)]
        self.num_routed += 1
        return picked.name


class LeastLoad(RoutingPolicy):
    """Lowest score = in-flight + waiting_weight * waiting + kv_weight * KV usage; ties rotate."""

    name = "least-load"

    def __init__(self, waiting_weight: float = 1.0, kv_weight: float = 2.0) -> None:
        self.waiting_weight = waiting_weight
        self.kv_weight = kv_weight
        self.num_routed = 0

    def score(self, load: BackendLoad) -> float:
        return load.num_in_flight + self.waiting_weight * load.num_waiting + self.kv_weight * load.kv_usage

    def choose(self, request: RouteRequest, candidates: Sequence[BackendLoad]) -> str:
        best = min(self.score(c) for c in candidates)
        tied = [c for c in candidates if self.score(c) <= best + 1e-9]
        self.num_routed += 1
        return tied[self.num_routed % len(tied)].name


class _RingCache:
    def __init__(self) -> None:
        self._ring: HashRing | None = None

    def ring(self, candidates: Sequence[BackendLoad]) -> HashRing:
        names = tuple(sorted(c.name for c in candidates))
        if self._ring is None or self._ring.names != names:
            self._ring = HashRing(names)
        return self._ring


class PrefixAware(RoutingPolicy):
    """Prefix-aware consistent hashing with two bounds; no prefix: least-load.

    Placement: a prefix seen for the first time is owned by the first backend, walking the hash ring from
    the prefix's hash, that owns fewer than its share ceil((K + 1) / n) of the K prefixes known (bounded-
    load consistent hashing on the number of prefixes, epsilon 0): each replica caches about 1/n of them,
    where plain hashing of a handful of system prompts can put most on one replica. The owner stays put
    (an LRU table of `max_prefixes` keys) while it is a candidate.
    Load: the owner takes the request while its in-flight count is under ceil((1 + eps) (total + 1) / n);
    otherwise the ring walk from the prefix's hash goes on to the first backend under that cap.
    """

    name = "prefix-aware"

    def __init__(self, epsilon: float = 1.0, max_prefixes: int = 8192) -> None:
        if epsilon < 0:
            raise ValueError(f"the load factor epsilon must be >= 0, got {epsilon}")
        self.epsilon = epsilon
        self.max_prefixes = max_prefixes
        self.rings = _RingCache()
        self.fallback = LeastLoad()
        self.owners: OrderedDict[bytes, str] = OrderedDict()  # prefix -> backend, least recently used first
        self.num_owned: Counter[str] = Counter()

    def choose(self, request: RouteRequest, candidates: Sequence[BackendLoad]) -> str:
        if not request.prefix:
            return self.fallback.choose(request, candidates)
        ring = self.rings.ring(candidates)
        loads = {c.name: c.num_in_flight for c in candidates}
        owner = self._owner(request.prefix, ring)
        if loads[owner] < load_cap(sum(loads.values()), len(loads), self.epsilon):
            return owner
        return ring.lookup_bounded(request.prefix, loads, self.epsilon)

    def _owner(self, key: bytes, ring: HashRing) -> str:
        owner = self.owners.get(key)
        if owner in ring.names:
            self.owners.move_to_end(key)
            return owner
        if owner is not None:
            self._forget(key)
        num_known = sum(self.num_owned[n] for n in ring.names)
        share = -(-(num_known + 1) // len(ring.names))
        owner = next(n for n in ring.walk(key) if self.num_owned[n] < share)
        self.owners[key] = owner
        self.num_owned[owner] += 1
        if len(self.owners) > self.max_prefixes:
            self._forget(next(iter(self.owners)))
        return owner

    def _forget(self, key: bytes) -> None:
        self.num_owned[self.owners.pop(key)] -= 1


class SessionAffinity(RoutingPolicy):
    """Consistent hashing of the `user` field (sticky while the backend set holds); no user: least-load."""

    name = "session-affinity"

    def __init__(self) -> None:
        self.rings = _RingCache()
        self.fallback = LeastLoad()

    def choose(self, request: RouteRequest, candidates: Sequence[BackendLoad]) -> str:
        if not request.user:
            return self.fallback.choose(request, candidates)
        return self.rings.ring(candidates).lookup(request.user.encode())


POLICY_NAMES = (RoundRobin.name, LeastLoad.name, PrefixAware.name, SessionAffinity.name)


def make_policy(name: str, epsilon: float = 1.0) -> RoutingPolicy:
    """A fresh policy by name (each pool gets its own: the bookkeeping is per pool)."""
    if name == PrefixAware.name:
        return PrefixAware(epsilon)
    factories = {RoundRobin.name: RoundRobin, LeastLoad.name: LeastLoad, SessionAffinity.name: SessionAffinity}
    if name not in factories:
        raise ValueError(f"unknown routing policy {name!r} (choose from {', '.join(POLICY_NAMES)})")
    return factories[name]()
