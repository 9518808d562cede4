"""Load shapes: closed loop at a fixed concurrency, and open loop on gamma-distributed arrivals."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from llmserve.bench.client import RequestRecord
from llmserve.bench.datasets import BenchRequest

SendFn = Callable[[BenchRequest, int], Awaitable[RequestRecord]]


def arrival_times(num: int, request_rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times (s from the start) of `num` requests: the first at 0, then gamma-distributed gaps.

    The gaps have mean 1/rate and shape `burstiness` (1.0: exponential, a Poisson process; lower is burstier,
    higher more regular; the gaps' coefficient of variation is 1/sqrt(burstiness)).
    """
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"request_rate and burstiness must be > 0, got {request_rate} and {burstiness}")
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=max(num - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])[:num]


async def _started(start_at: float | None) -> float:
    """The loop's start: now, or (several client processes starting together) `start_at`, waited for."""
    if start_at is None:
        return time.perf_counter()
    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    return start_at


async def run_closed_loop(send: SendFn, requests: Sequence[BenchRequest], indices: Sequence[int],
                          concurrency: int, start_at: float | None = None) -> tuple[list[RequestRecord], float]:
    """`concurrency` requests in flight: each finished one is replaced by the next. Returns records, wall time
    (both from the start: now, or `start_at`, a `time.perf_counter()` instant)."""
    pending = iter(indices)
    records: list[RequestRecord] = []

    async def worker() -> None:
        for i in pending:  # one iterator shared by the workers
            records.append(await send(requests[i], i))

    start = await _started(start_at)
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(indices)))))
    return _rebased(records, start), time.perf_counter() - start


async def run_open_loop(send: SendFn, requests: Sequence[BenchRequest], indices: Sequence[int],
                        arrivals_s: Sequence[float], max_concurrency: int | None,
                        start_at: float | None = None) -> tuple[list[RequestRecord], float]:
    """Each request sent at its arrival time (s from the start), waiting for a slot under `max_concurrency`."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    start = await _started(start_at)

    async def one(i: int, at_s: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, start + at_s - time.perf_counter()))
        arrived = time.perf_counter()
        async with slots:
            rec = await send(requests[i], i)
        rec.queue_s = rec.start_s - arrived
        return rec

    records = await asyncio.gather(*(one(i, at) for i, at in zip(indices, arrivals_s)))
    return _rebased(list(records), start), time.perf_counter() - start


def _rebased(records: list[RequestRecord], start: float) -> list[RequestRecord]:
    for rec in records:
        rec.start_s -= start
    return sorted(records, key=lambda r: r.index)
