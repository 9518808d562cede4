"""float32 linear layers of the smollm2-135m shape: F.linear (MKL sgemm) vs oneDNN's `_linear_pointwise` on the
plain weight and on the weight packed once for 16 rows (what model/linear.py's `Linear.pack` does) vs x @ w.T
vs MKL's packed GEMM (issue 19). NEVER RUN IN CI.

usage: python scripts/cpu/linear_bench.py THREADS ROWS[,ROWS...]   (ms per call at the first quartile)
"""
import sys
import time

import torch
import torch.nn.functional as F
torch.set_num_threads(int(sys.argv[1]))
shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]
rows_list = [int(r) for r in sys.argv[2].split(",")]
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
        gf = {kk: (2*rows*k*n/v/1e6 if isinstance(v, float) else v) for kk, v in res.items()}
        print(f"{k}x{n} rows {rows}: " + ", ".join(f"{kk} {v:.3f}ms ({gf[kk]:.0f} GF/s)" if isinstance(v, float) else f"{kk} {v}" for kk, v in res.items()), flush=True)
