"""How many CPU threads the model's ops run on.

torch gives a process one intra-op thread per core. That suits a model whose steps are long matmuls,
but a small model's step is a few milliseconds of small ops: splitting them gains little, and the
extra OpenMP threads spin on cores that the HTTP front (tokenising, detokenising, one SSE event per
token) and anything beside it (a router, a client) need. A served small model therefore runs on one
thread (docs/benchmarks.md, "Engine threads"); SMALL_MODEL_PARAMS splits small from large: under it a
token costs < 20 MFLOP, so even a full 512-token step is ~0.1 s on one core.

A served larger model runs one thread per CPU that is free when it starts: the CPUs the process may use
(its affinity, capped by a container's CPU quota) less those that other processes kept busy while
start-up watched /proc/stat for a moment. OpenMP threads beyond the free CPUs wait at every barrier for
a peer the kernel has descheduled: with a neighbour busy on one of two cores, two threads decode at half
the speed of one (docs/benchmarks.md, "The CPU engine under a noisy neighbour").

--num-threads, or OMP_NUM_THREADS in the environment, is the user's count and wins. An in-process
engine (`LLM`) runs its front between steps, not beside them, and keeps the process's count unless
asked, so that a process building several engines keeps the count it chose.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

SMALL_MODEL_PARAMS = 10_000_000
SAMPLE_WINDOW_S = 0.25  # long enough for a few scheduler ticks on every CPU (HZ >= 100)
MAX_XGRAMMAR_THREADS = 8  # xgrammar's compile and batch fill split their work over this many threads at most


@dataclass(frozen=True)
class CpuReading:
    """What start-up saw: the CPUs this process may run on, and how many of them sat idle meanwhile."""

    num_allowed: int  # affinity, capped by a cgroup CPU quota (rounded up)
    num_idle: float | None = None  # the allowed CPUs' idle shares summed over the window; None: not read

    @property
    def num_free(self) -> int:
        """The allowed CPUs that no other process is using (at least one)."""
        if self.num_idle is None:
            return self.num_allowed
        return max(1, min(self.num_allowed, round(self.num_idle)))


class ThreadChoice(NamedTuple):
    num_threads: int | None  # None: leave the process's count
    reason: str  # for the start-up line


def num_matmul_params(model: torch.nn.Module) -> int:
    """Weights a token is multiplied by: all parameters, less the embedding table when it is not also
    the lm_head (a lookup reads one row of it). A quantized layer keeps its weights in buffers."""
    total = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    if getattr(model, "is_tied", True):
        return total
    return total - model.model.embed_tokens.weight.numel()


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """The CPUs a cgroup quota allows this process (cgroup v2 cpu.max, else v1's cfs quota over its
    period), None without a quota."""
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        try:
            with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as q, \
                    open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as p:
                quota, period = q.read().strip(), p.read().strip()
        except OSError:
            return None
    if quota in ("max", "-1") or float(period) <= 0:
        return None
    return float(quota) / float(period)


def allowed_cpu_ids() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def available_cpus() -> int:
    """CPUs this process may run on: its affinity, capped by a cgroup CPU quota (rounded up)."""
    num = len(allowed_cpu_ids())
    quota = cgroup_cpu_quota()
    return max(1, min(num, math.ceil(quota))) if quota else num


def xgrammar_threads() -> int:
    """Threads for xgrammar's compiles and batch fills: the CPUs this process may use, at most
    MAX_XGRAMMAR_THREADS (a compile or a step's fill is short; past that the hand-offs cost more than they save)."""
    return min(MAX_XGRAMMAR_THREADS, available_cpus())


def read_cpu_times(path: str = "/proc/stat") -> dict[int, tuple[int, int]]:
    """Per CPU since boot, from /proc/stat's `cpuN` lines: (idle ticks, all ticks). Idle counts iowait;
    all is user..steal (guest time is inside user already). {} where the file cannot be read."""
    times = {}
    try:
        with open(path) as f:
            for line in f:
                name, *fields = line.split()
                if name.startswith("cpu") and name[3:].isdigit() and len(fields) >= 5:
                    ticks = [int(x) for x in fields[:8]]
                    times[int(name[3:])] = (ticks[3] + ticks[4], sum(ticks))
    except (OSError, ValueError):
        return {}
    return times


def idle_cpus(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], cpu_ids: set[int]) -> float:
    """The idle share of each of `cpu_ids` between two readings, summed (a CPU with no ticks between
    them counts as idle)."""
    total = 0.0
    for cpu in cpu_ids & before.keys() & after.keys():
        num_idle, num_all = after[cpu][0] - before[cpu][0], after[cpu][1] - before[cpu][1]
        total += min(1.0, num_idle / num_all) if num_all > 0 else 1.0
    return total


