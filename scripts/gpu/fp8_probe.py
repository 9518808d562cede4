"""Where FP8 decode time goes on a GPU (issue 20): per Llama-3.1-8B linear shape and batch rows, the bf16
GEMM, the FP8 GEMM alone (torch._scaled_mm, row-wise scales, operands already quantized), the per-token
quantization alone (torch's ops; the Triton kernel), and Fp8Linear's whole forward through torch's ops and
through the two paths it takes on CUDA (prompt tokens: fp8_triton.quantize_rows + _scaled_mm; decode tokens:
fp8_triton.fp8_decode_matmul; `wide path` the same kernel's 64-row kind, fp8_triton.WIDE_TILING); each timed
as a CUDA-graph replay (median, us), the last columns the weight bytes over the bf16 and the decode path's times.

With --sweep, the decode kernel's tilings instead (DecodeTiling: BLOCK_N x BLOCK_K x stages, the programs
that K splitting aims for, 16-row tiles a program (r) or one 64-row tile (m64); 4 warps) at 1, 8 and 64 rows
over the four shapes: per row count the five fastest tilings by the sum of their times, and the five fastest
over all (each row count weighed alike: a tiling's time over the fastest one's at that count, averaged; one
tiling for every row count, which is what keeps a row's sums batch-invariant).

    python scripts/gpu/fp8_probe.py [rows,...] [--sweep]
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from llmserve.model.quant import fp8_triton
from llmserve.model.quant.linear import FP8_DTYPE, FP8_MAX, Fp8Linear, _per_token

SHAPES = {"qkv 4096->6144": (6144, 4096), "o 4096->4096": (4096, 4096), "gate_up 4096->28672": (28672, 4096),
          "down 14336->4096": (4096, 14336)}
SWEEP_ROWS = (1, 8, 64, 256)  # 256: serving at c=256 decodes that many rows a step
TILINGS = [fp8_triton.DecodeTiling(n, k, 4, st, r, p) for n, k, st, r, p in itertools.product(
    (32, 64, 128), (128, 256), (3, 4), (1, 4), (132, 264)) if n * k <= 16384]  # 40: about 150 compilations
TILINGS += [fp8_triton.DecodeTiling(n, k, 4, st, 1, p, row_tile=64) for n, k, st, p in itertools.product(
    (64, 128), (128, 256), (3, 4), (132, 264)) if n * k <= 16384]  # 12 of the wgmma kind: about 30 more


def _time(fn, rep: int = 50) -> float:
    return do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3  # us


def _layer(n: int, k: int) -> Fp8Linear:
    return Fp8Linear.from_float(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, None)


def sweep() -> None:
    """Row count by row count (each printed when done: a lease that runs out still leaves the first)."""
    layers = {shape: _layer(n, k) for shape, (n, k) in SHAPES.items()}
    weight_bytes = sum(n * k for n, k in SHAPES.values())
    times: dict[tuple[fp8_triton.DecodeTiling, int], float] = {}  # (tiling, rows) -> us over the four shapes
    for rows in SWEEP_ROWS:
        for layer in layers.values():
            x = torch.randn(rows, layer.in_features, device="cuda", dtype=torch.bfloat16)
            for t in TILINGS:
                us = _time(lambda: fp8_triton.fp8_decode_matmul(x, layer.weight, layer.scale.reshape(-1), t), rep=20)
                times[t, rows] = times.get((t, rows), 0.0) + us
        best = sorted(TILINGS, key=lambda t: times[t, rows])[:5]
        print(f"rows {rows:3d}: " + "; ".join(f"{_name(t)} {times[t, rows]:.1f} us "
                                              f"{weight_bytes / times[t, rows] / 1e3:.0f} GB/s" for t in best)
              + f" (default {times[fp8_triton.DECODE_TILING, rows]:.1f} us, wide "
                f"{times[fp8_triton.WIDE_TILING, rows]:.1f} us)", flush=True)
    fastest = {r: min(times[t, r] for t in TILINGS) for r in SWEEP_ROWS}
    total = {t: sum(times[t, r] / fastest[r] for r in SWEEP_ROWS) / len(SWEEP_ROWS) for t in TILINGS}
    for t in sorted(TILINGS, key=total.get)[:5]:
        print(f"over all: {_name(t)} at {total[t]:.2f}x the fastest a row count on average ({t})")
    print(f"default {total[fp8_triton.DECODE_TILING]:.2f}x, wide {total[fp8_triton.WIDE_TILING]:.2f}x")


def _name(t: fp8_triton.DecodeTiling) -> str:
    rows = f"r{t.max_row_tiles}" if t.row_tile == fp8_triton.ROW_TILE else f"m{t.row_tile}"
    return f"{t.block_n}x{t.block_k}x{t.num_warps}w{t.num_stages}s {rows} p{t.min_programs}"


def table(rows_list: list[int]) -> None:
    print(f"{'shape':22} {'rows':>5} {'bf16':>8} {'fp8 mm':>8} {'quant x':>8} {'quant tr':>8} {'torch path':>10} "
          f"{'prompt path':>11} {'decode path':>11} {'wide path':>9} {'GB/s bf16':>9} {'GB/s dec':>9}")
    for name, (n, k) in SHAPES.items():
        layer = _layer(n, k)
        w = layer.weight.to(torch.bfloat16)
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            xs, x_scale = _per_token(x, FP8_MAX)
            xq = xs.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            t_bf16 = _time(lambda: F.linear(x, w))
            t_mm = _time(lambda: torch._scaled_mm(xq, layer.weight.t(), scale_a=x_scale, scale_b=layer.scale,
                                                  out_dtype=torch.bfloat16))
            t_quant = _time(lambda: _per_token(x, FP8_MAX)[0].clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))
            t_quant_triton = _time(lambda: fp8_triton.quantize_rows(x))
            t_torch = _time(lambda: layer.matmul_torch(x))
            t_prompt = _time(lambda: layer._prompt_matmul(x))
            t_decode = _time(lambda: fp8_triton.fp8_decode_matmul(x, layer.weight, layer.scale.reshape(-1)))
            t_wide = _time(lambda: fp8_triton.fp8_decode_matmul(x, layer.weight, layer.scale.reshape(-1),
                                                                fp8_triton.WIDE_TILING))
            print(f"{name:22} {rows:5d} {t_bf16:8.1f} {t_mm:8.1f} {t_quant:8.1f} {t_quant_triton:8.1f} "
                  f"{t_torch:10.1f} {t_prompt:11.1f} {t_decode:11.1f} {t_wide:9.1f} {2 * n * k / t_bf16 / 1e3:9.0f} "
                  f"{n * k / t_decode / 1e3:9.0f}", flush=True)


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--sweep"]
    if "--sweep" in sys.argv:
        sweep()
    else:
        table([int(r) for r in (args[0] if args else "1,8,64,256").split(",")])


if __name__ == "__main__":
    main()
