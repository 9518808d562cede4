"""Decode steps of one model loaded twice, its weights and KV cache on 4 KiB pages (LLMSERVE_CPU_HUGE_PAGES=0) and on
2 MiB transparent huge pages (model/huge_pages.py), alternating step by step in one process (the host's bandwidth
moves between minutes); checks both give the same logits, then prints each one's wall time (p25/p50). NEVER RUN IN
CI.

usage: [DTYPE=bfloat16] python scripts/cpu/huge_pages_bench.py THREADS STEPS [ROWS] [CONTEXT] [MODEL]
"""
import os
import sys
import time

import torch

from llmserve.model import cpu_decode_stack, huge_pages
from llmserve.model.attention import select_attention_backend
from llmserve.model.loader import load_model
from llmserve.testing.paged_batch import PagedBatchBuilder
from llmserve.worker.kv_cache import allocate_kv_caches

torch.set_num_threads(int(sys.argv[1]))
num_steps = int(sys.argv[2])
num_rows = int(sys.argv[3]) if len(sys.argv) > 3 else 1
context = int(sys.argv[4]) if len(sys.argv) > 4 else 400
path = sys.argv[5] if len(sys.argv) > 5 else os.path.expanduser("~/.cache/llmserve-llamacpp/smollm2-135m")
dtype = getattr(torch, os.environ.get("DTYPE", "float32"))
assert huge_pages.is_enabled(), "no transparent huge pages here (or LLMSERVE_CPU_HUGE_PAGES=0)"
num_blocks, block_size = num_rows * (context // 16 + 2), 16


def setup(is_huge: bool):
    """(model with its decoder stack, its KV caches), on huge pages or not."""
    os.environ[huge_pages.ENV] = "1" if is_huge else "0"
    model = load_model(path, dtype, "cpu", 4096)
    model.decode_stack = cpu_decode_stack.build(model)
    caches = allocate_kv_caches(model.kv_cache_shape(num_blocks, block_size), model.num_layers, dtype, "cpu")
    return model, caches


setups = {"4k-pages": setup(False), "huge-pages": setup(True)}
os.environ.pop(huge_pages.ENV)
backend = select_attention_backend(torch.device("cpu"), "auto", dtype)
builder = PagedBatchBuilder(num_blocks, block_size, seed=1)
for row in range(num_rows):
    builder.add_cached(row, context)
ids, positions, inputs = builder.step([(row, [5 + row]) for row in range(num_rows)])
picks = torch.arange(num_rows)  # [N]: every row sampled


def step(name: str) -> torch.Tensor:
    model, caches = setups[name]
    return model.forward_logits(ids, positions, caches, backend.build_metadata(inputs), backend, picks)[1]


times = {name: [] for name in setups}
with torch.inference_mode():
    assert torch.equal(step("4k-pages"), step("huge-pages")), "the logits differ"
    for i in range(num_steps):
        name = list(setups)[i % 2]
        start = time.perf_counter()
        step(name)
        times[name].append(time.perf_counter() - start)
for name, walls in times.items():
    walls.sort()
    print(f"{name:10} {dtype} {num_rows} rows at {context} tokens: wall ms p25 {walls[len(walls) // 4] * 1e3:.2f} "
          f"p50 {walls[len(walls) // 2] * 1e3:.2f}")
