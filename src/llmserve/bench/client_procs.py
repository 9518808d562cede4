"""A load level's requests sent from one or several client processes, and how busy the client was.

One Python process streaming hundreds of responses spends a core on its event loop, and a client at its limit
caps the figures it measures (docs/benchmarks.md, "H200, sixth run": a client at 103% of a core held c=256 to
a third of the server's rate). With P processes, process k sends requests k, k + P, ... with its share of the
concurrency (or of the open loop's cap, at its requests' arrival times); all start at one instant, which every
process reads alike (`time.perf_counter()` is the system's monotonic clock). Each reports the share of a core it
used, so that a run can say when its client was the bound.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import os
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from llmserve.bench.client import RequestRecord, Target, make_http_client, send_request
from llmserve.bench.datasets import BenchRequest
from llmserve.bench.load import SendFn, run_closed_loop, run_open_loop

STREAMS_PER_PROCESS = 128  # requests in flight per client process when the count is chosen (--client-processes 0)
BUSY_CLIENT_SHARE = 0.9  # a client process above this share of a core may have capped the level's figures
_DISPATCH_S = 0.25  # from handing the shards out to their common start


@dataclass(frozen=True)
class SliceRun:
    """Requests sent at one level to one server: their records (times from the common start), the wall time,
    and the busiest client process's CPU time over it."""

    records: list[RequestRecord]
    seconds: float
    client_cpu_share: float


def num_client_processes(setting: int, concurrency: int | None) -> int:
    """`setting` > 0: that many. 0: one per STREAMS_PER_PROCESS requests in flight (1 without a cap), at most a
    quarter of this machine's cores, so that the server beside it keeps the rest."""
    if setting > 0:
        return setting
    most = max(1, (os.cpu_count() or 1) // 4)
    return 1 if concurrency is None else min(most, -(-concurrency // STREAMS_PER_PROCESS))


async def send_slice(send: SendFn, requests: Sequence[BenchRequest], indices: Sequence[int], concurrency: int | None,
                     arrivals_s: Sequence[float] | None, start_at: float | None = None) -> SliceRun:
    """In this process: closed loop at `concurrency` (arrivals_s None), else open loop capped by it."""
    cpu = time.process_time()
    if arrivals_s is None:
        assert concurrency is not None
        records, seconds = await run_closed_loop(send, requests, indices, concurrency, start_at)
    else:
        records, seconds = await run_open_loop(send, requests, indices, arrivals_s, concurrency, start_at)
    return SliceRun(records, seconds, (time.process_time() - cpu) / max(seconds, 1e-9))


class ClientProcesses:
    """A pool of client processes, started (and each warmed) once for the whole run."""

    def __init__(self, num_processes: int) -> None:
        self.num_processes = num_processes
        self.pool = ProcessPoolExecutor(num_processes, mp_context=multiprocessing.get_context("spawn"))
        for ready in [self.pool.submit(_warm, 0.2) for _ in range(num_processes)]:
            ready.result()  # each task waits a little, so that every process starts and imports now

    async def send_slice(self, target: Target, requests: list[BenchRequest], indices: list[int],
                         concurrency: int | None, arrivals_s: list[float] | None, num: int) -> SliceRun:
        """The slice from `num` of the processes (<= the pool's), each with every num-th request."""
        assert 1 < num <= self.num_processes
        caps = [None if concurrency is None else max(1, concurrency // num + (k < concurrency % num))
                for k in range(num)]
        start_at = time.perf_counter() + _DISPATCH_S
        loop = asyncio.get_running_loop()
        shards = [loop.run_in_executor(self.pool, _send_shard, target, requests, indices[k::num], caps[k],
                                       None if arrivals_s is None else arrivals_s[k::num], start_at)
                  for k in range(num) if indices[k::num]]
        runs = await asyncio.gather(*shards)
        records = sorted((r for run in runs for r in run.records), key=lambda r: r.index)
        return SliceRun(records, max(run.seconds for run in runs), max(run.client_cpu_share for run in runs))

    def close(self) -> None:
        self.pool.shutdown()


def _warm(seconds: float) -> None:
    time.sleep(seconds)


def _send_shard(target: Target, requests: list[BenchRequest], indices: list[int], concurrency: int | None,
                arrivals_s: list[float] | None, start_at: float) -> SliceRun:
    """In a client process: its own event loop and connections."""
    async def run() -> SliceRun:
        async with make_http_client() as client:
            send = functools.partial(send_request, client, target)
            return await send_slice(send, requests, indices, concurrency, arrivals_s, start_at)

    return asyncio.run(run())
