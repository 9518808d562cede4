"""Where a batch-1 decode step's linears stand against the copy bandwidth: each linear layer of a model shape at a
few rows through cuBLAS (F.linear) and through the Triton GEMV (model/triton_gemv.py), in GB/s of the weight's
bytes beside the device's copy bandwidth measured in the same run. NEVER RUN IN CI.

Each figure replays a CUDA graph of CALLS calls over as many distinct copies of the weight as hold more bytes
than the L2 cache (every call reads its weight from HBM, as a decode step does) and takes the median of REPEATS
replays: no launch cost, no warm cache. The down projection is also timed with its SiLU-and-mul: two launches
(silu_mul, cuBLAS) against the gated GEMV's one. The last lines sum one step's linears (the layers times the model's
layer count, and the head) per kernel: against `bench roofline`'s step time that says what the step spends
outside its linears. --sweep also ranks other tilings of the Triton kernel per layer at one row.

    python scripts/gpu/gemv_probe.py [--shape llama-3.1-8b] [--rows 1,2,4,8,16] [--sweep] [--dtype bfloat16]

On CPU (no CUDA) each call runs once through Triton's interpreter on the "tiny" shape and is checked against
F.linear: a dry run of the script, no timings.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from llmserve.bench.roofline import copy_bandwidth
from llmserve.model.shapes import SHAPES, Shape
from llmserve.model import triton_elementwise
from llmserve.model.triton_gemv import GEMV_TILING, GemvTiling, gemv

CALLS, REPEATS, L2_MARGIN_BYTES = 20, 15, 3 * 64 * 2**20  # more than an H100's or H200's 50 MiB L2
SWEEP = [GemvTiling(block_n=n, block_k=k, num_stages=s, min_programs=p)
         for n in (16, 32, 64) for k in (256, 512) for s in (3, 4) for p in (256, 1024)]


def layer_shapes(shape: Shape) -> dict[str, tuple[int, int]]:
    """A decoder layer's linears and the head: name -> (out features, in features)."""
    head_dim = shape.head_dim or shape.hidden_size // shape.num_heads
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * head_dim
    return {"qkv": (qkv, shape.hidden_size), "o": (shape.hidden_size, shape.num_heads * head_dim),
            "gate_up": (2 * shape.intermediate_size, shape.hidden_size),
            "down": (shape.hidden_size, shape.intermediate_size), "head": (shape.vocab_size, shape.hidden_size)}


def graph_seconds(call, num_copies: int) -> float:
    """Median seconds a call of `call(i)` (i the weight copy) inside a replayed CUDA graph of CALLS calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(num_copies):  # compiles Triton's kernels and settles cuBLAS's workspace before capture
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            call(i % num_copies)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPEATS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / CALLS)
    return statistics.median(times)


def weight_copies(n: int, k: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Distinct [n, k] weights, at least two, more bytes together than the L2 holds."""
    num_copies = max(2, -(-L2_MARGIN_BYTES // (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=dtype) * k ** -0.5 for _ in range(num_copies)]


def measure(n: int, k: int, rows: int, dtype: torch.dtype, tilings: list[GemvTiling]) -> tuple[float, list[float]]:
    """Seconds a call for cuBLAS and for each tiling of the Triton GEMV, x [rows, k] through weight [n, k]."""
    weights = weight_copies(n, k, dtype)
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    torch.testing.assert_close(gemv(x, weights[0], None, tilings[0]), F.linear(x, weights[0]), rtol=2e-2, atol=2e-2)
    cublas = graph_seconds(lambda i: F.linear(x, weights[i]), len(weights))
    return cublas, [graph_seconds(lambda i, t=t: gemv(x, weights[i], None, t), len(weights)) for t in tilings]


def measure_gated(n: int, k: int, rows: int, dtype: torch.dtype) -> tuple[float, float]:
    """Seconds for down(silu(gate) * up): silu_mul then cuBLAS (two launches), and the gated Triton GEMV (one)."""
    weights = weight_copies(n, k, dtype)
    gate_up = torch.randn(rows, 2 * k, device="cuda", dtype=dtype)
    two = graph_seconds(lambda i: F.linear(triton_elementwise.silu_mul(gate_up), weights[i]), len(weights))
    return two, graph_seconds(lambda i: gemv(gate_up, weights[i], is_gated=True), len(weights))


def dry_run(dtype: torch.dtype) -> None:
    for name, (n, k) in layer_shapes(SHAPES["tiny"]).items():
        x, w = torch.randn(3, k, dtype=dtype), torch.randn(n, k, dtype=dtype) * k ** -0.5
        torch.testing.assert_close(gemv(x, w), F.linear(x.float(), w.float()).to(dtype), rtol=2e-2, atol=2e-2)
        print(f"{name} [{n}, {k}]: the Triton GEMV through the interpreter equals F.linear (CPU: a dry run, "
              "no timings)")
    n, k = layer_shapes(SHAPES["tiny"])["down"]
    gate_up, w = torch.randn(3, 2 * k, dtype=dtype), torch.randn(n, k, dtype=dtype) * k ** -0.5
    torch.testing.assert_close(gemv(gate_up, w, is_gated=True), F.linear(triton_elementwise.silu_mul(gate_up), w),
                               rtol=2e-2, atol=2e-2)
    print(f"down [{n}, {k}] gated: equals silu_mul then F.linear")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--sweep", action="store_true", help="rank other tilings per layer at one row")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if not torch.cuda.is_available():
        dry_run(torch.float16)  # the interpreter multiplies bfloat16 in tl.dot wrongly
        return
    shape = SHAPES[args.shape]
    bandwidth = copy_bandwidth(torch.device("cuda"), 2**30)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s; {args.shape}, {args.dtype}, "
          f"the Triton GEMV's default tiling {GEMV_TILING}")
    layers = layer_shapes(shape)
    for rows in [int(r) for r in args.rows.split(",")]:
        step = {"cuBLAS": 0.0, "Triton": 0.0}
        for name, (n, k) in layers.items():
            cublas, (triton_s,) = measure(n, k, rows, dtype, [GEMV_TILING])
            count = 1 if name == "head" else shape.num_layers
            step["cuBLAS"] += count * cublas
            step["Triton"] += count * triton_s
            gb = n * k * 2 / 1e9
            print(f"rows {rows:2d} {name:8s} [{n:6d}, {k:5d}]: cuBLAS {cublas * 1e6:7.1f} us "
                  f"({100 * gb / cublas / (bandwidth / 1e9):5.1f}% of copy bandwidth), Triton {triton_s * 1e6:7.1f} us "
                  f"({100 * gb / triton_s / (bandwidth / 1e9):5.1f}%): {cublas / triton_s:.2f}x")
        two, gated = measure_gated(*layers["down"], rows, dtype)
        print(f"rows {rows:2d} down(silu(gate) * up): silu_mul + cuBLAS {two * 1e6:.1f} us, the gated GEMV "
              f"{gated * 1e6:.1f} us: {two / gated:.2f}x")
        print(f"rows {rows:2d} a step's linears: cuBLAS {step['cuBLAS'] * 1e3:.2f} ms, "
              f"Triton {step['Triton'] * 1e3:.2f} ms")
    if args.sweep:
        for name, (n, k) in layers.items():
            _, times = measure(n, k, 1, dtype, SWEEP)
            ranked = sorted(zip(times, SWEEP), key=lambda pair: pair[0])[:5]
            print(f"sweep {name}: " + "; ".join(f"{t * 1e6:.1f} us {tiling}" for t, tiling in ranked))


if __name__ == "__main__":
    main()
