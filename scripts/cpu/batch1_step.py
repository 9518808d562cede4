"""A batch-1 decode step (one row at 400 tokens of context: model forward + logits) of a checkpoint in a loop: its
thread-CPU time, for py-spy (`py-spy record -r 500 -f raw -- python scripts/cpu/batch1_step.py 1 300`) or an A/B.
GEMV_AB=1: steps alternate between bf16 Linears whose GEMV was chosen at load and ones that decide it per call
(`Linear.is_gemv_weight` off), one process. NEVER RUN IN CI.

usage: [DTYPE=bfloat16] python scripts/cpu/batch1_step.py THREADS STEPS [MODEL]
"""
import os
import sys
import time

import torch

from llmserve.model.attention import select_attention_backend
from llmserve.model.linear import Linear
from llmserve.model.loader import load_model
from llmserve.testing.paged_batch import PagedBatchBuilder, allocate_kv_caches

torch.set_num_threads(int(sys.argv[1]))
num_steps = int(sys.argv[2])
path = sys.argv[3] if len(sys.argv) > 3 else os.path.expanduser("~/.cache/llmserve-llamacpp/smollm2-135m")
dtype = getattr(torch, os.environ.get("DTYPE", "float32"))
model = load_model(path, dtype, "cpu", 1024)
backend = select_attention_backend(torch.device("cpu"), "auto", dtype)
caches = allocate_kv_caches(model, 4000, 16, dtype=dtype)
builder = PagedBatchBuilder(4000, 16, seed=1)
builder.add_cached(0, 400)
ids, positions, inputs = builder.step([(0, [5])])
gemv_layers = [m for m in model.modules() if isinstance(m, Linear) and m.is_gemv_weight]
is_ab = os.environ.get("GEMV_AB") == "1"


def step() -> torch.Tensor:
    hidden = model(ids, positions, caches, backend.build_metadata(inputs), backend)
    return model.compute_logits(hidden[:1])


times = {True: [], False: []}
with torch.inference_mode():
    for _ in range(3):
        step()
    for i in range(num_steps):
        at_load = not (is_ab and i % 2)
        for layer in gemv_layers:
            layer.is_gemv_weight = at_load
        start = time.thread_time()
        step()
        times[at_load].append(time.thread_time() - start)
for at_load, ts in times.items():
    if ts:
        ts.sort()
        print(f"GEMV chosen at load={at_load} ({len(gemv_layers)} layers): thread-CPU ms p25 {ts[len(ts) // 4] * 1e3:.2f} "
              f"p50 {ts[len(ts) // 2] * 1e3:.2f} min {ts[0] * 1e3:.2f}")
