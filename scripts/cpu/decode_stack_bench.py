"""Decode steps (ROWS rows at 400 tokens of context: model forward + logits) three ways, alternating step by step in
one process: the whole forward in one C++ call (the stack with its head: model/cpu_decode_head.py), the layers' C++
call with the embedding, rotary, final norm and logits in Python around it, and the Python layers. Checks that all
give the same logits bit for bit, then prints each one's wall and thread-CPU time (p25/p50). NEVER RUN IN CI.

usage: [DTYPE=bfloat16] [WAYS=one-call,layers,python]
       python scripts/cpu/decode_stack_bench.py THREADS STEPS [ROWS] [MODEL]
"""
import os
import sys
import time

import torch

from llmserve.model import cpu_decode_stack
from llmserve.model.attention import select_attention_backend
from llmserve.model.loader import load_model
from llmserve.testing.paged_batch import PagedBatchBuilder, allocate_kv_caches

torch.set_num_threads(int(sys.argv[1]))
num_steps = int(sys.argv[2])
num_rows = int(sys.argv[3]) if len(sys.argv) > 3 else 1
path = sys.argv[4] if len(sys.argv) > 4 else os.path.expanduser("~/.cache/llmserve-llamacpp/smollm2-135m")
dtype = getattr(torch, os.environ.get("DTYPE", "float32"))
ways = os.environ.get("WAYS", "one-call,layers,python").split(",")
model = load_model(path, dtype, "cpu", 1024)
stack = cpu_decode_stack.build(model)
assert stack is not None, "this model or machine takes no decoder stack"
assert stack.has_head or "one-call" not in ways, "the stack took no head here"
backend = select_attention_backend(torch.device("cpu"), "auto", dtype)
caches = allocate_kv_caches(model, 4000, 16, dtype=dtype)
builder = PagedBatchBuilder(4000, 16, seed=1)
for row in range(num_rows):
    builder.add_cached(row, 400)
ids, positions, inputs = builder.step([(row, [5 + row]) for row in range(num_rows)])
picks = torch.arange(num_rows)  # [N]: every row sampled


def step(way: str) -> torch.Tensor:
    model.decode_stack = None if way == "python" else stack
    stack.has_head = way == "one-call"
    return model.forward_logits(ids, positions, caches, backend.build_metadata(inputs), backend, picks)[1]


times = {way: ([], []) for way in ways}
with torch.inference_mode():
    first = step(ways[0])
    assert all(torch.equal(first, step(way)) for way in ways[1:]), "the ways' logits differ"
    for i in range(num_steps):
        way = ways[i % len(ways)]
        wall, cpu = time.perf_counter(), time.thread_time()
        step(way)
        times[way][0].append(time.perf_counter() - wall)
        times[way][1].append(time.thread_time() - cpu)
for way, (walls, cpus) in times.items():
    walls.sort()
    cpus.sort()
    print(f"{way:8} {dtype} {num_rows} rows: wall ms p25 {walls[len(walls) // 4] * 1e3:.2f} "
          f"p50 {walls[len(walls) // 2] * 1e3:.2f}; thread-CPU ms p25 {cpus[len(cpus) // 4] * 1e3:.2f} "
          f"p50 {cpus[len(cpus) // 2] * 1e3:.2f}")
