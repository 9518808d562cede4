"""One model step of an MoE checkpoint on CPU, the experts through each expert's packed layers (the Python loop
over experts) against the one op a layer (csrc/moe_experts.cpp), alternated in one process. NEVER RUN IN CI.

usage: python scripts/moe/step_ab.py THREADS ROWS[,ROWS...] [ROUNDS] [MODEL]
  e.g. `step_ab.py 1 16,64 9` (decode rows at 300-500 tokens of context, 9 rounds of A then B, then B then A).
Prints each path's median thread-CPU and wall time a step and their ratio, and whether both gave the same logits.
Thread-CPU time is the figure to trust on a shared machine with THREADS=1.
"""
import os
import random
import statistics
import sys
import time

import torch

from llmserve.model.attention import select_attention_backend
from llmserve.model.loader import load_model
from llmserve.model.moe_cpu import PackedExperts
from llmserve.testing.paged_batch import PagedBatchBuilder, allocate_kv_caches

torch.set_num_threads(int(sys.argv[1]))
ROWS = [int(r) for r in sys.argv[2].split(",")]
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 9
MODEL = sys.argv[4] if len(sys.argv) > 4 else os.path.expanduser("~/.cache/llmserve-llamacpp/qwen3moe-135m-a")
BLOCK_SIZE = 16

model = load_model(MODEL, torch.float32, "cpu", 1024)
backend = select_attention_backend(torch.device("cpu"), "auto", torch.float32)
caches = allocate_kv_caches(model, 4000, BLOCK_SIZE, dtype=torch.float32)
ONE_OP = PackedExperts.runs_in_one_op


def set_one_op(is_on: bool) -> None:
    PackedExperts.runs_in_one_op = ONE_OP if is_on else (lambda self, x, activation: False)


def batch(num_rows: int):
    builder = PagedBatchBuilder(4000, BLOCK_SIZE, seed=1)
    rng = random.Random(0)
    for i in range(num_rows):
        builder.add_cached(i, rng.randint(300, 500))
    return builder.step([(i, [5]) for i in range(num_rows)])


def step(ids, pos, inputs) -> torch.Tensor:
    hidden = model(ids, pos, caches, backend.build_metadata(inputs), backend)
    return model.compute_logits(hidden)


def timed(ids, pos, inputs) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.thread_time()
    step(ids, pos, inputs)
    return time.thread_time() - c0, time.perf_counter() - t0


def main() -> None:
    with torch.inference_mode():
        for num_rows in ROWS:
            ids, pos, inputs = batch(num_rows)
            logits = {}
            for is_on in (False, True):
                set_one_op(is_on)
                for _ in range(2):
                    step(ids, pos, inputs)
                logits[is_on] = step(ids, pos, inputs)
            times = {False: [], True: []}
            for r in range(ROUNDS):
                for is_on in ((False, True) if r % 2 == 0 else (True, False)):
                    set_one_op(is_on)
                    times[is_on].append(timed(ids, pos, inputs))
            loop, one = ([statistics.median(t[i] for t in times[k]) * 1e3 for i in (0, 1)] for k in (False, True))
            print(f"rows {num_rows}: per-expert loop cpu {loop[0]:.1f} ms wall {loop[1]:.1f} ms | one op cpu "
                  f"{one[0]:.1f} ms wall {one[1]:.1f} ms | loop / one op (cpu) {loop[0] / one[0]:.2f}x "
                  f"(wall {loop[1] / one[1]:.2f}x) | same logits: {torch.equal(logits[False], logits[True])}")


if __name__ == "__main__":
    main()
