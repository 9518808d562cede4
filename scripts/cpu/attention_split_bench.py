"""The C++ paged-attention kernel at one decode row of the smollm2-135m shape (9 heads, 3 kv heads, head_dim 64), call
by call on 1 and then 2 threads, cycling through 12 rows so that the KV comes from DRAM as in serving: what the split
over the keys (csrc/paged_attention_split.cpp) gives the second thread. NEVER RUN IN CI.

usage: python scripts/cpu/attention_split_bench.py CONTEXT DTYPE [ROUNDS]   (e.g. 400 bfloat16: wall us per layer call,
min / p10 / p25 per thread count; run it from two checkouts one after the other for an A/B)
"""
import random
import sys
import time

import torch

from llmserve.model import cpu_kernels
from llmserve.testing.paged_batch import PagedBatchBuilder

context, dtype = int(sys.argv[1]), getattr(torch, sys.argv[2])
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 60
num_sets = 12
num_blocks = num_sets * (context // 16 + 3) + 1
builder, rng, sets = PagedBatchBuilder(num_blocks, 16, seed=1), random.Random(0), []
for s in range(num_sets):
    builder.add_cached(s, context + rng.randint(-20, 20))
    sets.append(builder.step([(s, [5])])[2])
kv = torch.randn(2, num_blocks, 16, 3, 64).to(dtype)
q = torch.randn(1, 9, 64).to(dtype)
out, rows = torch.empty_like(q), torch.zeros(1, dtype=torch.int32)
walls = {1: [], 2: []}
for _ in range(rounds):
    for inputs in sets:
        for num_threads in walls:
            torch.set_num_threads(num_threads)
            start = time.perf_counter()
            cpu_kernels.paged_attention(out, q, kv, inputs.block_table, inputs.seq_lens, inputs.query_start_loc, rows,
                                        0.125)
            walls[num_threads].append(time.perf_counter() - start)
line = f"context {context} {sys.argv[2]}:"
for num_threads, ws in walls.items():
    ws = sorted(ws[2 * num_sets:])  # the first two rounds warm up
    line += f" | {num_threads} threads: min {ws[0] * 1e6:.0f} p10 {ws[len(ws) // 10] * 1e6:.0f} p25 {ws[len(ws) // 4] * 1e6:.0f} us"
print(line)
