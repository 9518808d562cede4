"""Microbenchmark of CPU int8 GEMM candidates against float32 F.linear (issue 20).

Run: flock /tmp/llmserve-bench.lock python scripts/quant/matmul_bench.py [--shapes 576x1536,...] [--rows 1,16,64]
Median ms per call on the smollm2-135m shapes and an 8B MLP shape; "Int8Linear" is what --quantization
int8 runs (per-token activation quantization + torch._int_mm + scaling, or on CPUs where oneDNN has no VNNI our
exact kernel, model/quant/linear.py). With the AVX2 CPU kernels built, our int8 kernel and our float32 panels
are candidates too.

`--sweep ROWS[,ROWS...]`: instead, the smollm2-135m step's 121 weights one after the other, each a distinct
tensor as in a model step (weights from DRAM), float32 panels vs our int8 kernel: median ms of the sweep.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from llmserve.model import cpu_kernels
from llmserve.model.quant.linear import Int8Linear, quantize_int8

SHAPES = [(576, 1536), (1536, 576), (576, 576), (576, 49152), (4096, 14336)]  # (in, out)
ROWS = (1, 16, 64)


def timeit(fn, min_s: float = 0.3) -> float:
    fn()
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < min_s or len(times) < 5:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def candidates(w: torch.Tensor) -> dict:
    n, k = w.shape
    scale = w.abs().amax(1).clamp(min=1e-8) / 127
    qw = torch.round(w / scale[:, None]).to(torch.int8)
    out = {"f32 F.linear": lambda x: F.linear(x, w)}
    for engine in ("fbgemm", "x86", "onednn"):  # activations quantized per tensor (uint8), weights per channel
        torch.backends.quantized.engine = engine
        qt = torch.quantize_per_channel(w, scale.double(), torch.zeros(n, dtype=torch.long), 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(qt, None)
        out[f"linear_dynamic {engine}"] = lambda x, p=packed: torch.ops.quantized.linear_dynamic(x, p)
    out["_weight_int8pack_mm"] = lambda x: torch._weight_int8pack_mm(x, qw, scale)
    out["Int8Linear"] = Int8Linear.from_float(w, None)
    if cpu_kernels.has_avx2_kernels():
        panels, (q, q_scale) = cpu_kernels.pack_linear_weight(w), quantize_int8(w)
        int8_panels = cpu_kernels.pack_int8_weight(q)
        out["ours f32 panels"] = lambda x: cpu_kernels.packed_linear(x, panels, n)
        out["ours int8_linear (exact)"] = lambda x: cpu_kernels.int8_linear(x, int8_panels, q_scale, n)
    return out


def sweep(rows_list: list[int]) -> None:
    """A smollm2-135m step's linears (30 layers' 4 and the lm_head) from DRAM: f32 panels vs int8 kernel."""
    shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)]  # (in, out)
    f32, int8 = [], []
    for k, n in shapes:
        w = torch.randn(n, k) * 0.02
        q, q_scale = quantize_int8(w)
        f32.append(cpu_kernels.pack_linear_weight(w))
        int8.append((cpu_kernels.pack_int8_weight(q), q_scale))
    for rows in rows_list:
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        a = timeit(lambda: [cpu_kernels.packed_linear(xs[k], p, n) for (k, n), p in zip(shapes, f32)])
        b = timeit(lambda: [cpu_kernels.int8_linear(xs[k], p, s, n) for (k, n), (p, s) in zip(shapes, int8)])
        print(f"rows {rows}: f32 panels {a:.1f} ms, int8 kernel {b:.1f} ms: {a / b:.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--shapes", default=None, help="e.g. 576x1536,4096x14336")
    parser.add_argument("--sweep", default=None, help="rows, e.g. 1,16,64: the step sweep instead")
    args = parser.parse_args()
    if args.sweep:
        sweep([int(r) for r in args.sweep.split(",")])
        return
    shapes = SHAPES if not args.shapes else [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    for k, n in shapes:
        w = torch.randn(n, k) * 0.04
        cands = candidates(w)
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k)
            base = timeit(lambda: cands["f32 F.linear"](x))
            cells = []
            for name, fn in cands.items():
                try:
                    ms = timeit(lambda: fn(x))
                    cells.append(f"{name}: {ms:.3f} ms ({base / ms:.2f}x)")
                except Exception as e:  # a candidate unsupported on this build
                    cells.append(f"{name}: n/a ({type(e).__name__}: {str(e)[:60]})")
            print(f"{k}x{n} rows={rows}\n  " + "\n  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
