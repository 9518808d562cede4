"""Which elementwise path a CUDA tensor takes: the fused Triton kernels (model/triton_elementwise.py) or
torch's op chains. Triton is imported only when a CUDA tensor asks."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


def cuda_fused(x: torch.Tensor):
    """The fused Triton elementwise kernels (model/triton_elementwise.py) when they take x: CUDA rows with
    contiguous features, Triton installed, LLMSERVE_FUSED_ELEMENTWISE not `off`; else None (torch ops)."""
    if not x.is_cuda or not fused_elementwise_enabled():
        return None
    from llmserve.model import triton_elementwise

    return triton_elementwise if triton_elementwise.can_fuse(x) else None


@functools.cache
def fused_elementwise_enabled() -> bool:
    """LLMSERVE_FUSED_ELEMENTWISE=on (default) | off: the CUDA elementwise kernels fused or torch's chains
    (read once a process)."""
    value = os.environ.get("LLMSERVE_FUSED_ELEMENTWISE", "on")
    if value not in ("on", "off"):
        raise ValueError(f"LLMSERVE_FUSED_ELEMENTWISE={value!r}: choose on or off")
    return value == "on" and importlib.util.find_spec("triton") is not None


def cuda_rotary(x: torch.Tensor, cos: torch.Tensor):
    """The fused Triton rotary kernel when it takes x and cos (see cuda_fused), else None."""
    if not x.is_cuda or not fused_elementwise_enabled():
        return None
    from llmserve.model import triton_elementwise

    return triton_elementwise if triton_elementwise.can_rotate(x, cos) else None
