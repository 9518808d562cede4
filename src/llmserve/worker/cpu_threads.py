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
"""

from __future__ import annotations

import torch

SMALL_MODEL_PARAMS = 10_000_000


def num_matmul_params(model: torch.nn.Module) -> int:
    """Weights a token is multiplied by: all parameters, less the embedding table when it is not also
    the lm_head (a lookup reads one row of it). A quantized layer keeps its weights in buffers."""
    total = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    if getattr(model, "is_tied", True):
        return total
    return total - model.model.embed_tokens.weight.numel()


def choose_num_threads(requested: int | None, num_params: int, device_type: str,
                       has_front_beside: bool) -> int | None:
    """The thread count to set, or None to leave the process's (GPU engines, large CPU models)."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"num_threads must be >= 1, got {requested}")
        return requested
    if has_front_beside and device_type == "cpu" and num_params < SMALL_MODEL_PARAMS:
        return 1
    return None


def apply_num_threads(requested: int | None, model: torch.nn.Module, device_type: str,
                      has_front_beside: bool) -> int:
    """Set this process's intra-op threads for `model` (see the module doc); returns the count in use."""
    num_threads = choose_num_threads(requested, num_matmul_params(model), device_type, has_front_beside)
    if num_threads is not None and num_threads != torch.get_num_threads():
        torch.set_num_threads(num_threads)
    return torch.get_num_threads()
