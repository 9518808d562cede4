"""Where FP8 decode time goes on a GPU (issue 20): per Llama-3.1-8B linear shape and batch rows, the bf16
GEMM, the FP8 GEMM alone (torch._scaled_mm, row-wise scales, operands already quantized), the per-token
quantization alone (torch's ops; the Triton kernel), and Fp8Linear's whole forward through torch's ops and
through the Triton kernels it uses on CUDA (fp8_triton: a GEMV up to 4 rows); each timed as a CUDA-graph
replay (median, us), the last column the weight bytes over the Triton path's time.

With --sweep, the GEMV's tilings instead (BLOCK_N x BLOCK_K x warps) per shape at 1 and 4 rows: the
three fastest of each and the one fastest over all shapes (the sum of its times). The first sweep (8, 16,
32 x 128, 256, 512 x 2, 4, 8 warps) found 8 x 512 x 2 fastest for every shape; this one is centred there.

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
TILINGS = [fp8_triton.GemvTiling(n, k, w) for n, k, w in itertools.product((4, 8, 16), (256, 512, 1024), (1, 2, 4))]


def _time(fn, rep: int = 50) -> float:
    return do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3  # us


def _layer(n: int, k: int) -> Fp8Linear:
    return Fp8Linear.from_float(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, None)


def sweep() -> None:
    totals = {t: 0.0 for t in TILINGS}
    for name, (n, k) in SHAPES.items():
        layer = _layer(n, k)
        for rows in (1, 4):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            times = {}
            for t in TILINGS:
                times[t] = _time(lambda: fp8_triton.fp8_gemv(x, layer.weight, layer.scale.reshape(-1), t), rep=20)
                totals[t] += times[t]
            best = sorted(times, key=times.get)[:3]
            print(f"{name:22} rows {rows}: " + "; ".join(
                f"{t.block_n}x{t.block_k}x{t.num_warps} {times[t]:.1f} us {n * k / times[t] / 1e3:.0f} GB/s"
                for t in best) + f" (default {times[fp8_triton.GEMV_TILING]:.1f} us)", flush=True)
    best = min(totals, key=totals.get)
    print(f"fastest over all: {best} total {totals[best]:.1f} us (default {totals[fp8_triton.GEMV_TILING]:.1f})")


def table(rows_list: list[int]) -> None:
    print(f"{'shape':22} {'rows':>5} {'bf16':>8} {'fp8 mm':>8} {'quant x':>8} {'quant tr':>8} {'torch path':>10} "
          f"{'triton path':>11} {'GB/s bf16':>9} {'GB/s fp8':>9}")
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
            t_layer = _time(lambda: layer(x))
            print(f"{name:22} {rows:5d} {t_bf16:8.1f} {t_mm:8.1f} {t_quant:8.1f} {t_quant_triton:8.1f} {t_torch:10.1f} "
                  f"{t_layer:11.1f} {2 * n * k / t_bf16 / 1e3:9.0f} {n * k / t_layer / 1e3:9.0f}", flush=True)


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--sweep"]
    if "--sweep" in sys.argv:
        sweep()
    else:
        table([int(r) for r in (args[0] if args else "1,8,64,256").split(",")])


if __name__ == "__main__":
    main()
