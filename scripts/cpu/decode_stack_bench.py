"""Decode steps (ROWS rows at 400 tokens of context: model forward + logits) with the C++ decoder stack and with the
Python layers, alternating step by step in one process: checks that both give the same logits bit for bit, then
prints each one's wall and thread-CPU time (p25/p50). NEVER RUN IN CI.

usage: [DTYPE=bfloat16] python scripts/cpu/decode_stack_bench.py THREADS STEPS [ROWS] [MODEL]
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
model = load_model(path, dtype, "cpu", 1024)
stack = cpu_decode_stack.build(model)
assert stack is not None, "this model or machine takes no decoder stack"
backend = select_attention_backend(torch.device("cpu"), "auto", dtype)
caches = allocate_kv_caches(model, 4000, 16, dtype=dtype)
builder = PagedBatchBuilder(4000, 16, seed=1)
for row in range(num_rows):
    builder.add_cached(row, 400)
ids, positions, inputs = builder.step([(row, [5 + row]) for row in range(num_rows)])


def step(use_stack: bool) -> torch.Tensor:
    model.decode_stack = stack if use_stack else None
    hidden = model(ids, positions, caches, backend.build_metadata(inputs), backend)
    return model.compute_logits(hidden)


times = {True: ([], []), False: ([], [])}
with torch.inference_mode():
    assert torch.equal(step(True), step(False)), "the stack's logits differ from the Python layers'"
    for i in range(num_steps):
        use_stack = i % 2 == 0
        wall, cpu = time.perf_counter(), time.thread_time()
        step(use_stack)
        times[use_stack][0].append(time.perf_counter() - wall)
        times[use_stack][1].append(time.thread_time() - cpu)
for use_stack, (walls, cpus) in times.items():
    walls.sort()
    cpus.sort()
    print(f"{'stack ' if use_stack else 'python'} {dtype} {num_rows} rows: wall ms p25 {walls[len(walls) // 4] * 1e3:.2f} "
          f"p50 {walls[len(walls) // 2] * 1e3:.2f}; thread-CPU ms p25 {cpus[len(cpus) // 4] * 1e3:.2f} "
          f"p50 {cpus[len(cpus) // 2] * 1e3:.2f}")
