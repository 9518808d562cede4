"""Which path a CUDA tensor takes: the fused Triton elementwise kernels (model/triton_elementwise.py) or torch's
op chains, and the Triton GEMV (model/triton_gemv.py) or cuBLAS for a linear layer's few rows. Triton is
imported only when a CUDA tensor asks."""

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


GEMV_MAX_ROWS = 16  # the Triton GEMV's one tensor-core row tile


@functools.cache
def cuda_gemv_rows() -> int:
    """LLMSERVE_CUDA_GEMV_ROWS: linears of at most this many rows take the Triton GEMV on CUDA (0, the default:
    none, cuBLAS for every row count; at most GEMV_MAX_ROWS); read once a process."""
    value = os.environ.get("LLMSERVE_CUDA_GEMV_ROWS", "0")
    if not value.isdigit() or int(value) > GEMV_MAX_ROWS:
        raise ValueError(f"LLMSERVE_CUDA_GEMV_ROWS={value!r}: a row count from 0 to {GEMV_MAX_ROWS}")
    return int(value) if importlib.util.find_spec("triton") is not None else 0


def cuda_gemv(x: torch.Tensor, weight: torch.Tensor):
    """The Triton GEMV module when it takes `linear(x, weight)` on CUDA: x [M, K] of at most cuda_gemv_rows()
    rows, features contiguous, a 16-bit weight of x's dtype, outside autograd; else None (F.linear)."""
    if not (x.dim() == 2 and x.shape[0] <= cuda_gemv_rows() and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and x.stride(1) == 1 and weight.stride(1) == 1
            and not (torch.is_grad_enabled() and weight.requires_grad)):
        return None
    from llmserve.model import triton_gemv

    return triton_gemv


def gated_down(gate_up: torch.Tensor, down: torch.nn.Module) -> torch.Tensor | None:
    """down(silu(gate) * up) in one Triton GEMV launch where the GEMV takes down's rows (`cuda_gemv`) and down is
    a plain `Linear` (not row-parallel, LoRA-wrapped or quantized: their forwards add to the product); else None
    (triton_elementwise.silu_mul, then down)."""
    if gate_up.shape[0] > cuda_gemv_rows():  # every step's answer while the GEMV is off (the default)
        return None
    from llmserve.model.linear import Linear

    if type(down) is not Linear or down.weight is None or (gemv := cuda_gemv(gate_up, down.weight)) is None:
        return None
    return gemv.gemv(gate_up, down.weight, down.bias, is_gated=True)
