"""float32 linear layers of the smollm2-135m shape: F.linear (MKL sgemm) vs oneDNN's `_linear_pointwise` on the
plain weight and on the weight packed once for 16 rows vs x @ w.T vs MKL's packed GEMM vs our AVX2 kernel on
16-column panels (what model/linear.py's `Linear.pack` does where the CPU kernels are built) (issue 19).
NEVER RUN IN CI.

usage: python scripts/cpu/linear_bench.py THREADS ROWS[,ROWS...]        (ms per call at the first quartile:
                                                                      each weight hot in the caches)
       python scripts/cpu/linear_bench.py THREADS ROWS[,ROWS...] cold   (the 30 layers' linears and the
       lm_head one after the other, every weight a distinct tensor as in a model step: weights from DRAM;
       median ms of the sweep, oneDNN packed vs ours)
"""
import sys
import time

import torch
import torch.nn.functional as F

from llmserve.model import cpu_kernels
torch.set_num_threads(int(sys.argv[1]))
shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]
rows_list = [int(r) for r in sys.argv[2].split(",")]
has_panels = cpu_kernels.packs_linears()


def cold_sweep():
    layer_shapes = shapes[:4] * 30 + shapes[4:]
    weights = [torch.randn(n, k) * 0.02 for k, n in layer_shapes]
    dnn = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights]
    panels = [cpu_kernels.pack_linear_weight(w) for w in weights] if has_panels else []
    del weights
    def median_ms(fn, reps=7):
        fn()
        times = []
        for _ in range(reps):
            c0 = time.perf_counter(); fn(); times.append(time.perf_counter() - c0)
        return sorted(times)[reps // 2] * 1e3
    for rows in rows_list:
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        flops = sum(2 * rows * k * n for k, n in layer_shapes)
        res = {"dnn_packed16": median_ms(lambda: [torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")
                                                  for (k, _), w in zip(layer_shapes, dnn)])}
        if has_panels:
            res["ours_panels"] = median_ms(lambda: [cpu_kernels.packed_linear(xs[k], w, n)
                                                    for (k, n), w in zip(layer_shapes, panels)])
        print(f"cold sweep rows {rows}: " + ", ".join(f"{kk} {v:.1f}ms ({flops / v / 1e6:.0f} GF/s)"
                                                      for kk, v in res.items()), flush=True)


if len(sys.argv) > 3 and sys.argv[3] == "cold":
    cold_sweep()
    sys.exit(0)
def t(fn, reps=20):
    for _ in range(3): fn()
    best = []
    for _ in range(reps):
        c0 = time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()
        fn()
        best.append((time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()) - c0)
    best.sort(); return best[len(best)//4] * 1e3
for k, n in shapes:
    w = torch.randn(n, k) * 0.02
    wt = w.t().contiguous()
    for rows in rows_list:
        x = torch.randn(rows, k)
        res = {}
        res["F.linear"] = t(lambda: F.linear(x, w))
        res["x@wt"] = t(lambda: x @ wt)
        try:
            res["dnn_lp"] = t(lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
        except Exception as e: res["dnn_lp"] = str(e)[:40]
        try:
            pw = torch.ops.mkldnn._reorder_linear_weight(w, 16)
            res["dnn_packed16"] = t(lambda: torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], ""))
        except Exception as e: res["dnn_packed16"] = str(e)[:40]
        try:
            mw = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
            res["mkl_packed"] = t(lambda: torch.ops.mkl._mkl_linear(x, mw, w, None, rows))
        except Exception as e: res["mkl_packed"] = str(e)[:40]
        if has_panels:
            pp = cpu_kernels.pack_linear_weight(w)
            res["ours_panels"] = t(lambda: cpu_kernels.packed_linear(x, pp, n))
        gf = {kk: (2*rows*k*n/v/1e6 if isinstance(v, float) else v) for kk, v in res.items()}
        print(f"{k}x{n} rows {rows}: " + ", ".join(f"{kk} {v:.3f}ms ({gf[kk]:.0f} GF/s)" if isinstance(v, float) else f"{kk} {v}" for kk, v in res.items()), flush=True)
