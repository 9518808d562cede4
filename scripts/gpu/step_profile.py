"""Where a served step's time goes on the device: decode steps at given batch sizes, and a mixed step.

The engine core as the server runs it (async scheduling, decode graphs, no front in the process), fed
`bench serve`'s random workload (200-token prompts, 180 outputs, ignore_eos) with the checkpoint's sampling
defaults and with greedy sampling. For each batch size:
- wall ms per pure-decode step (the median of a steady window) and per step that carries prompt tokens;
- the runner's synchronised split (prepare / forward with logits / sample / finish) of a decode window;
- a torch-profiler window of decode steps: device-busy ms per step split into GEMMs, attention, sampling,
  norms and other elementwise kernels, against the step's wall time (the rest is the device waiting);
- a mixed step: `--mix` new prompts arriving into the running batch (one step's chunk of prompt tokens);
- with STEPPROF_SCHEMA=FILE, each batch size once more with that JSON schema on every request (the grammar's
  bitmask and its application in the profile); STEPPROF_ARGS: the LLM's keyword arguments as JSON;
  STEPPROF_PARAMS: sampling parameters over the checkpoint's defaults as JSON (e.g. '{"top_k": 0, "top_p": 0.9,
  "temperature": 0.6, "repetition_penalty": 1.0}', Llama 3.1's: the GPU's full-vocabulary sort).

    python scripts/gpu/step_profile.py MODEL [batch sizes, default 64,256] [out file]
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time
from collections import defaultdict

import msgspec
import numpy as np
import torch

from llmserve import LLM, SamplingParams
from llmserve.sampling_params import StructuredOutputsParams
from llmserve.model.loader import load_hf_config

PROMPT_LEN, OUTPUT_LEN, STEADY_STEPS, PROFILED_STEPS = 200, 180, 24, 8
_KINDS = (  # (kind, name fragments), first match wins
    ("attention", ("paged_attention", "attn", "flash")),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "splitk", "matmul", "wgmma", "scaled_mm")),
    ("sampling", ("sort", "topk", "top_k", "radix", "bitonic", "cumsum", "scan", "argmax", "argmin", "softmax",
                  "uniform", "distribution", "exponential", "log_softmax", "scatter", "gather", "index")),
    ("norm/rotary", ("norm", "rms", "rotary", "rope")),
    ("copy", ("memcpy", "memset", "copy")),
)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _kind(name: str) -> str:
    lowered = name.lower()
    for kind, fragments in _KINDS:
        if any(f in lowered for f in fragments):
            return kind
    return "elementwise/other"


class StepLog:
    """Wraps the scheduler's schedule(): the scheduled tokens and rows of each step, in order."""

    def __init__(self, llm: LLM) -> None:
        self.steps: list[tuple[int, int]] = []
        schedule = llm.engine.scheduler.schedule

        def logged():
            out = schedule()
            self.steps.append((out.total_num_scheduled_tokens, len(out.num_scheduled_tokens)))
            return out

        llm.engine.scheduler.schedule = logged


def _add(llm: LLM, num: int, params: SamplingParams, rng: np.random.Generator, vocab: int, tag: str) -> None:
    for i in range(num):
        prompt = rng.integers(100, vocab - 100, PROMPT_LEN).tolist()
        for request in llm.processor.process(f"{tag}-{i}", prompt, params):
            llm.engine.add_request(request)


def _steps(llm: LLM, num: int) -> list[float]:
    walls = []
    for _ in range(num):
        start = time.perf_counter()
        llm.engine.step()
        walls.append(time.perf_counter() - start)
    return walls


def _until_decoding(llm: LLM, log: StepLog, num_rows: int, out) -> None:
    """Step until every row decodes one token a step; print the prompt steps' walls."""
    walls = []
    while True:
        start = time.perf_counter()
        llm.engine.step()
        walls.append(time.perf_counter() - start)
        if log.steps and log.steps[-1] == (num_rows, num_rows) and len(walls) > 2:
            break
    print(f"  prompt phase: {len(walls)} steps, {sum(walls):.3f} s, walls ms "
          f"{[round(w * 1e3, 1) for w in walls[:12]]}", file=out)


