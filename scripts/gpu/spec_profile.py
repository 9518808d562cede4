"""Where a speculative step's time goes (issue 18): one target, plain and oracle engines, on the device.

For each batch size: the plain and oracle engines' step wall time; the oracle's step split by the runner's
synchronised timers (prepare / forward / verify+sample / finish with the next drafts); a torch profiler
run (the device's busy time per step against the step's wall time, the top kernels and host ops); a
cProfile run (the host's functions; time in `tolist`/`item` is the host waiting for the device).

    python scripts/gpu/spec_profile.py MODEL [batch sizes, default 1] [out file]
    SPECPROF_QUEUE=1: the oracle engine with --speculative-queue-drafts

An oracle's reference work (the plain engine continuing its reference) is left out of the step times, as
`bench spec` leaves it out; the profilers' runs include it (its functions and kernels are the plain
engine's: `continue_greedy` in the host profile).
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import tempfile
import time

import torch

from llmserve import SamplingParams
from llmserve.bench.spec import SpecBenchConfig, _build, _make_drafts, _rebase_s, _workload
from llmserve.model.loader import load_hf_config


def _steps(llm) -> int:
    return llm.engine.runner.times.num_steps


def _timed(llm, prompts, params) -> tuple[float, int]:
    """Seconds (an oracle's reference work left out) and runner steps of one generate."""
    steps, rebase_s = _steps(llm), _rebase_s(llm)
    start = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - start - (_rebase_s(llm) - rebase_s), _steps(llm) - steps


def _torch_profile(llm, prompts, params, out) -> None:
    from torch.profiler import ProfilerActivity, profile

    steps = _steps(llm)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    wall = time.perf_counter() - start
    num_steps = _steps(llm) - steps
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    print(f"  profiled: {num_steps} runner steps, wall {wall * 1e3 / num_steps:.2f} ms/step, device busy "
          f"{device_us / 1e3 / num_steps:.2f} ms/step (profiler overhead included in wall)", file=out)
    print(events.table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=60), file=out)
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60), file=out)


def _host_profile(llm, prompts, params, out) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    llm.generate(prompts, params)
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(45)
    print(text.getvalue(), file=out)


def _split(llm, prompts, params, out) -> None:
    runner = llm.engine.runner
    runner.sync_timing = True
    t = runner.times
    before = (t.prepare, t.forward, t.sample, t.propose, t.num_steps)
    wall, _ = _timed(llm, prompts, params)
    runner.sync_timing = False
    parts = [a - b for a, b in zip((t.prepare, t.forward, t.sample, t.propose, t.num_steps), before)]
    n = max(parts[4], 1)
    print(f"  synchronised split per step: prepare {parts[0] * 1e3 / n:.2f} ms, forward {parts[1] * 1e3 / n:.2f}, "
          f"verify/sample {parts[2] * 1e3 / n:.2f}, finish+propose {parts[3] * 1e3 / n:.2f}; wall "
          f"{wall * 1e3 / n:.2f} ms/step ({n} steps)", file=out)


def main() -> None:
    model = sys.argv[1]
    levels = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "1").split(",")]
    out = open(sys.argv[3], "w") if len(sys.argv) > 3 else sys.stdout
    cfg = SpecBenchConfig(model=model, configs="none,oracle=0.8", output_len=96, requests_per_slot=1,
                          speculative_queue_drafts=os.environ.get("SPECPROF_QUEUE") == "1")
    params = SamplingParams(temperature=0, max_tokens=cfg.output_len, ignore_eos=True)
    vocab_size = load_hf_config(model).vocab_size
    with tempfile.TemporaryDirectory() as scratch:
        drafts = _make_drafts(cfg, model, ["oracle=0.8"], scratch)
        engines: dict = {}
        engines["none"] = _build(cfg, model, "none", drafts, {}, engines)
        reference: dict = {}
        engines["oracle"] = _build(cfg, model, "oracle=0.8", drafts, reference, engines)
        oracle, counter = engines["oracle"]
        for level in levels:
            prompts = _workload(cfg, vocab_size, level, False)
            for name, (llm, _) in engines.items():
                llm.generate(prompts, params)  # warm-up (and the oracle's reference)
                wall, steps = _timed(llm, prompts, params)
                print(f"batch {level} {name}: {wall * 1e3 / steps:.2f} ms/step, {steps} steps, "
                      f"{level * cfg.output_len / wall:.1f} tok/s", file=out)
            _split(oracle, prompts, params, out)
            print(f"  oracle accepted {counter.num_accepted} of {counter.num_draft_tokens} draft tokens", file=out)
            _torch_profile(oracle, prompts, params, out)
            _host_profile(oracle, prompts, params, out)
            out.flush()


if __name__ == "__main__":
    main()
