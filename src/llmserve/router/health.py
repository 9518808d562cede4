"""A backend's health as a small state machine (pure: the caller passes the clock).

    STARTING --success--> HEALTHY --K consecutive failures--> EJECTED
    EJECTED --cool-down elapsed--> HALF_OPEN (one trial: a probe or a request)
    HALF_OPEN --success--> HEALTHY        HALF_OPEN --failure--> EJECTED (cool-down starts again)

Failures are connect errors, timeouts, cut streams, 503s and failed /health probes, whether seen by
the active prober or by a real request (passive). A success resets the consecutive-failure count.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class HealthState(enum.Enum):
    STARTING = "starting"  # launched, not yet answered a probe: not routable
    HEALTHY = "healthy"
    EJECTED = "ejected"
    HALF_OPEN = "half_open"


@dataclass
class BackendHealth:
    failure_threshold: int = 3
    cooldown_s: float = 5.0
    state: HealthState = HealthState.HEALTHY
    num_consecutive_failures: int = 0
    ejected_at: float = 0.0
    num_ejections: int = 0
    is_trial_in_flight: bool = False

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError(f"failure threshold must be >= 1, got {self.failure_threshold}")
        if self.cooldown_s < 0:
            raise ValueError(f"cool-down must be >= 0, got {self.cooldown_s}")

    def refresh(self, now: float) -> HealthState:
        """Move EJECTED to HALF_OPEN once the cool-down has passed; returns the state."""
        if self.state is HealthState.EJECTED and now - self.ejected_at >= self.cooldown_s:
            self.state = HealthState.HALF_OPEN
            self.is_trial_in_flight = False
        return self.state

    def is_routable(self, now: float) -> bool:
        state = self.refresh(now)
        return state is HealthState.HEALTHY or (state is HealthState.HALF_OPEN and not self.is_trial_in_flight)

    def should_probe(self, now: float) -> bool:
        """Ejected backends are left alone until their cool-down is over."""
        return self.refresh(now) is not HealthState.EJECTED

    def on_dispatch(self) -> None:
        """A request was sent to it: in HALF_OPEN that request is the one trial."""
        if self.state is HealthState.HALF_OPEN:
            self.is_trial_in_flight = True

    def record_success(self) -> None:
        self.num_consecutive_failures = 0
        self.is_trial_in_flight = False
        if self.state is not HealthState.EJECTED:
            self.state = HealthState.HEALTHY

    def record_failure(self, now: float) -> bool:
        """Count a failure; True when it ejected the backend just now."""
        self.num_consecutive_failures += 1
        self.is_trial_in_flight = False
        if self.state is HealthState.HALF_OPEN or (
                self.state is HealthState.HEALTHY and self.num_consecutive_failures >= self.failure_threshold):
            self.state = HealthState.EJECTED
            self.ejected_at = now
            self.num_ejections += 1
            return True
        return False
