"""One model step of the smollm2-135m shape on CPU (issue 19): wall and thread-CPU time, then torch.profiler's
op table. NEVER RUN IN CI.

usage: python scripts/cpu/step_bench.py THREADS DECODE_ROWS PREFILL_LENS [MODEL]
  (SDPA_PROMPTS=1 in the environment: prompts through torch's SDPA instead of the C++ kernel)
  e.g. `step_bench.py 1 16 ""` (16 decode rows, contexts 300-500), `step_bench.py 1 0 512` (one 512-token prompt).
Thread-CPU time is the figure to trust on a shared machine with THREADS=1 (wall time there counts others' load).
"""
import os
import random
import sys
import time

import torch

from llmserve.model.loader import load_model
from llmserve.model.attention import select_attention_backend
from llmserve.testing.paged_batch import PagedBatchBuilder, allocate_kv_caches
torch.set_num_threads(int(sys.argv[1]))
M = sys.argv[4] if len(sys.argv) > 4 else os.path.expanduser("~/.cache/llmserve-llamacpp/smollm2-135m")
DTYPE = getattr(torch, os.environ.get("DTYPE", "float32"))
model = load_model(M, DTYPE, "cpu", 1024)
backend = select_attention_backend(torch.device("cpu"), "auto", DTYPE)
backend.kernel_takes_prompts = backend.kernel_takes_prompts and os.environ.get("SDPA_PROMPTS") != "1"
bs = 16
caches = allocate_kv_caches(model, 4000, bs, dtype=DTYPE)
def case(ndec, prefill):
    b = PagedBatchBuilder(4000, bs, seed=1)
    rng = random.Random(0)
    rows = []
    for i in range(ndec):
        b.add_cached(i, rng.randint(300, 500)); rows.append((i, [5]))
    for j, n in enumerate(prefill):
        rows.append((("p", j), [7] * n))
    return b.step(rows)
ndec, pre = int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",") if x]
ids, pos, inp = case(ndec, pre)
def run():
    md = backend.build_metadata(inp)
    h = model(ids, pos, caches, md, backend)
    return model.compute_logits(h[:max(ndec, 1)])
with torch.inference_mode():
    for _ in range(3): run()
    ts = []
    for _ in range(7):
        t0, c0 = time.perf_counter(), time.thread_time(); run(); ts.append((time.perf_counter()-t0, time.thread_time()-c0))
    ts.sort(); print("wall/threadcpu ms (median, min):", [round(x*1e3,1) for x in ts[3]], [round(x*1e3,1) for x in ts[0]])
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(3): run()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
