"""One decode step of a model with LoRA slots on CPU: the base model's rows alone, against the same rows each
with one of N adapters, through the one-call kernel (model/lora_cpu.py) and through torch's segmented
products; thread-CPU ms per step on one thread (the figure to trust on a shared machine), with more threads
(the served engine's) the main thread's CPU time and wall time, median over interleaved rounds,
then torch.profiler's op table for the kernel's step. Random adapter weights of full rank. NEVER RUN IN CI.

usage: python scripts/cpu/lora_step_bench.py MODEL_DIR DECODE_ROWS NUM_ADAPTERS [DTYPE (float32, bfloat16)]
       [NUM_THREADS (1)] [ROUNDS (7)] [SLOT_DTYPE (the model's; --lora-dtype)]
"""
import random
import statistics
import sys
import time

import numpy as np
import torch

from llmserve.model import lora_cpu
from llmserve.model.attention import select_attention_backend
from llmserve.model.lora_layers import attach_lora, lora_step
from llmserve.model.loader import load_model
from llmserve.testing.paged_batch import PagedBatchBuilder, allocate_kv_caches

RANK = 16


def main() -> None:
    path, num_rows, num_adapters = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    num_threads = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    num_rounds = int(sys.argv[6]) if len(sys.argv) > 6 else 7
    torch.set_num_threads(num_threads)
    slot_dtype = getattr(torch, sys.argv[7]) if len(sys.argv) > 7 else None
    dtype = getattr(torch, sys.argv[4] if len(sys.argv) > 4 else "float32")
    model = load_model(path, dtype, "cpu", 1024)
    context, wrapped = attach_lora(model, num_adapters, RANK, *([slot_dtype] if slot_dtype else []))
    for modules in wrapped.values():
        for linear in modules:
            linear.lora_a.normal_(std=0.02)
            for b in linear.lora_bs:
                b.normal_(std=0.02)
            linear.lora_ranks.fill_(RANK)
    backend = select_attention_backend(torch.device("cpu"), "auto", dtype)
    caches = allocate_kv_caches(model, 4000, 16, dtype=dtype)
    builder, rng = PagedBatchBuilder(4000, 16, seed=1), random.Random(0)
    for row in range(num_rows):
        builder.add_cached(row, rng.randint(300, 500))
    ids, pos, inp = builder.step([(row, [5]) for row in range(num_rows)])
    adapter_step = lora_step(np.arange(num_rows) % num_adapters, torch.device("cpu"))
    kernel_can_run = lora_cpu.can_run

    def run(step, use_kernel: bool = True) -> None:
        context.step = step
        lora_cpu.can_run = kernel_can_run if use_kernel else (lambda *args: False)
        model.compute_logits(model(ids, pos, caches, backend.build_metadata(inp), backend))

    cases = {"base": lambda: run(None), "kernel": lambda: run(adapter_step)}
    if num_threads == 1:  # the segmented form runs on one thread whatever the setting
        cases["segmented"] = lambda: run(adapter_step, use_kernel=False)
    # the main thread's CPU time; with more threads also wall time (the main thread's alone misses the others'
    # share, wall time counts other processes' interruptions)
    clocks = {"thread-CPU": time.thread_time} | ({} if num_threads == 1 else {"wall": time.perf_counter})
    times = {(clock, name): [] for clock in clocks for name in cases}
    with torch.inference_mode():
        for _ in range(2):
            for fn in cases.values():
                fn()
        for _ in range(num_rounds):
            for name, fn in cases.items():
                starts = {clock: read() for clock, read in clocks.items()}
                fn()
                for clock, read in clocks.items():
                    times[clock, name].append((read() - starts[clock]) * 1e3)
        for clock in clocks:
            for stat in (statistics.median, min):  # min: the rounds no other process interrupted
                base = stat(times[clock, "base"])
                print(f"{num_rows} rows, {num_adapters} adapters, {num_threads} threads, {clock} ms a step "
                      f"({stat.__name__}): " + ", ".join(f"{name} {stat(times[clock, name]):.1f} "
                                                         f"({stat(times[clock, name]) / base:.2f}x)" for name in cases))
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                cases["kernel"]()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
