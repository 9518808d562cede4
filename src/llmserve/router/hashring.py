"""Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018).

Each backend owns `num_vnodes` points on a 64-bit ring. A key goes to the first backend clockwise from
its hash whose load is under the cap ceil((1 + epsilon) * (total_load + 1) / num_backends): the same key
keeps landing on the same backend (whose cache holds its prefix), yet when one key dominates, the
overflow walks on to the next backends instead of piling up on one.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Mapping, Sequence


def hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def load_cap(total_load: int, num_backends: int, epsilon: float) -> int:
    """Most requests one backend may hold, counting the one being placed."""
    return max(1, math.ceil((1.0 + epsilon) * (total_load + 1) / num_backends))


class HashRing:
    """An immutable ring over a set of backend names."""

    def __init__(self, names: Sequence[str], num_vnodes: int = 64) -> None:
        points = sorted((hash64(f"{name}#{i}".encode()), name) for name in names for i in range(num_vnodes))
        self.names = tuple(sorted(set(names)))
        self._hashes = [h for h, _ in points]
        self._owners = [name for _, name in points]

    def walk(self, key: bytes):
        """Distinct backend names in ring order from the key's position."""
        start = bisect.bisect(self._hashes, hash64(key))
        seen: set[str] = set()
        for i in range(len(self._owners)):
            name = self._owners[(start + i) % len(self._owners)]
            if name not in seen:
                seen.add(name)
                yield name
                if len(seen) == len(self.names):
                    return

    def lookup(self, key: bytes) -> str:
        """The key's home backend, ignoring load."""
        return next(self.walk(key))

    def lookup_bounded(self, key: bytes, loads: Mapping[str, int], epsilon: float) -> str:
        """The first backend from the key's position whose load is under the (1 + epsilon) cap."""
        cap = load_cap(sum(loads.get(n, 0) for n in self.names), len(self.names), epsilon)
        for name in self.walk(key):
            if loads.get(name, 0) < cap:
                return name
        return self.lookup(key)  # unreachable: some backend is always at or under the mean
