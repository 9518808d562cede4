"""The C++ paged-attention kernel alone on decode rows of the smollm2-135m shape (9 heads, 3 kv heads, head_dim 64,
contexts 300-500), cycling through 12 disjoint row sets so that the KV comes from DRAM as in serving
(issue 19). NEVER RUN IN CI.

usage: python scripts/cpu/attention_bench.py THREADS ROWS [KV_DTYPE]   (ms per layer call at the first quartile,
GB/s of KV read; KV_DTYPE float32 (default), float16 (--kv-cache-dtype fp16's cache under float32 q) or int8
(--kv-cache-dtype int8's: rows of 64 int8 and their float32 scale))
"""
import random
import sys
import time

import torch

from llmserve.model import cpu_kernels
from llmserve.model.attention import quantize_int8_rows
from llmserve.testing.paged_batch import PagedBatchBuilder
torch.set_num_threads(int(sys.argv[1]))
nrows = int(sys.argv[2]); nsets = 12
num_blocks = nsets * nrows * 33 + 1  # 500 tokens = 32 blocks a row, block 0 null
b = PagedBatchBuilder(num_blocks, 16, seed=1); rng = random.Random(0)
sets = []
for s in range(nsets):
    rows = []
    for i in range(nrows):
        b.add_cached((s, i), rng.randint(300, 500)); rows.append(((s, i), [5]))
    sets.append(b.step(rows)[2])
kv_dtype = getattr(torch, sys.argv[3]) if len(sys.argv) > 3 else torch.float32
kv = torch.randn(2, num_blocks, 16, 3, 64)
kv = quantize_int8_rows(kv) if kv_dtype == torch.int8 else kv.to(kv_dtype)
q = torch.randn(nrows, 9, 64); out = torch.empty_like(q)
r = torch.arange(nrows, dtype=torch.int32)
fs = [lambda inp=inp: cpu_kernels.paged_attention(out, q, kv, inp.block_table, inp.seq_lens, inp.query_start_loc, r, 0.125) for inp in sets]
for f in fs: f()
ts = []
for _ in range(4):
    for f in fs:
        t0 = time.thread_time(); f(); ts.append(time.thread_time() - t0)
ts.sort()
kvbytes = sum(sets[0].seq_lens.tolist()) * 3 * kv.shape[-1] * kv.element_size() * 2
print(f"rows {nrows} {kv_dtype} (cold KV): p25 {ts[len(ts)//4]*1e3:.2f} ms per layer-call, {kvbytes/ts[len(ts)//4]/1e9:.1f} GB/s; x30 = {ts[len(ts)//4]*30e3:.0f} ms")
