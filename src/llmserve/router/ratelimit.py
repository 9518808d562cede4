"""Per-API-key token buckets (pure: the caller passes the clock). One request costs one token."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class RateLimit:
    rate: float  # tokens (requests) added per second
    burst: float  # bucket size: requests allowed at once after an idle spell

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.burst < 1:
            raise ValueError(f"a rate limit needs rate > 0 and burst >= 1, got rate={self.rate} burst={self.burst}")


@dataclass
class TokenBucket:
    limit: RateLimit
    num_tokens: float
    updated_at: float

    @classmethod
    def full(cls, limit: RateLimit, now: float) -> TokenBucket:
        return cls(limit, limit.burst, now)

    def _refill(self, now: float) -> None:
        elapsed = max(0.0, now - self.updated_at)
        self.num_tokens = min(self.limit.burst, self.num_tokens + elapsed * self.limit.rate)
        self.updated_at = max(self.updated_at, now)

    def try_take(self, now: float, cost: float = 1.0) -> bool:
        self._refill(now)
        if self.num_tokens >= cost:
            self.num_tokens -= cost
            return True
        return False

    def seconds_until(self, now: float, cost: float = 1.0) -> float:
        self._refill(now)
        return max(0.0, (cost - self.num_tokens) / self.limit.rate)


class RateLimiter:
    """A bucket per API key; keys without their own limit share the default (None: unlimited)."""

    def __init__(self, default: RateLimit | None, per_key: Mapping[str, RateLimit] | None = None,
                 max_keys: int = 100_000) -> None:
        self.default = default
        self.per_key = dict(per_key or {})
        self.max_keys = max_keys
        self.buckets: dict[str, TokenBucket] = {}

    @property
    def is_enabled(self) -> bool:
        return self.default is not None or bool(self.per_key)

    def check(self, key: str, now: float) -> float | None:
        """None when allowed (a token was taken); else the seconds to wait (for Retry-After)."""
        limit = self.per_key.get(key, self.default)
        if limit is None:
            return None
        bucket = self.buckets.get(key)
        if bucket is None:
            if len(self.buckets) >= self.max_keys:
                self._forget_full(now)
            bucket = self.buckets[key] = TokenBucket.full(limit, now)
        if bucket.try_take(now):
            return None
        return bucket.seconds_until(now)

    def _forget_full(self, now: float) -> None:
        """Drop buckets that refilled (they hold no information), so unknown keys cannot grow memory."""
        for key in [k for k, b in self.buckets.items() if b.seconds_until(now, b.limit.burst) == 0.0]:
            del self.buckets[key]


def retry_after_header(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))
