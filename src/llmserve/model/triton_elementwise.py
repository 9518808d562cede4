"""Fused elementwise kernels for CUDA (Triton): RMSNorm with and without the residual add, SiLU-and-mul, and the
rotary embedding (in place).

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
def silu_times_up(gate, up):
    """silu(gate) * up in gate's dtype, rounded where torch's chain rounds (F.silu to the input dtype, then the
    product): the GEMV's gated load (model/triton_gemv.py) forms the same values."""
    gate32 = gate.to(tl.float32)
    silu = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype)
    return (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_mul_kernel(out_ptr, gate_up_ptr, width, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    is_col = offs < width
    gate = tl.load(gate_up_ptr + row * stride_g + offs, mask=is_col, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_g + width + offs, mask=is_col, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, silu_times_up(gate, up), mask=is_col)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, stride_t, stride_h, stride_c, HALF: tl.constexpr,
                   BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    is_col = offs < HALF
    base = x_ptr + token * stride_t + head * stride_h
    x1 = tl.load(base + offs, mask=is_col, other=0.0)
    x2 = tl.load(base + HALF + offs, mask=is_col, other=0.0)
    cos = tl.load(cos_ptr + token * stride_c + offs, mask=is_col, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_c + offs, mask=is_col, other=0.0).to(tl.float32)
    dtype = x1.dtype
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    # each product and sum rounded to x's dtype, as torch's x1 * cos - x2 * sin computes it (compiled for CUDA
    # these roundings were seen to fold: an H200 gave values rounded once, at most a step of the larger term apart)
    out1 = ((a * cos).to(dtype).to(tl.float32) - (b * sin).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((b * cos).to(dtype).to(tl.float32) + (a * sin).to(dtype).to(tl.float32)).to(dtype)
    tl.store(base + offs, out1, mask=is_col)
    tl.store(base + HALF + offs, out2, mask=is_col)


def can_rotate(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """x [T, heads, D] with contiguous features on CUDA, cos [T, 1, R/2] in x's dtype, the whole head rotated."""
    return (x.is_cuda and x.dim() == 3 and x.stride(2) == 1 and x.dtype in (torch.float32, torch.bfloat16,
            torch.float16) and cos.dtype == x.dtype and 2 * cos.shape[-1] == x.shape[-1] and cos.stride(-1) == 1)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style (rotate-half) rotary embedding of x [T, heads, D] in place, cos/sin [T, 1, D/2]; returns x."""
    num_tokens, num_heads, head_dim = x.shape
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens, num_heads)](x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), HALF=half,
                                                BLOCK=triton.next_power_of_2(half), num_warps=1)
    return x


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
