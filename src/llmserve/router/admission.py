"""The gateway queue: requests wait here (FIFO, bounded) while no backend of their pool can take them,
because all are at their in-flight cap, ejected or still starting."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.25  # waiters also re-check this often, so a missed wake-up costs at most this


class QueueFull(Exception):
    """The gateway queue is at its bound (-> 503 + Retry-After)."""


class QueueTimeout(Exception):
    """Waited the whole queue timeout for a backend (-> 503 + Retry-After)."""


class GatewayQueue:
    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self._waiters: dict[_Waiter, None] = {}  # insertion-ordered: FIFO with O(1) removal

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, try_pick: Callable[[], T | None], timeout: float) -> T:
        """`try_pick()` at once when nobody waits, else wait in line until it returns something."""
        if not self._waiters:
            picked = try_pick()
            if picked is not None:
                return picked
        if len(self._waiters) >= self.max_waiting:
            raise QueueFull()
        return await self._wait(try_pick, asyncio.get_running_loop().time() + timeout)

    async def _wait(self, try_pick: Callable[[], T | None], deadline: float) -> T:
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future())
        self._waiters[waiter] = None
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise QueueTimeout()
                await asyncio.wait({waiter.fut}, timeout=min(remaining, POLL_S))
                if waiter.fut.done() or next(iter(self._waiters)) is waiter:
                    picked = try_pick()
                    if picked is not None:
                        return picked
                if waiter.fut.done():  # woken, nothing to take: wait again, keeping our place
                    waiter.fut = loop.create_future()
        finally:
            del self._waiters[waiter]
            self.notify()  # what freed up may serve the next one too

    def notify(self, num: int = 1) -> None:
        """Wake the first `num` waiters (a request finished, a backend came back)."""
        for waiter in itertools.islice(self._waiters, num):
            if not waiter.fut.done():
                waiter.fut.set_result(None)

    def notify_all(self) -> None:
        self.notify(len(self._waiters))


class _Waiter:
    __slots__ = ("fut",)

    def __init__(self, fut: asyncio.Future) -> None:
        self.fut = fut
