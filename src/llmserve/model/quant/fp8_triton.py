"""Triton kernels of the FP8 linear layer on CUDA, for what torch's ops do slowly at decode sizes.

Per-token quantization of the activation through torch is six kernels, as long as the GEMM it feeds, and
`torch._scaled_mm` reads an FP8 weight far below the copy bandwidth for a handful of rows (docs/benchmarks.md,
"FP8 on the H100"). Two kernels replace them:

- `quantize_rows`: one launch. A program per row finds its largest |x|, then writes x / scale in
  float8_e4m3fn and the scale (what `_per_token` + clamp + cast compute in torch).
- `fp8_decode_matmul`: decode rows (a sequence's next token, or that token and its drafts: token_kinds.py),
  whatever their number, on the tensor cores in row tiles (16 rows, or 64 for Hopper's wgmma: DecodeTiling)
  whose K order is fixed: a row's sums do not depend on how many rows share the launch, so greedy outputs
  do not depend on the batch (an FP8 GEMV before it made a row's sums depend on its batch size:
  docs/benchmarks.md, "H100, third run"). Prompt rows keep `quantize_rows` + `torch._scaled_mm`.

Both are checked on CPU through Triton's interpreter, on inputs whose FP8 values are exact (its
float32 -> float8 conversion goes wrong where a value rounds up into the next power of two), and on
CUDA in tests/gpu. The kernels' 448.0 and 1e-12 are linear.FP8_MAX and its smallest scale. What has run on
which GPU, and what a lease measures next: docs/gpu.md, "Quantization".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmserve.model.triton_gemv import add_parts, split_k_parts


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


@dataclass(frozen=True)
class DecodeTiling:
    """How fp8_decode_matmul tiles a layer: rows in tensor-core tiles of `row_tile`, BLOCK_N output channels
    and BLOCK_K of K a step, and K split in `split_k(n, k)` parts so that a layer of few output tiles still
    fills the device (their partial sums added in a fixed order). Two kinds of row tile:
    - 16, the smallest: the operands converted to float16 for `mma.sync` (Triton's code for a 3-D dot, and
      for a 2-D one under 64 rows on Hopper), up to `max_row_tiles` of them a program (one weight load for
      all; more rows, more programs, each reading the weight again);
    - 64: one 2-D dot a program, which Triton gives Hopper's `wgmma` on the e4m3 operands as they are
      (no conversion; 64 rows of MMA work at one row, hidden if the weight's bytes bound the step).
    Nothing here depends on the number of rows, which is what makes a row's sums the same in any batch: only
    the number of programs changes with it. Not yet measured on a GPU: scripts/gpu/fp8_probe.py --sweep
    ranks tilings of both kinds."""

    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    max_row_tiles: int = 4  # row tiles a program (row_tile 16 only)
    min_programs: int = 264  # split K until the output tiles times the splits reach this (2 per H100 SM)
    row_tile: int = 16  # 16 (mma.sync) or 64 (wgmma, one tile a program)

    def __post_init__(self) -> None:
        assert self.row_tile in (16, 64), self.row_tile
        assert self.row_tile == 16 or self.max_row_tiles == 1, "a 64-row tile is one 2-D dot a program"

    def split_k(self, n: int, k: int) -> int:
        """Parts K is split in for an [n, k] weight: a power of two, each part at least two BLOCK_K."""
        return split_k_parts(triton.cdiv(n, self.block_n), k, self.block_k, self.min_programs)


DECODE_TILING = DecodeTiling()
WIDE_TILING = DecodeTiling(max_row_tiles=1, row_tile=64)  # the wgmma kind, beside the default in fp8_probe
ROW_TILE = 16  # rows of the smallest tensor-core tile (tl.dot's smallest M)


@triton.jit
def _store_tile(acc, rows, cols, M, N, out_ptr, x_scale_ptr, w_scale_ptr, stride_o, IS_SPLIT: tl.constexpr):
    """acc (rows x cols, the index tensors broadcast to its shape): at out[part, row, n] in float32 where K
    is split (program axis 2 the part), for _reduce_parts_kernel; else scaled, in out's dtype."""
    mask = (rows < M) & (cols < N)
    if IS_SPLIT:
        part = out_ptr + tl.program_id(2).to(tl.int64) * M * N
        tl.store(part + rows * N + cols, acc, mask=mask)
    else:
        x_scale = tl.load(x_scale_ptr + rows, mask=rows < M, other=0.0)
        w_scale = tl.load(w_scale_ptr + cols, mask=cols < N, other=0.0)
        tl.store(out_ptr + rows * stride_o + cols, (acc * x_scale * w_scale).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decode_matmul_kernel(xq_ptr, x_scale_ptr, w_ptr, w_scale_ptr, out_ptr, M, N, K, K_PART, stride_x, stride_w,
                          stride_o, ROW_TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          IS_SPLIT: tl.constexpr):
    """Program (row group, output tile, K part), row_tile 16: acc[r, i, n] = sum over its K part of
    xq[row, k] w[n, k], a 16-row dot at a time."""
    tiles = tl.program_id(0) * ROW_TILES + tl.arange(0, ROW_TILES)  # [R] this program's 16-row tiles
    rows = tiles[:, None] * 16 + tl.arange(0, 16)[None, :]  # [R, 16]
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    k_lo = tl.program_id(2) * K_PART
    k_hi = tl.minimum(k_lo + K_PART, K)
    acc = tl.zeros([ROW_TILES, 16, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BK]
        x = tl.load(xq_ptr + rows[:, :, None] * stride_x + offs_k[None, None, :],
                    mask=(rows[:, :, None] < M) & (offs_k[None, None, :] < k_hi), other=0.0)  # [R, 16, BK] fp8
        w = tl.load(w_ptr + offs_n[None, :] * stride_w + offs_k[:, None],
                    mask=(offs_n[None, :] < N) & (offs_k[:, None] < k_hi), other=0.0)  # [BK, BN] fp8
        acc = tl.dot(x, tl.broadcast_to(w[None, :, :], [ROW_TILES, BLOCK_K, BLOCK_N]), acc)
    _store_tile(acc, rows[:, :, None], offs_n[None, None, :], M, N, out_ptr, x_scale_ptr, w_scale_ptr, stride_o,
                IS_SPLIT)


@triton.jit
def _decode_matmul_wide_kernel(xq_ptr, x_scale_ptr, w_ptr, w_scale_ptr, out_ptr, M, N, K, K_PART, stride_x,
                               stride_w, stride_o, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr, IS_SPLIT: tl.constexpr):
    """Program (row tile, output tile, K part), row_tile 64: acc[i, n] = sum over its K part of
    xq[row, k] w[n, k], one 2-D dot a step."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    k_lo = tl.program_id(2) * K_PART
    k_hi = tl.minimum(k_lo + K_PART, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BK]
        x = tl.load(xq_ptr + rows[:, None] * stride_x + offs_k[None, :],
                    mask=(rows[:, None] < M) & (offs_k[None, :] < k_hi), other=0.0)  # [BM, BK] fp8
        w = tl.load(w_ptr + offs_n[None, :] * stride_w + offs_k[:, None],
                    mask=(offs_n[None, :] < N) & (offs_k[:, None] < k_hi), other=0.0)  # [BK, BN] fp8
        # Hopper's FP8 wgmma keeps only ~14 bits when it accumulates: added into `acc` in float32 after
        # every 32 of K (Triton's default on sm_90 never does), as _scaled_mm does without fast accumulation.
        acc = tl.dot(x, w, acc, max_num_imprecise_acc=32)
    _store_tile(acc, rows[:, None], offs_n[None, :], M, N, out_ptr, x_scale_ptr, w_scale_ptr, stride_o, IS_SPLIT)


def fp8_decode_matmul(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                      tiling: DecodeTiling = DECODE_TILING, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype (into `out` [M, N], rows of any stride, when given), Fp8Linear's
    numerics (x per row to FP8, weight [N, K] float8_e4m3fn with w_scale [N] float32), each row's sums in
    an order that does not depend on M: decode rows give the same bits alone or in any batch
    (model/quant/token_kinds.py routes them here)."""
    rows, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.stride(1) == 1
    xq, x_scale = quantize_rows(x)
    if out is None:
        out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    else:
        assert out.shape == (rows, n) and out.dtype == x.dtype and out.stride(1) == 1
    if not rows:
        return out
    split = tiling.split_k(n, k)
    k_part = triton.cdiv(triton.cdiv(k, split), tiling.block_k) * tiling.block_k
    parts = torch.empty((split, rows, n), dtype=torch.float32, device=x.device) if split > 1 else out
    args = (xq, x_scale, weight, w_scale, parts, rows, n, k, k_part, xq.stride(0), weight.stride(0), out.stride(0))
    opts = dict(BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k, IS_SPLIT=split > 1, num_warps=tiling.num_warps,
                num_stages=tiling.num_stages)
    if tiling.row_tile == ROW_TILE:
        row_tiles = min(tiling.max_row_tiles, triton.next_power_of_2(triton.cdiv(rows, ROW_TILE)))
        grid = (triton.cdiv(rows, ROW_TILE * row_tiles), triton.cdiv(n, tiling.block_n), split)
        _decode_matmul_kernel[grid](*args, ROW_TILES=row_tiles, **opts)
    else:
        grid = (triton.cdiv(rows, tiling.row_tile), triton.cdiv(n, tiling.block_n), split)
        _decode_matmul_wide_kernel[grid](*args, BLOCK_M=tiling.row_tile, **opts)
    if split > 1:
        add_parts(parts, out, x_scale=x_scale.reshape(-1), w_scale=w_scale)
    return out
