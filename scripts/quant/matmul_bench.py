"""Microbenchmark of CPU int8 GEMM candidates against float32 F.linear (issue 20).

Run: flock /tmp/llmserve-bench.lock python scripts/quant/matmul_bench.py [--shapes 576x1536,...] [--rows 1,16,64]
Median ms per call on the smollm2-135m shapes and an 8B MLP shape; "Int8Linear" is what --quantization
int8 runs (per-token activation quantization + torch._int_mm + scaling, model/quant/linear.py).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from llmserve.model.quant.linear import Int8Linear

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
    out["Int8Linear (per-token + _int_mm)"] = Int8Linear.from_float(w, None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--shapes", default=None, help="e.g. 576x1536,4096x14336")
    args = parser.parse_args()
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
