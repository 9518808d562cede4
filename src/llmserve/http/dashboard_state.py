"""What the dashboards show, read from a prometheus_client registry (the same counters as /metrics).

Gauges are read as they are; counters become rates by differencing two snapshots of the registry;
latency percentiles over the last minute come from the histograms' cumulative bucket counts differenced
against a snapshot about a minute old (Prometheus's `histogram_quantile` over an `increase()`). The only
state kept is a short ring of snapshots (derived from the registry, never a second count).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

LabelKey = tuple[tuple[str, str], ...]

WINDOW_S = 60.0  # the window of the percentiles and hit rates
RATE_WINDOW_S = 2.0  # counters as rates over about this long
MIN_SPACING_S = 0.25  # polls closer than this to the last snapshot add none
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class Snapshot:
    """Every sample of a registry at one moment: {(sample name, sorted labels): value}."""

    time: float
    samples: dict[tuple[str, LabelKey], float]

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples named `name` whose labels include `labels`."""
        wanted = labels.items()
        return sum(v for (n, key), v in self.samples.items() if n == name and wanted <= dict(key).items())

    def label_values(self, name: str, label: str) -> list[str]:
        values = {dict(key).get(label) for n, key in self.samples if n == name}
        return sorted(v for v in values if v is not None)

    def buckets(self, name: str, **labels: str) -> list[tuple[float, float]]:
        """The histogram's cumulative counts by upper bound (`name` without `_bucket`), summed over series."""
        by_bound: dict[float, float] = {}
        wanted = labels.items()
        for (n, key), value in self.samples.items():
            label_map = dict(key)
            if n == name + "_bucket" and wanted <= label_map.items():
                bound = float(label_map["le"])
                by_bound[bound] = by_bound.get(bound, 0.0) + value
        return sorted(by_bound.items())


def take_snapshot(registry: CollectorRegistry, now: float) -> Snapshot:
    samples = {}
    for family in registry.collect():
        for s in family.samples:
            if not s.name.endswith("_created"):
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return Snapshot(now, samples)


def bucket_increase(new: list[tuple[float, float]], old: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Cumulative counts observed between two snapshots of one histogram (same bounds)."""
    before = dict(old)
    return [(bound, max(0.0, count - before.get(bound, 0.0))) for bound, count in new]


def histogram_quantile(q: float, cumulative: list[tuple[float, float]]) -> float | None:
    """The q-quantile of cumulative bucket counts, interpolated linearly inside its bucket (as Prometheus
    does: the first bucket starts at 0; a rank in the +Inf bucket answers the highest finite bound).
    None when nothing was observed."""
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    rank = q * cumulative[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in cumulative:
        if count >= rank and count > below:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def percentiles(cumulative: list[tuple[float, float]]) -> dict[str, float | None]:
    """{"p50", "p90", "p99"} and "count" (observations in the window)."""
    out: dict[str, float | None] = {f"p{round(q * 100)}": histogram_quantile(q, cumulative) for q in QUANTILES}
    out["count"] = cumulative[-1][1] if cumulative else 0.0
    return out


def ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


class SnapshotRing:
    """Recent snapshots of one registry, oldest first, spanning a little over WINDOW_S."""

    def __init__(self, registry: CollectorRegistry, window_s: float = WINDOW_S,
                 rate_window_s: float = RATE_WINDOW_S) -> None:
        self.registry = registry
        self.window_s = window_s
        self.rate_window_s = rate_window_s
        self.snapshots: deque[Snapshot] = deque()

    def advance(self, now: float) -> Window:
        """Snapshot the registry now; return it with its baselines for rates and for the window."""
        current = take_snapshot(self.registry, now)
        window = Window(current, self._rate_baseline(now), self._window_baseline(now))
        self._keep(current)
        return window

    def _rate_baseline(self, now: float) -> Snapshot | None:
        """The newest snapshot at least rate_window_s old, else the oldest there is."""
        old_enough = [s for s in self.snapshots if now - s.time >= self.rate_window_s]
        if old_enough:
            return old_enough[-1]
        return self.snapshots[0] if self.snapshots else None

    def _window_baseline(self, now: float) -> Snapshot | None:
        """The oldest snapshot no older than the window (a shorter window while the ring fills)."""
        fresh = [s for s in self.snapshots if now - s.time <= self.window_s]
        return fresh[0] if fresh else None

    def _keep(self, current: Snapshot) -> None:
        if not self.snapshots or current.time - self.snapshots[-1].time >= MIN_SPACING_S:
            self.snapshots.append(current)
        while self.snapshots and current.time - self.snapshots[0].time > self.window_s + self.rate_window_s:
            self.snapshots.popleft()


@dataclass(frozen=True)
class Window:
    """The current snapshot and two older ones: `rate_base` (~2 s back) and `window_base` (~60 s back)."""

    current: Snapshot
    rate_base: Snapshot | None
    window_base: Snapshot | None

    def gauge(self, name: str, **labels: str) -> float:
        return self.current.total(name, **labels)

    def rate(self, name: str, **labels: str) -> float | None:
        """Per second, between rate_base and now (None on the first poll)."""
        base = self.rate_base
        if base is None or self.current.time <= base.time:
            return None
        delta = self.current.total(name, **labels) - base.total(name, **labels)
        return max(0.0, delta) / (self.current.time - base.time)

    def increase(self, name: str, **labels: str) -> float:
        """Growth of a counter over the window (since start on the first poll)."""
        base = self.window_base.total(name, **labels) if self.window_base is not None else 0.0
        return max(0.0, self.current.total(name, **labels) - base)

    def latency(self, name: str, **labels: str) -> dict[str, float | None]:
        """Percentiles of the histogram `name` over the window (since start on the first poll)."""
        now = self.current.buckets(name, **labels)
        old = self.window_base.buckets(name, **labels) if self.window_base is not None else []
        return percentiles(bucket_increase(now, old))

    @property
    def window_s(self) -> float:
        return self.current.time - self.window_base.time if self.window_base is not None else 0.0
