"""How many CPU threads the model's ops run on.

torch gives a process one intra-op thread per core. That suits a model whose steps are long matmuls,
but a small model's step is a few milliseconds of small ops: splitting them gains little, and the
extra OpenMP threads spin on cores that the HTTP front (tokenising, detokenising, one SSE event per
token) and anything beside it (a router, a client) need. Measured on 2 cores (docs/benchmarks.md,
"Engine threads"): the tiny model's server streams ~28% more tokens at c=64 on one thread, while the
smollm2-135m shape decodes ~27% slower on one. The rule splits the two by the model's size: under
SMALL_MODEL_PARAMS multiplied weights a token costs < 20 MFLOP, so even a full 512-token step is
~0.1 s on one core, about what the front spends on that step's tokens.

The rule is for an engine process that shares the machine with a server's front (`llmserve serve`).
An in-process engine (`LLM`) runs its front between steps, not beside them, and sets threads only
when asked, so that a process building several engines keeps the count it chose.

A served engine on a larger model also stays within the CPUs the process may use (`available_cpus`:
its affinity and a container's CPU quota): torch counts the host's cores, and OpenMP threads beyond the
quota wait at every barrier for a peer the kernel has descheduled.
"""

from __future__ import annotations

import math
import os

import torch

SMALL_MODEL_PARAMS = 10_000_000


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


def available_cpus() -> int:
    """CPUs this process may run on: its affinity, capped by a cgroup CPU quota (rounded up)."""
    num = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota()
    return max(1, min(num, math.ceil(quota))) if quota else num


def choose_num_threads(requested: int | None, num_params: int, device_type: str,
                       has_front_beside: bool, num_cpus: int | None = None, num_current: int = 1) -> int | None:
    """The thread count to set, or None to leave the process's (GPU engines, in-process engines).
    num_cpus: the CPUs available (a served CPU engine keeps its `num_current` threads within them)."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"num_threads must be >= 1, got {requested}")
        return requested
    if not has_front_beside or device_type != "cpu":
        return None
    if num_params < SMALL_MODEL_PARAMS:
        return 1
    return num_cpus if num_cpus is not None and num_current > num_cpus else None


def apply_num_threads(requested: int | None, model: torch.nn.Module, device_type: str,
                      has_front_beside: bool) -> int:
    """Set this process's intra-op threads for `model` (see the module doc); returns the count in use."""
    num_threads = choose_num_threads(requested, num_matmul_params(model), device_type, has_front_beside,
                                     available_cpus(), torch.get_num_threads())
    if num_threads is not None and num_threads != torch.get_num_threads():
        torch.set_num_threads(num_threads)
    return torch.get_num_threads()