def _device_split(prof, num_steps: int, wall_ms: float, out) -> None:
    by_kind: dict[str, float] = defaultdict(float)
    kernels: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type.name != "CUDA":
            continue
        us = event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
        by_kind[_kind(event.name)] += us
        kernels[event.name] += us
    busy = sum(by_kind.values()) / 1e3 / num_steps
    parts = ", ".join(f"{k} {v / 1e3 / num_steps:.2f}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]))
    print(f"  device busy {busy:.2f} ms of a {wall_ms:.2f} ms step (profiled): {parts}", file=out)
    for name, us in sorted(kernels.items(), key=lambda kv: -kv[1])[:14]:
        print(f"    {us / 1e3 / num_steps:7.3f} ms  {_kind(name):18s} {name[:110]}", file=out)


def _profile_steps(llm: LLM, num: int, out) -> None:
    from torch.profiler import ProfilerActivity, profile

    _sync()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _steps(llm, num)
        _sync()
    _device_split(prof, num, (time.perf_counter() - start) * 1e3 / num, out)


def _split(llm: LLM, num: int, out) -> None:
    runner = llm.engine.runner
    t = runner.times
    before = (t.prepare, t.forward, t.sample, t.propose, t.num_steps)
    runner.sync_timing = True
    walls = _steps(llm, num)
    runner.sync_timing = False
    parts = [a - b for a, b in zip((t.prepare, t.forward, t.sample, t.propose, t.num_steps), before)]
    n = max(parts[4], 1)
    print(f"  synchronised: prepare {parts[0] * 1e3 / n:.2f} ms, forward+logits {parts[1] * 1e3 / n:.2f}, "
          f"sample {parts[2] * 1e3 / n:.2f}, finish {parts[3] * 1e3 / n:.2f}; wall {np.median(walls) * 1e3:.2f} "
          f"ms/step", file=out)


def _host_profile(llm: LLM, num: int, out) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    _steps(llm, num)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).strip_dirs().sort_stats("tottime").print_stats(18)
    print("\n".join(text.getvalue().splitlines()[4:30]), file=out)


def run_level(llm: LLM, level: int, params: SamplingParams, label: str, mix: int, out, deep: bool) -> None:
    rng = np.random.default_rng(level)
    vocab = llm.engine.model_info.vocab_size
    log = StepLog(llm) if not hasattr(llm, "_step_log") else llm._step_log
    llm._step_log = log
    print(f"batch {level}, {label}:", file=out)
    _add(llm, level, params, rng, vocab, f"{label}{level}")
    _until_decoding(llm, log, level, out)
    walls = _steps(llm, STEADY_STEPS)
    wall_ms = float(np.median(walls)) * 1e3
    rows = [r for _, r in log.steps[-STEADY_STEPS:]]  # fewer than the level where requests finished early
    print(f"  decode: {wall_ms:.2f} ms/step median ({level / wall_ms * 1e3:.0f} tok/s), p90 "
          f"{np.percentile(walls, 90) * 1e3:.2f}; rows {min(rows)}-{max(rows)}", file=out)
    _split(llm, 12, out)
    if deep:
        _profile_steps(llm, PROFILED_STEPS, out)
    if deep and mix:  # new prompts into the running batch: the steps that carry them
        _add(llm, mix, params, rng, vocab, f"mix{label}{level}")
        first = len(log.steps)
        start = time.perf_counter()
        llm.engine.step()
        llm.engine.step()  # the first step only launches the new prompts' chunk (async); this one finishes it
        _sync()
        print(f"  mixed: {mix} prompts arrive: steps {log.steps[first:]} took "
              f"{(time.perf_counter() - start) * 1e3:.1f} ms for two", file=out)
        _profile_steps(llm, 2, out)
    if deep:
        _host_profile(llm, 10, out)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    out.flush()


def main() -> None:
    model = sys.argv[1]
    levels = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "64,256").split(",")]
    out = open(sys.argv[3], "w") if len(sys.argv) > 3 else sys.stdout
    extra = msgspec.json.decode(os.environ.get("STEPPROF_ARGS", "{}"))  # e.g. {"max_graph_batch": 1024}
    llm = LLM(model, max_model_len=min(4096, load_hf_config(model).max_position_embeddings),
              load_format=os.environ.get("LOAD_FORMAT", "auto"), **extra)  # dummy: random weights, no checkpoint
    defaults = llm.get_default_sampling_params()
    override = msgspec.json.decode(os.environ.get("STEPPROF_PARAMS", "{}"))  # e.g. Llama 3.1's top_p only
    sampled = msgspec.structs.replace(defaults, max_tokens=OUTPUT_LEN, ignore_eos=True, **override)
    greedy = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    schema_file = os.environ.get("STEPPROF_SCHEMA")
    constrained = None
    if schema_file:
        with open(schema_file) as f:
            constrained = msgspec.structs.replace(
                sampled, structured_outputs=StructuredOutputsParams.from_json_schema(f.read()))
    print(f"defaults: {sampled}", file=out)
    for level in levels:
        run_level(llm, level, sampled, "defaults", 40, out, deep=True)
        run_level(llm, level, greedy, "greedy", 0, out, deep=False)
        if constrained is not None:
            run_level(llm, level, constrained, "schema", 0, out, deep=True)


if __name__ == "__main__":
    main()
