"""Triton kernels of the FP8 linear layer on CUDA (issue 20), for what torch's ops do slowly at decode sizes.

Measured on an H100 (docs/benchmarks.md, "FP8 on the H100"): per-token quantization of the activation
through torch is six kernels, 13-14 us a linear, as much as the GEMM it feeds; and `torch._scaled_mm`
reads an FP8 weight at only 1.0-1.4 TB/s for a handful of rows. Two kernels replace them:

- `quantize_rows`: one launch. A program per row finds its largest |x|, then writes x / scale in
  float8_e4m3fn and the scale (what `_per_token` + clamp + cast compute in torch).
- `fp8_gemv`: for up to GEMV_MAX_ROWS rows (0: off; the kernel takes up to 4), the whole layer in one
  launch: each program takes BLOCK_N output channels, quantizes the (few, small) activation rows to FP8
  exactly as `quantize_rows` does, and walks K accumulating x_q * w_q in float32, then scales by
  x_scale * w_scale. The products are `_scaled_mm`'s; the summation order is not, and through the next
  layer's per-token scale that difference reaches every element of the row, which is why it is off
  (greedy outputs then depend on the batch).

Both are checked on CPU through Triton's interpreter, on inputs whose FP8 values are exact (its
float32 -> float8 conversion goes wrong where a value rounds up into the next power of two), and on
CUDA in tests/gpu. The kernels' 448.0 and 1e-12 are linear.FP8_MAX and its smallest scale.
Measured on an H100 (scripts/gpu/fp8_probe.py; docs/benchmarks.md, "H100, third run"): quantize_rows
2.1-4.3 us a linear; the GEMV 10% faster than quantize_rows + `_scaled_mm` at one row, slower from 4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Rows up to this take the GEMV; more: quantize_rows + torch._scaled_mm (tensor cores). Off (0): on an H100
# (2026-11-27) one-row steps through the GEMV made batch-1 decode 1.15x bf16 (152.5 vs 132.7 tok/s) but broke
# greedy batching invariance (tests/gpu/test_gpu_quant.py: 5 of 8 sequences kept, the FP8 sums of a row
# differing by path feed the next layer's per-token scale); 1 turns it on. At 4 rows it took 1.9x its
# 1-row time, more than _scaled_mm for gate_up and down.
GEMV_MAX_ROWS = 0
GEMV_KERNEL_MAX_ROWS = 4  # what fp8_gemv accepts (its rows are unrolled)


@dataclass(frozen=True)
class GemvTiling:
    """How fp8_gemv splits the weight: BLOCK_N output channels a program, BLOCK_K of K a load. The
    default is the fastest of 27 tilings summed over the four Llama-3.1-8B linears at 1 and 4 rows on an
    H100 (fp8_probe.py --sweep: 385 us against 835 for 16 x 256 x 4 warps)."""

    block_n: int = 8
    block_k: int = 512
    num_warps: int = 2


GEMV_TILING = GemvTiling()


@triton.jit
def _row_scale(x_ptr, row, stride_x, K, BLOCK_K: tl.constexpr):
    """max |x[row, :]| / 448 (at least MIN_SCALE), in float32."""
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    return tl.maximum(tl.max(amax, axis=0) / 448.0, 1e-12)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    scale = _row_scale(x_ptr, row, stride_x, K, BLOCK_K)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (float8_e4m3fn [T, K], scales [T, 1] float32), one scale per row (token)."""
    rows, k = x.shape
    q = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](x, q, scale, k, x.stride(0), q.stride(0), BLOCK_K=1024, num_warps=4)
    return q, scale


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, w_scale_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o,
                     M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    x_scale = tl.zeros([M_PAD], dtype=tl.float32) + 1.0
    for m in tl.static_range(M_PAD):  # each row's scale, as quantize_rows computes it
        if m < M:
            x_scale = tl.where(offs_m == m, _row_scale(x_ptr, m, stride_x, K, BLOCK_K), x_scale)
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0).to(tl.float32)
        xq = tl.minimum(tl.maximum(x / x_scale[:, None], -448.0), 448.0)
        xq = xq.to(tl.float8e4nv).to(tl.float32)  # [M_PAD, BLOCK_K], the FP8 activation
        w = tl.load(w_ptr + offs_n[:, None] * stride_w + offs_k[None, :],
                    mask=(offs_n[:, None] < N) & (offs_k[None, :] < K), other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        acc += tl.sum(xq[:, None, :] * w[None, :, :], axis=2)  # [M_PAD, BLOCK_N]
    w_scale = tl.load(w_scale_ptr + offs_n, mask=offs_n < N, other=0.0)
    out = acc * x_scale[:, None] * w_scale[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_o + offs_n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
             tiling: GemvTiling = GEMV_TILING) -> torch.Tensor:
    """x [M, K] (M <= GEMV_KERNEL_MAX_ROWS), weight [N, K] float8_e4m3fn, w_scale [N] float32 -> [M, N] in x's
    dtype: x quantized per row to FP8, multiplied, scaled (Fp8Linear's numerics)."""
    rows, k = x.shape
    n = weight.shape[0]
    assert rows <= GEMV_KERNEL_MAX_ROWS and weight.shape[1] == k and weight.stride(1) == 1
    x = x.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    _fp8_gemv_kernel[(triton.cdiv(n, tiling.block_n),)](
        x, weight, w_scale, out, rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
        M_PAD=triton.next_power_of_2(max(rows, 1)), BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k,
        num_warps=tiling.num_warps)
    return out
