"""Per-position seeds: a seeded request draws the same noise at the same output position whatever
its batch mates, after a preemption, and with or without speculative decoding."""

from __future__ import annotations


def position_seed(seed: int, position: int) -> int:
    """The seed of output position `position` of a request seeded with `seed`."""
    return (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) % (1 << 63)
