"""Decode steps at a long context on CPU with a sliding window against the same weights without one, side by side
(the issue's CPU target: decode at 8k tokens, c=16, >= 2x with the window). NEVER RUN IN CI.

usage: python scripts/cpu/sliding_window_decode_bench.py [THREADS] [CONTEXT] [ROWS] [WINDOW]
  defaults 1 8192 16 1024. One random Mistral-shaped checkpoint (hidden 512, 4 layers, 8 heads of 64, 2 kv heads)
  is written twice: with `sliding_window` WINDOW on every layer, and without (full attention). Each step decodes one
  token for ROWS rows of CONTEXT cached tokens through the model's forward (the torch backend, its C++ kernel);
  the two models run in alternation, so the machine's load falls on both alike. Thread-CPU time is the figure to
  trust on a shared machine with THREADS=1.
The engine's block tables of a sliding layer drop the blocks before the window (core/kv_cache_groups.py); here both
models get the whole table, so the ratio is the attention's own (the kernel starts at the window).
"""
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from llmserve.model.attention import select_attention_backend
from llmserve.model.loader import load_model
from llmserve.model.shapes import Shape
from llmserve.testing.maker import write_checkpoint
from llmserve.testing.paged_batch import PagedBatchBuilder, allocate_kv_caches

THREADS, CONTEXT, ROWS, WINDOW = (int(a) for a in (sys.argv[1:] + ["1", "8192", "16", "1024"][len(sys.argv) - 1:]))
BLOCK_SIZE, REPEATS = 16, 7


def checkpoints(root: Path) -> dict[str, str]:
    shape = Shape(512, 4, 8, 2, 1024, 512, 2 * CONTEXT, init_std=0.05)
    full = write_checkpoint("mistral", shape, str(root / "full"), seed=1)
    sliding = root / "sliding"
    shutil.copytree(full, sliding)
    config = json.loads((sliding / "config.json").read_text())
    (sliding / "config.json").write_text(json.dumps({**config, "sliding_window": WINDOW}))
    return {"full": full, f"window {WINDOW}": str(sliding)}


def decode_step(path: str):
    """A closure running one decode step of ROWS rows at CONTEXT cached tokens."""
    model = load_model(path, torch.float32, "cpu", 2 * CONTEXT)
    backend = select_attention_backend(torch.device("cpu"), "auto", torch.float32)
    num_blocks = ROWS * (CONTEXT // BLOCK_SIZE + 2) + 1
    caches = allocate_kv_caches(model, num_blocks, BLOCK_SIZE)
    for cache in caches:
        cache.normal_()
    builder = PagedBatchBuilder(num_blocks, BLOCK_SIZE, seed=1)
    for row in range(ROWS):
        builder.add_cached(row, CONTEXT)
    ids, positions, inputs = builder.step([(row, [5]) for row in range(ROWS)])

    def run():
        hidden = model(ids, positions, caches, backend.build_metadata(inputs), backend)
        return model.compute_logits(hidden)
    return run


def main() -> None:
    torch.set_num_threads(THREADS)
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        runs = {name: decode_step(path) for name, path in checkpoints(Path(tmp)).items()}
        for run in runs.values():
            run()
        times = {name: [] for name in runs}
        for _ in range(REPEATS):
            for name, run in runs.items():
                wall, cpu = time.perf_counter(), time.thread_time()
                run()
                times[name].append((time.perf_counter() - wall, time.thread_time() - cpu))
    medians = {name: sorted(t)[REPEATS // 2] for name, t in times.items()}
    print(f"decode step, {ROWS} rows at {CONTEXT} tokens, {THREADS} thread(s); "
          f"median of {REPEATS} (wall, thread-CPU) ms")
    for name, (wall, cpu) in medians.items():
        print(f"  {name:>12}: {wall * 1e3:8.1f} {cpu * 1e3:8.1f}")
    (full_wall, full_cpu), (win_wall, win_cpu) = medians["full"], medians[f"window {WINDOW}"]
    print(f"  ratio full / window: wall {full_wall / win_wall:.2f}x, thread-CPU {full_cpu / win_cpu:.2f}x")


if __name__ == "__main__":
    main()
