"""One decode step's linears at a few rows (the smollm2-135m shape's 30 layers and its tied lm_head, every
weight a distinct tensor, so each comes from DRAM), through every path this machine has, against its read
bandwidth measured in the same run. NEVER RUN IN CI.

usage: python scripts/cpu/gemv_bench.py [THREADS] [ROWS,...]     (defaults: all cores, 1,4,16,64)

Weights and the bandwidth's buffer live on 2 MiB transparent huge pages where the machine has them, as a served
model's weights do (model/huge_pages.py; HUGE_PAGES=0: on torch's 4 KiB pages). Read bandwidth: torch.sum over 1 GiB
of float32. The machine's bandwidth moves from minute to minute (a shared
host), so each row count runs 5 rounds of (bandwidth, every path once: the median of 3 sweeps) and reports a
path's median GB/s and its median share of its round's bandwidth. Paths: oneDNN on weights packed for 16 rows
(what model/linear.py runs on AVX-512 machines by default), our panel kernel through AVX2 and through AVX-512,
bfloat16 through F.linear (oneDNN) and through our AVX512-BF16 GEMV (rows <= 4).
"""
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from llmserve.model import cpu_kernels, huge_pages

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else os.cpu_count())
ROWS = [int(r) for r in (sys.argv[2] if len(sys.argv) > 2 else "1,4,16,64").split(",")]
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)]  # (in, out)
IS_HUGE = os.environ.get("HUGE_PAGES", "1") != "0" and huge_pages.is_enabled()


def placed(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors copied into one huge-page arena (IS_HUGE), else as they are."""
    if not IS_HUGE:
        return tensors
    holder = torch.nn.Module()
    for i, tensor in enumerate(tensors):
        holder.register_buffer(f"t{i}", tensor)
    huge_pages.move_to_huge_pages(holder, min_bytes=1)
    return [getattr(holder, f"t{i}") for i in range(len(tensors))]


BIG = placed([torch.ones(1 << 28)])[0]  # 1 GiB of float32 for the read bandwidth


def median_s(fn, reps=9):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2]


def read_bandwidth() -> float:
    """GB/s of torch.sum over 1 GiB of float32: the best of 3, a pass of ~40 ms."""
    best = min(median_s(lambda: BIG.sum(), reps=3) for _ in range(3))
    return BIG.numel() * 4 / best / 1e9


def f32_paths():
    weights = placed([torch.randn(n, k) * 0.02 for k, n in SHAPES])
    paths = {"onednn-packed": ([torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights],
                               lambda x, w, n: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))}
    if cpu_kernels.has_avx2_kernels():
        panels = placed([cpu_kernels.pack_linear_weight(w) for w in weights])
        ops = torch.ops.llmserve_cpu

        def avx2(x, w, n):
            out = x.new_empty(x.shape[0], n)
            ops.packed_linear(out, x, w, None)
            return out
        paths["panels-avx2"] = (panels, avx2)
        if cpu_kernels.has_avx512_linear():
            paths["panels-avx512"] = (panels, cpu_kernels.packed_linear_avx512)
    return paths


def bf16_paths():
    weights = placed([(torch.randn(n, k) * 0.02).bfloat16() for k, n in SHAPES])
    paths = {"bf16-F.linear": (weights, lambda x, w, n: F.linear(x, w))}
    if cpu_kernels.has_bf16_gemv():
        paths["bf16-gemv"] = (weights, lambda x, w, n: cpu_kernels.bf16_gemv(x, w))
    return paths


def sweep(paths, dtype, num_rounds=5):
    """Rounds of (read bandwidth, then every path once): each path's median GB/s over the rounds, and its
    median share of the same round's bandwidth (the machine's bandwidth moves between minutes)."""
    num_bytes = sum(k * n for k, n in SHAPES) * torch.empty(0, dtype=dtype).element_size()
    for rows in ROWS:
        xs = {k: torch.randn(rows, k).to(dtype) for k in (576, 1536)}
        names = [n for n in paths if not (n == "bf16-gemv" and rows > cpu_kernels.bf16_gemv_max_rows())]
        gbps, shares = {n: [] for n in names}, {n: [] for n in names}
        for _ in range(num_rounds):
            bandwidth = read_bandwidth()
            for name in names:
                weights, fn = paths[name]
                seconds = median_s(lambda: [fn(xs[k], w, n) for (k, n), w in zip(SHAPES, weights)], reps=3)
                gbps[name].append(num_bytes / seconds / 1e9)
                shares[name].append(gbps[name][-1] / bandwidth)
        for name in names:
            g = statistics.median(gbps[name])
            print(f"| {name} | {rows} | {num_bytes / g / 1e6:.2f} | {g:.1f} | {100 * statistics.median(shares[name]):.0f}% |",
                  flush=True)


if __name__ == "__main__":
    with torch.inference_mode():
        print(f"threads {torch.get_num_threads()}, {'huge' if IS_HUGE else '4 KiB'} pages, read bandwidth {read_bandwidth():.1f} GB/s, "
              f"load {os.getloadavg()[0]:.1f}")
        print("| path | rows | ms | GB/s | of the round's read bw |\n|---|---|---|---|---|")
        sweep(f32_paths(), torch.float32)
        if cpu_kernels.has_bf16_gemv() or "avx512_bf16" in open("/proc/cpuinfo").read():
            sweep(bf16_paths(), torch.bfloat16)
        print(f"read bandwidth after {read_bandwidth():.1f} GB/s, load {os.getloadavg()[0]:.1f}")
