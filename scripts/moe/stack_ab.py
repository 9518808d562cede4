"""Decode steps of an MoE checkpoint on CPU through the C++ decoder stack two ways, alternated in one process: each
layer's MoE MLP in Python between the stack's attention halves (one call a layer) against the MoE layers inside the
stack (one call a step: model/cpu_stack_moe.py); with DENSE, the dense model's stack steps too. NEVER RUN IN CI.

usage: python scripts/moe/stack_ab.py THREADS ROWS[,ROWS...] [ROUNDS] [MODEL] [DENSE]
  e.g. `stack_ab.py 1 16,64 15` (decode rows at 300-500 tokens of context; rounds alternate A B, B A).
Prints each way's median thread-CPU and wall time a step (model forward + logits), their ratio, whether both gave
the same logits bit for bit, and with DENSE the MoE step's time over the dense one's. Thread-CPU time is the figure
to trust on a shared machine with THREADS=1.
"""
import os
import random
import statistics
import sys
import time

import torch

from llmserve.model import cpu_decode_stack, cpu_stack_moe
from llmserve.model.attention import select_attention_backend
from llmserve.model.loader import load_model
from llmserve.testing.paged_batch import PagedBatchBuilder, allocate_kv_caches

torch.set_num_threads(int(sys.argv[1]))
ROWS = [int(r) for r in sys.argv[2].split(",")]
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 15
CACHE = os.path.expanduser("~/.cache/llmserve-llamacpp")
MODEL = sys.argv[4] if len(sys.argv) > 4 else os.path.join(CACHE, "qwen3moe-135m-a")
DENSE = sys.argv[5] if len(sys.argv) > 5 else None
BLOCK_SIZE = 16
backend = select_attention_backend(torch.device("cpu"), "auto", torch.float32)


def load_with_stacks(path: str) -> tuple[torch.nn.Module, dict[str, object]]:
    """The model and its stacks: "one call" (MoE layers inside, or a dense model's), "halves" (MoE MLPs in Python)."""
    model = load_model(path, torch.float32, "cpu", 1024)
    stacks = {"one call": cpu_decode_stack.build(model)}
    if model.is_moe:
        decline = cpu_stack_moe.decline_reason
        cpu_stack_moe.decline_reason = lambda layers, has_panels: "the A/B's Python MLPs"
        stacks["halves"] = cpu_decode_stack.build(model)
        cpu_stack_moe.decline_reason = decline
        assert stacks["one call"].mlps is None and stacks["halves"].mlps is not None
    return model, stacks


def batch(num_rows: int):
    builder = PagedBatchBuilder(4000, BLOCK_SIZE, seed=1)
    rng = random.Random(0)
    for i in range(num_rows):
        builder.add_cached(i, rng.randint(300, 500))
    return builder.step([(i, [5 + i]) for i in range(num_rows)])


def step(model, stack, caches, ids, pos, inputs) -> torch.Tensor:
    model.decode_stack = stack
    return model.compute_logits(model(ids, pos, caches, backend.build_metadata(inputs), backend))


def timed(*args) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.thread_time()
    step(*args)
    return time.thread_time() - c0, time.perf_counter() - t0


def report(num_rows: int, times: dict, logits: dict) -> None:
    med = {name: [statistics.median(t[i] for t in ts) * 1e3 for i in (0, 1)] for name, ts in times.items()}
    line = " | ".join(f"{name} cpu {cpu:.1f} ms wall {wall:.1f} ms" for name, (cpu, wall) in med.items())
    halves, one = med["moe halves"], med["moe one call"]
    same = torch.equal(logits["moe halves"], logits["moe one call"])
    print(f"rows {num_rows}: {line} | halves / one call (cpu) {halves[0] / one[0]:.3f}x "
          f"(wall {halves[1] / one[1]:.3f}x) | same logits: {same}")
    if "dense" in med:
        dense = med["dense"]
        print(f"rows {num_rows}: dense / moe step time (cpu): halves {dense[0] / halves[0]:.3f}x, one call "
              f"{dense[0] / one[0]:.3f}x (wall: {dense[1] / halves[1]:.3f}x, {dense[1] / one[1]:.3f}x)")


def main() -> None:
    model, stacks = load_with_stacks(MODEL)
    caches = allocate_kv_caches(model, 4000, BLOCK_SIZE)
    runs = {f"moe {name}": (model, stack, caches) for name, stack in stacks.items()}  # name -> (model, stack, caches)
    if DENSE:
        dense, dense_stacks = load_with_stacks(DENSE)
        runs["dense"] = (dense, dense_stacks["one call"], allocate_kv_caches(dense, 4000, BLOCK_SIZE))
    names = list(runs)
    with torch.inference_mode():
        for num_rows in ROWS:
            ids, pos, inputs = batch(num_rows)
            logits = {}
            for name in names:
                for _ in range(2):
                    step(*runs[name], ids, pos, inputs)
                logits[name] = step(*runs[name], ids, pos, inputs)
            times = {name: [] for name in names}
            for r in range(ROUNDS):
                for name in (names if r % 2 == 0 else names[::-1]):
                    times[name].append(timed(*runs[name], ids, pos, inputs))
            report(num_rows, times, logits)


if __name__ == "__main__":
    main()
