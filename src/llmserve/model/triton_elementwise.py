"""Fused elementwise kernels for CUDA (Triton): RMSNorm with and without the residual add, and SiLU-and-mul.

Unfused, each is a chain of torch kernels (the norm's add, upcast, square, mean, rsqrt, two products, cast:
about eight launches per norm, 65 norms in an 8B decoder), each reading and writing the whole activation;
fused, one launch reads the rows once. The results round as the torch code in model/layers.py does (float32
math, the normed rows cast to the input dtype before the weight's product), row by row, so a row's values do
not depend on its batch. Off CUDA they run through Triton's interpreter (tests only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(out_ptr, x_ptr, residual_ptr, weight_ptr, eps, hidden, stride_x, stride_r, stride_o,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    is_col = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=is_col, other=0.0)
    if HAS_RESIDUAL:  # residual <- x + residual, rounded to the input dtype, then normed
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + offs, mask=is_col, other=0.0)
             .to(tl.float32)).to(x.dtype)
        tl.store(residual_ptr + row * stride_r + offs, x, mask=is_col)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / hidden
    normed = (x32 * tl.math.rsqrt(variance + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + offs, mask=is_col, other=0.0)
    out = (weight.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, out, mask=is_col)


@triton.jit
def _silu_mul_kernel(out_ptr, gate_up_ptr, width, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    is_col = offs < width
    gate = tl.load(gate_up_ptr + row * stride_g + offs, mask=is_col, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_g + width + offs, mask=is_col, other=0.0)
    gate32 = gate.to(tl.float32)
    silu = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype)  # F.silu rounds to the input dtype
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, out, mask=is_col)


def can_fuse(x: torch.Tensor) -> bool:
    """2-D rows with contiguous features on CUDA, in a float dtype the kernels take."""
    return (x.is_cuda and x.dim() == 2 and x.stride(1) == 1
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16))


def _norm_warps(block: int) -> int:
    return min(16, max(1, block // 512))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] -> weight * x / rms(x) [T, H], as RMSNorm.forward without a residual."""
    out = torch.empty_like(x)
    _launch_norm(out, x, None, weight, eps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, H] -> (normed(x + residual), x + residual); the sum is written into `residual`."""
    out = torch.empty_like(x)
    _launch_norm(out, x, residual, weight, eps)
    return out, residual


def _launch_norm(out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> None:
    num_rows, hidden = x.shape
    if num_rows == 0:
        return
    block = triton.next_power_of_2(hidden)
    has_residual = residual is not None
    _rms_norm_kernel[(num_rows,)](
        out, x, residual if has_residual else x, weight, eps, hidden, x.stride(0),
        residual.stride(0) if has_residual else 0, out.stride(0), HAS_RESIDUAL=has_residual, BLOCK=block,
        num_warps=_norm_warps(block))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate columns first) -> silu(gate) * up [T, I]."""
    num_rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_rows, width), dtype=gate_up.dtype, device=gate_up.device)
    if num_rows:
        block = 1024
        _silu_mul_kernel[(num_rows, triton.cdiv(width, block))](out, gate_up, width, gate_up.stride(0),
                                                                out.stride(0), BLOCK=block, num_warps=4)
    return out
