"""Which of llmserve's source files one decode step runs in the engine process, counted with sys.settrace.

A tiny random-weight llama (llmserve.testing.maker), float32 on CPU, one request of a 16-token prompt;
steps run untraced until the prompt is computed, then the next `EngineCore.step()` (schedule, execute,
update_from_output) runs traced. Every Python frame whose file is under src/llmserve counts; prints the
files, their sizes, and the lines the step executed. `--num-scheduler-steps 1` is one forward a step (the
default on CPU is a multi-step window, which adds worker/decode_window.py and core/decode_window.py).

    PYTHONPATH=src python scripts/cpu/step_files.py [--num-scheduler-steps N]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import llmserve
from llmserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmserve.engine.engine_core import EngineCore
from llmserve.messages import EngineCoreRequest
from llmserve.sampling_params import SamplingParams
from llmserve.testing.maker import make_model

ROOT = os.path.dirname(llmserve.__file__)


def traced_step(engine: EngineCore) -> dict[str, set[int]]:
    """The lines of llmserve's files that one `step()` executes, by file."""
    lines: dict[str, set[int]] = {}

    def local(frame, event, arg):
        if event == "line":
            lines[frame.f_code.co_filename].add(frame.f_lineno)
        return local

    def call(frame, event, arg):
        name = frame.f_code.co_filename
        if not name.startswith(ROOT):
            return None
        lines.setdefault(name, set()).add(frame.f_code.co_firstlineno)
        return local

    sys.settrace(call)
    try:
        engine.step()
    finally:
        sys.settrace(None)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-scheduler-steps", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model("llama", "tiny", tmp, seed=0)
        config = EngineConfig(model=ModelConfig(model=path, dtype="float32", device="cpu", max_model_len=128),
                              cache=CacheConfig(num_kv_blocks=64),
                              scheduler=SchedulerConfig(num_scheduler_steps=args.num_scheduler_steps))
        engine = EngineCore(config)
        params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0)
        engine.add_request(EngineCoreRequest("a", list(range(1, 17)), params, [0], 0.0))
        while engine.scheduler.running == [] or engine.scheduler.running[0].num_computed_tokens < 16:
            engine.step()
        engine.step()  # one decode step untraced: first-decode set-up out of the count
        lines = traced_step(engine)
    total = 0
    for name in sorted(lines):
        with open(name) as f:
            size = sum(1 for _ in f)
        total += size
        print(f"{os.path.relpath(name, ROOT):40s} {size:5d} lines, {len(lines[name]):4d} run")
    print(f"{len(lines)} files, {total:,} lines in them, {sum(map(len, lines.values())):,} lines run")


if __name__ == "__main__":
    main()
