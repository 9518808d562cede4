"""Test helper: one function run in N spawned processes (gloo ranks on a free loopback port), each putting its
result on a queue; every process must exit cleanly."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable

from llmserve.router.replicas import free_port


def run_ranks(target: Callable, num_ranks: int, args_of: Callable[[int, int, object], tuple],
              timeout: float = 180) -> list:
    """target(*args_of(rank, port, results)) in a spawned process per rank -> what the ranks put on `results`,
    in the order it arrived."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=args_of(rank, port, results)) for rank in range(num_ranks)]
    for p in procs:
        p.start()
    got = [results.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0, f"a rank exited with {p.exitcode}"
    return got
