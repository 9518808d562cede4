"""One prompt's prefill (the stack or the Python layers, logits of its last row), in-process, steps alternating:
`dtypes` compares a float32 and a bfloat16 model of one checkpoint; `attention` a bfloat16 model whose prompt
rows go to torch's SDPA against one whose attention kernel takes them (what `cpu_kernels.prompt_seq_len_limit`
was chosen by). NEVER RUN IN CI.

usage: python scripts/cpu/prefill_bench.py dtypes|attention TOKENS [ROUNDS] [MODEL]
"""
import os
import statistics
import sys
import time

import torch

from llmserve.model import cpu_decode_stack
from llmserve.model.attention import select_attention_backend
from llmserve.model.attn_torch import TorchAttentionBackend
from llmserve.model.loader import load_model
from llmserve.testing.paged_batch import PagedBatchBuilder
from llmserve.worker.kv_cache import allocate_kv_caches

torch.set_num_threads(2)
mode, num_tokens = sys.argv[1], int(sys.argv[2])
num_rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 6
path = sys.argv[4] if len(sys.argv) > 4 else os.path.expanduser("~/.cache/llmserve-llamacpp/smollm2-135m")
num_blocks = num_tokens // 16 + 2


def setup(dtype: torch.dtype, backend) -> tuple:
    model = load_model(path, dtype, "cpu", 4096)
    model.decode_stack = cpu_decode_stack.build(model)
    caches = allocate_kv_caches(model.kv_cache_shape(num_blocks, 16), model.num_layers, dtype, "cpu")
    builder = PagedBatchBuilder(num_blocks, 16, seed=1)
    builder.add_cached(0, 0)
    ids, positions, inputs = builder.step([(0, list(range(5, 5 + num_tokens)))])
    return model, caches, backend, ids, positions, inputs


if mode == "dtypes":
    cases = {str(dtype): setup(dtype, select_attention_backend(torch.device("cpu"), "auto", dtype))
             for dtype in (torch.float32, torch.bfloat16)}
else:
    bf16 = setup(torch.bfloat16, None)
    cases = {"sdpa": (*bf16[:2], TorchAttentionBackend(kernel_takes_prompts=False), *bf16[3:]),
             "kernel": (*bf16[:2], TorchAttentionBackend(kernel_takes_prompts=True), *bf16[3:])}
walls, logits = {name: [] for name in cases}, {}
last = torch.tensor([num_tokens - 1])
with torch.inference_mode():
    for _ in range(num_rounds):
        for name, (model, caches, backend, ids, positions, inputs) in cases.items():
            start = time.perf_counter()
            _, logits[name] = model.forward_logits(ids, positions, caches, backend.build_metadata(inputs), backend, last)
            walls[name].append(time.perf_counter() - start)
for name, ws in walls.items():
    print(f"{mode} {num_tokens} tokens, {name}: p50 {statistics.median(ws) * 1e3:.1f} ms")
if mode == "attention":
    print(f"argmax equal: {torch.equal(logits['sdpa'].argmax(-1), logits['kernel'].argmax(-1))}, "
          f"max |logit difference| {(logits['sdpa'] - logits['kernel']).abs().max().item():.3f}")
