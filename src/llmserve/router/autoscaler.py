"""The scaling rule, as a small pure component: samples in, decisions out (no processes, no clock).

Scale up by one when the waiting queue per replica (backends' scheduler queues plus the gateway's own
queue, divided by the replicas running or starting) stays above `target_waiting_per_replica` for
`scale_up_window_s`. Scale down by one when nothing is in flight or waiting for `scale_down_idle_s`.
After any decision, wait `cooldown_s` (a new replica needs time to load) before the next. The same
rule can drive local processes (router/replicas.py) or, later, a cluster's replica count.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ScaleAction(enum.Enum):
    NONE = 0
    UP = 1
    DOWN = -1


@dataclass(frozen=True)
class AutoscalePolicy:
    min_replicas: int = 1
    max_replicas: int = 4
    target_waiting_per_replica: float = 4.0
    scale_up_window_s: float = 10.0
    scale_down_idle_s: float = 60.0
    cooldown_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, "
                             f"got {self.min_replicas}..{self.max_replicas}")
        if self.target_waiting_per_replica < 0 or self.scale_up_window_s < 0 or self.scale_down_idle_s < 0:
            raise ValueError("autoscale target and windows must be >= 0")


@dataclass(frozen=True)
class LoadSample:
    now: float
    num_replicas: int  # running or starting (not draining)
    num_waiting: float  # backends' waiting queues + the gateway queue
    num_in_flight: int  # requests the router has open on backends


class Autoscaler:
    def __init__(self, policy: AutoscalePolicy) -> None:
        self.policy = policy
        self.busy_since: float | None = None  # start of the current over-target spell
        self.idle_since: float | None = None
        self.last_action_at: float | None = None

    def observe(self, sample: LoadSample) -> ScaleAction:
        self._track(sample)
        action = self._decide(sample)
        if action is not ScaleAction.NONE:
            self.last_action_at = sample.now
            self.busy_since = self.idle_since = None
        return action

    def _track(self, s: LoadSample) -> None:
        per_replica = s.num_waiting / max(1, s.num_replicas)
        is_over = per_replica > self.policy.target_waiting_per_replica
        self.busy_since = (self.busy_since if self.busy_since is not None else s.now) if is_over else None
        is_idle = s.num_waiting == 0 and s.num_in_flight == 0
        self.idle_since = (self.idle_since if self.idle_since is not None else s.now) if is_idle else None

    def _decide(self, s: LoadSample) -> ScaleAction:
        if s.num_replicas < self.policy.min_replicas:
            return ScaleAction.UP
        if s.num_replicas > self.policy.max_replicas:
            return ScaleAction.DOWN
        if self.last_action_at is not None and s.now - self.last_action_at < self.policy.cooldown_s:
            return ScaleAction.NONE
        if (self.busy_since is not None and s.now - self.busy_since >= self.policy.scale_up_window_s
                and s.num_replicas < self.policy.max_replicas):
            return ScaleAction.UP
        if (self.idle_since is not None and s.now - self.idle_since >= self.policy.scale_down_idle_s
                and s.num_replicas > self.policy.min_replicas):
            return ScaleAction.DOWN
        return ScaleAction.NONE