def measure_cpus(window_s: float = SAMPLE_WINDOW_S, stat_path: str = "/proc/stat") -> CpuReading:
    """The allowed CPUs and how many of them stayed idle over `window_s` (this process sleeps meanwhile)."""
    num_allowed = available_cpus()
    before = read_cpu_times(stat_path)
    if not before:
        return CpuReading(num_allowed)
    time.sleep(window_s)
    return CpuReading(num_allowed, idle_cpus(before, read_cpu_times(stat_path), allowed_cpu_ids()))


def omp_num_threads(environ=os.environ) -> int | None:
    """OMP_NUM_THREADS's (first) count, None when unset or not a positive integer (OpenMP warns of those
    itself and ignores them)."""
    first = environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


def choose_num_threads(requested: int | None, num_params: int, device_type: str, is_served: bool,
                       read_cpus: Callable[[], CpuReading] = measure_cpus, num_current: int = 1,
                       num_env: int | None = None) -> ThreadChoice:
    """The thread count to set and why. requested: --num-threads; num_env: OMP_NUM_THREADS (already
    torch's count, so kept); read_cpus: called only for a served larger CPU model."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"num_threads must be >= 1, got {requested}")
        return ThreadChoice(requested, "--num-threads")
    if num_env is not None:
        return ThreadChoice(None, "OMP_NUM_THREADS")
    if device_type != "cpu":
        return ThreadChoice(None, "torch's default")
    if not is_served:
        return ThreadChoice(None, "the process's count (in-process engine)")
    if num_params < SMALL_MODEL_PARAMS:
        return ThreadChoice(1, "a small model beside the HTTP front")
    return threads_for_free_cpus(read_cpus(), num_current)


def threads_for_free_cpus(cpus: CpuReading, num_current: int) -> ThreadChoice:
    """One thread per free CPU, never more than the process has now."""
    return ThreadChoice(min(num_current, cpus.num_free), f"{cpus.num_free} of {cpus.num_allowed} CPUs free at start-up")


def shared_by_ranks(num_ranks: int) -> ThreadChoice:
    """A CPU tensor-parallel engine's ranks split the CPUs the process may use."""
    num_cpus = available_cpus()
    return ThreadChoice(max(1, num_cpus // num_ranks), f"{num_cpus} CPUs shared by {num_ranks} ranks")


def apply_num_threads(requested: int | None, model: torch.nn.Module, device_type: str,
                      is_served: bool, num_ranks: int = 1) -> ThreadChoice:
    """Set this process's intra-op threads for `model` (see the module doc); returns the count in use
    and why. num_ranks: of a tensor-parallel engine (on CPU its ranks share the cores unless told otherwise)."""
    num_env = omp_num_threads()
    if requested is None and num_env is None and num_ranks > 1 and device_type == "cpu":
        choice = shared_by_ranks(num_ranks)
    else:
        choice = choose_num_threads(requested, num_matmul_params(model), device_type, is_served,
                                    measure_cpus, torch.get_num_threads(), num_env)
    if choice.num_threads is not None and choice.num_threads != torch.get_num_threads():
        torch.set_num_threads(choice.num_threads)
    return ThreadChoice(torch.get_num_threads(), choice.reason)
