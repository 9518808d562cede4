"""Microbenchmark of CPU int8 GEMM candidates against float32 F.linear (issue 20).

Run: flock /tmp/llmserve-bench.lock python scripts/quant/matmul_bench.py [--ours]
Median ms per call at 1, 16 and 64 rows on the smollm2-135m shapes and an 8B MLP shape.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

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


def candidates(w: torch.Tensor, ours: bool) -> dict:
    n, k = w.shape
    scale = w.abs().amax(1).clamp(min=1e-8) / 127
    qw = torch.round(w / scale[:, None]).to(torch.int8)
    out = {"f32 F.linear": lambda x: F.linear(x, w)}
    for engine in ("fbgemm", "x86", "onednn"):
        torch.backends.quantized.engine = engine
        qt = torch.quantize_per_channel(w, scale.double(), torch.zeros(n, dtype=torch.long), 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(qt, None)
        out[f"linear_dynamic {engine}"] = lambda x, p=packed: torch.ops.quantized.linear_dynamic(x, p)
    out["_weight_int8pack_mm"] = lambda x: torch._weight_int8pack_mm(x, qw, scale)
    wt = qw.t().contiguous()
    out["_int_mm (per-token act)"] = lambda x: _int_mm_dyn(x, wt, scale)
    if ours:
        from llmserve.model.quant import cpu_int8
        packed = cpu_int8.pack(qw, scale)
        out["ours int8 (per-token act)"] = lambda x: cpu_int8.linear(x, packed)
    return out


def _int_mm_dyn(x, wt, scale):
    s = x.abs().amax(1, keepdim=True).clamp(min=1e-8) / 127
    xq = torch.round(x / s).to(torch.int8)
    if xq.shape[0] <= 16:  # _int_mm wants > 16 rows on some builds
        xq = F.pad(xq, (0, 0, 0, 17 - xq.shape[0]))
    return torch._int_mm(xq, wt)[: x.shape[0]].float() * s * scale


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ours", action="store_true")
    parser.add_argument("--shapes", default=None, help="e.g. 576x1536,4096x14336")
    args = parser.parse_args()
    shapes = SHAPES if not args.shapes else [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    for k, n in shapes:
        w = torch.randn(n, k) * 0.04
        cands = candidates(w, args.ours)
        for rows in ROWS:
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
