"""A one-row decode step (the stack with its head, 400 tokens of context) beside torch.sum over 1 GiB on huge pages,
in rounds (one sum, then 20 steps): the bytes a step reads over its time, as a share of the same round's read
bandwidth. The host's bandwidth swings from minute to minute, so only a round's own share means anything.
NEVER RUN IN CI.

usage: [DTYPE=bfloat16] python scripts/cpu/step_bandwidth.py [ROUNDS] [MODEL]
"""
import os
import statistics
import sys
import time

import torch

from llmserve.model import cpu_decode_stack, huge_pages
from llmserve.model.attention import select_attention_backend
from llmserve.model.loader import load_model
from llmserve.testing.paged_batch import PagedBatchBuilder
from llmserve.worker.kv_cache import allocate_kv_caches

torch.set_num_threads(2)
num_rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
path = sys.argv[2] if len(sys.argv) > 2 else os.path.expanduser("~/.cache/llmserve-llamacpp/smollm2-135m")
dtype = getattr(torch, os.environ.get("DTYPE", "float32"))
model = load_model(path, dtype, "cpu", 4096)
model.decode_stack = cpu_decode_stack.build(model)
holder = torch.nn.Module()
holder.register_buffer("big", torch.ones(1 << 28))  # 1 GiB of float32
huge_pages.move_to_huge_pages(holder, 1)


def weight_bytes() -> int:
    """Every large tensor a step streams once: the linears' weights (the tied head's packed copy among them, or
    the table itself where the head reads it); the embedding table alone is one row a step."""
    seen, total = set(), 0
    for module in model.modules():
        tensors = [*module._parameters.values(), *module._buffers.values(),
                   *(v for v in vars(module).values() if isinstance(v, torch.Tensor))]
        for t in tensors:
            if t is not None and t.nbytes >= huge_pages.MIN_BYTES and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.nbytes
    if getattr(model, "tied_head_packed", None) is not None:
        total -= model.model.embed_tokens.weight.nbytes
    return total


caches = allocate_kv_caches(model.kv_cache_shape(40, 16), model.num_layers, dtype, "cpu")
kv_bytes = sum(c[:, :25].nbytes for c in caches)  # 400 tokens: 25 blocks of 16 a layer
step_bytes = weight_bytes() + kv_bytes
backend = select_attention_backend(torch.device("cpu"), "auto", dtype)
builder = PagedBatchBuilder(40, 16, seed=1)
builder.add_cached(0, 400)
ids, positions, inputs = builder.step([(0, [5])])
shares, steps, bandwidths = [], [], []
with torch.inference_mode():
    for _ in range(num_rounds):
        holder.big.sum()
        start = time.perf_counter()
        holder.big.sum()
        bandwidth = holder.big.nbytes / (time.perf_counter() - start)
        walls = []
        for _ in range(20):
            start = time.perf_counter()
            model.forward_logits(ids, positions, caches, backend.build_metadata(inputs), backend, torch.arange(1))
            walls.append(time.perf_counter() - start)
        step = statistics.median(walls)
        steps.append(step)
        bandwidths.append(bandwidth)
        shares.append(step_bytes / step / bandwidth)
shares.sort()
print(f"{dtype}: {step_bytes / 1e6:.0f} MB a step (KV {kv_bytes / 1e6:.1f}); step p50 {statistics.median(steps) * 1e3:.2f}"
      f" ms; read bandwidth p50 {statistics.median(bandwidths) / 1e9:.1f} GB/s; the step's stream "
      f"{statistics.median(shares) * 100:.0f}% of its round's (p25 {shares[len(shares) // 4] * 100:.0f}%, "
      f"p75 {shares[3 * len(shares) // 4] * 100:.0f}%)")
