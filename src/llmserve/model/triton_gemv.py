"""A Triton GEMV for a few rows through 16-bit weights on CUDA: batch-1 decoding (and a handful of rows: a few
users, a verification of drafts), where a step's time is reading the weights once.

At one row an 8B model's decode step should take its weights' bytes over the copy bandwidth; ours took 70% of
that on an H200 (docs/benchmarks.md, "H200, fifth run"), the linears through cuBLAS. This kernel is the
candidate beside cuBLAS, chosen by LLMSERVE_CUDA_GEMV_ROWS (rows up to that count come here; 0, the default,
keeps cuBLAS for every row count until a device has measured both: scripts/gpu/gemv_probe.py per layer shape,
`bench roofline` for the step; docs/gpu.md "Status").

One program an output tile of BLOCK_N channels and a part of K: a 16-row tensor-core dot a step (rows past M
read as zeros: free where the weight's bytes bound the step), the weight tile read once for all rows. A layer
of few output tiles splits K (`GemvTiling.split_k`) so that enough programs keep loads in flight on every SM;
the parts are added in order by a second launch (`add_parts`), with the bias. A gated MLP's down projection
takes gate_up itself and forms silu(gate) * up as it loads it (`is_gated`: the SiLU-and-mul launch saved).
Runs through Triton's interpreter on CPU (tests/unit/test_triton_gemv.py); scripts/gpu/sm90_compile.py
compiles it for sm_90 (mma.sync, cp.async).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmserve.model.fused_cuda import GEMV_MAX_ROWS
from llmserve.model.triton_elementwise import silu_times_up


@dataclass(frozen=True)
class GemvTiling:
    """BLOCK_N output channels and BLOCK_K of K a step per program; K split only where the output tiles are fewer
    than `min_programs` (two an SM of an H100's or H200's 132 keep ~2 x (num_stages - 1) weight tiles in flight
    an SM, more than a read's latency needs), each part at least two BLOCK_K: a split costs a second launch,
    and at one row a launch's gap costs about what a small layer's read does. No layer of the 8B shape splits.
    scripts/gpu/gemv_probe.py --sweep ranks other values on a device."""

    block_n: int = 16
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3
    min_programs: int = 256

    def split_k(self, n: int, k: int) -> int:
        """Parts K is split in for an [n, k] weight."""
        return split_k_parts(triton.cdiv(n, self.block_n), k, self.block_k, self.min_programs)


def split_k_parts(num_tiles: int, k: int, block_k: int, min_programs: int) -> int:
    """Parts a K of `k` is split in so that num_tiles output tiles times the parts reach min_programs: a power of
    two, each part at least two block_k (the FP8 decode kernel's rule too)."""
    split = 1
    while num_tiles * split < min_programs and k >= 4 * split * block_k:
        split *= 2
    return split


GEMV_TILING = GemvTiling()


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, K_PART, stride_x, stride_w, stride_o,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, IS_SPLIT: tl.constexpr,
                 IS_GATED: tl.constexpr):
    """Program (output tile, K part): acc[r, n] = sum over its K part of x[r, k] w[n, k], r < 16; IS_GATED: x
    is silu(gate) * up of gate_up [M, 2K] (gate columns first), formed as it is loaded."""
    rows = tl.arange(0, 16)  # [16]
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    k_lo = tl.program_id(1) * K_PART
    k_hi = tl.minimum(k_lo + K_PART, K)
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BK]
        x_mask = (rows[:, None] < M) & (offs_k[None, :] < k_hi)
        x = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=x_mask, other=0.0)  # [16, BK]
        if IS_GATED:
            up = tl.load(x_ptr + rows[:, None] * stride_x + K + offs_k[None, :], mask=x_mask, other=0.0)
            x = silu_times_up(x, up)
        w = tl.load(w_ptr + offs_n[None, :] * stride_w + offs_k[:, None],
                    mask=(offs_n[None, :] < N) & (offs_k[:, None] < k_hi), other=0.0)  # [BK, BN]
        acc = tl.dot(x.to(w.dtype), w, acc)
    mask = (rows[:, None] < M) & (offs_n[None, :] < N)
    if IS_SPLIT:  # float32 parts [split, M, N], added by _add_parts_kernel
        part_ptr = out_ptr + tl.program_id(1).to(tl.int64) * M * N
        tl.store(part_ptr + rows[:, None] * N + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_o + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_parts_kernel(part_ptr, bias_ptr, x_scale_ptr, w_scale_ptr, out_ptr, M, N, stride_o, SPLIT: tl.constexpr,
                      HAS_BIAS: tl.constexpr, HAS_SCALES: tl.constexpr, BLOCK: tl.constexpr):
    """out[m, n] = (part[0, m, n] + part[1, m, n] + ...) (* x_scale[m] * w_scale[n]) (+ bias[n]), the parts in
    order."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] flat m * N + n
    mask = offs < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
    m, n = offs // N, offs % N
    if HAS_SCALES:
        acc *= tl.load(x_scale_ptr + m, mask=mask, other=0.0) * tl.load(w_scale_ptr + n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_o + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


def add_parts(parts: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None,
              x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None) -> None:
    """out [M, N] (rows of any stride) = the sum of parts [S, M, N] float32 in order, times x_scale [M] and
    w_scale [N] when given (FP8), plus bias [N] when given: the second launch of a split-K product."""
    split, rows, n = parts.shape
    block = 1024
    _add_parts_kernel[(triton.cdiv(rows * n, block),)](
        parts, parts if bias is None else bias, parts if x_scale is None else x_scale,
        parts if w_scale is None else w_scale, out, rows, n, out.stride(0), SPLIT=split, HAS_BIAS=bias is not None,
        HAS_SCALES=x_scale is not None, BLOCK=block, num_warps=4)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         tiling: GemvTiling = GEMV_TILING, is_gated: bool = False) -> torch.Tensor:
    """x [M <= 16, K] -> [M, N] in x's dtype, F.linear's result for weight [N, K] (K contiguous) and bias [N]
    or None; sums in float32. is_gated: x is gate_up [M, 2K] and the product is of silu(gate) * up, the values
    triton_elementwise.silu_mul gives (one launch instead of two)."""
    rows, k = x.shape[0], weight.shape[1]
    n = weight.shape[0]
    assert rows <= GEMV_MAX_ROWS and x.shape[1] == (2 * k if is_gated else k)
    assert weight.stride(1) == 1 and x.stride(1) == 1
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if not rows:
        return out
    split = tiling.split_k(n, k)
    k_part = triton.cdiv(triton.cdiv(k, split), tiling.block_k) * tiling.block_k
    parts = torch.empty((split, rows, n), dtype=torch.float32, device=x.device) if split > 1 else out
    has_bias = bias is not None
    _gemv_kernel[(triton.cdiv(n, tiling.block_n), split)](
        x, weight, bias if has_bias else weight, parts, rows, n, k, k_part, x.stride(0), weight.stride(0),
        out.stride(0), BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k, HAS_BIAS=has_bias, IS_SPLIT=split > 1,
        IS_GATED=is_gated, num_warps=tiling.num_warps, num_stages=tiling.num_stages)
    if split > 1:
        add_parts(parts, out, bias)
    return out

