"""`llmserve bench offline`: the engine in-process on a fixed random workload, all submitted at once.

Prints output tokens/s and the mean step (one forward; a multi-step runs several) split into scheduling
(+ bookkeeping), input preparation, forward and sampling. On CUDA the split synchronises the device at each part's end
(else the forward's kernels, queued asynchronously, would be timed where the host next waits), which
also turns the overlap of async scheduling off: `--no-split-steps` measures throughput as served. `--baseline hf` runs the same workload through transformers'
generate() in static batches, as the naive reference.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

from llmserve.bench.command import add_bench_command
from llmserve.config import EngineConfig, engine_kwargs


@dataclass(frozen=True)
class OfflineBenchConfig:
    """The workload and the report; the engine's settings are the engine's own flags (`engine`), as `serve`'s."""

    engine: EngineConfig = field(default_factory=EngineConfig, metadata={"engine": True})
    arch: str = field(default="llama", metadata={"help": "architecture of the made checkpoint (without --model)"})
    shape: str = field(default="smollm2-135m", metadata={"help": "shape of the made checkpoint (without --model)"})
    num_requests: int = field(default=128, metadata={"help": "requests, all submitted at once"})
    prompt_len: str = field(default="64-512", metadata={"help": "prompt length range MIN-MAX (uniform)"})
    output_len: str = field(default="32-256", metadata={"help": "output length range MIN-MAX (uniform)"})
    workload_seed: int = field(default=0, metadata={"help": "seed of the random prompts and lengths"})
    quiet: bool = field(default=False, metadata={"help": "no progress (the stages on stderr, a bar of finished "
                                                 "requests with its ETA); the results still print"})
    split_steps: bool = field(default=True, metadata={"help": "time the parts of a step (on CUDA: with a device synchronisation after each)"})
    sampling: str = field(default="greedy", metadata={"help": "greedy | model: the checkpoint's generation_config defaults, as the server applies them to requests that set no sampling fields", "choices": ["greedy", "model"]})
    baseline: str | None = field(default=None, metadata={"help": "hf: also run transformers generate()"})
    baseline_batch_size: int = field(default=16, metadata={"help": "static batch size of the hf baseline"})
    out: str | None = field(default=None, metadata={"help": "write the results JSON here"})
    plot: str | None = field(default=None, metadata={"help": "write PNG plots to this directory, as bench serve's: "
                             "output throughput (and the hf baseline's), TTFT and end-to-end latency CDFs"})
    profile: str | None = field(default=None, metadata={"help": "run the timed workload under cProfile and write its "
                                                        "top functions (by own and by cumulative time) to this text file"})


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def make_workload(cfg: OfflineBenchConfig, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(cfg.workload_seed)
    (p_lo, p_hi), (o_lo, o_hi) = _range(cfg.prompt_len), _range(cfg.output_len)
    return [([rng.randrange(10, vocab_size) for _ in range(rng.randint(p_lo, p_hi))], rng.randint(o_lo, o_hi))
            for _ in range(cfg.num_requests)]


def run_engine(cfg: OfflineBenchConfig, path: str, workload) -> dict:
    from llmserve import LLM

    llm = LLM(**{**engine_kwargs(cfg.engine), "model": path, "num_threads": _num_threads(cfg)})
    with llm:
        return _measure(cfg, llm, workload)


def _num_threads(cfg: OfflineBenchConfig) -> int | None:
    """--num-threads, else on CPU (one rank, no OMP_NUM_THREADS) one thread per CPU free now: this process is
    the engine's only user, and threads beyond the free CPUs wait at every barrier (worker/cpu_threads.py)."""
    import torch

    from llmserve.worker.cpu_threads import measure_cpus, omp_num_threads, threads_for_free_cpus

    requested, num_ranks = cfg.engine.model.num_threads, cfg.engine.parallel.tensor_parallel_size
    if requested is not None or omp_num_threads() is not None or num_ranks > 1 or torch.cuda.is_available():
        return requested
    choice = threads_for_free_cpus(measure_cpus(), torch.get_num_threads())
    _progress(cfg, f"{choice.num_threads} thread(s): {choice.reason} (--num-threads to choose)")
    return choice.num_threads


def _measure(cfg: OfflineBenchConfig, llm, workload) -> dict:
    from llmserve import SamplingParams
    from llmserve.bench.offline_plots import request_timings

    llm.generate([workload[0][0]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    runner, core = llm.engine.runner, llm.engine
    runner.times.__init__()
    runner.sync_timing = cfg.split_steps
    tp = core.tp_executor.tp if core.tp_executor is not None else None
    if tp is not None:
        tp.comm_seconds = 0.0
    params = [_sampling_params(llm, cfg.sampling, n) for _, n in workload]
    profiler = _start_profile(cfg.profile)
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in workload], params, use_tqdm=not cfg.quiet)
    elapsed = time.perf_counter() - start
    _write_profile(profiler, cfg.profile)
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    timings = request_timings(outputs, [p for p, _ in workload])
    t = runner.times
    steps = max(t.num_steps, 1)
    other = elapsed - (t.prepare + t.forward + t.sample)
    return {"engine": "llmserve", "device": str(core.device), "dtype": str(core.dtype), "elapsed_s": elapsed,
            "num_output_tokens": num_out, "output_tok_s": num_out / elapsed, "num_steps": t.num_steps,
            "num_threads": core.num_threads,
            "mean_step_ms": {"scheduling_and_bookkeeping": 1e3 * other / steps, "input_prep": 1e3 * t.prepare / steps,
                             "forward": 1e3 * t.forward / steps, "sampling": 1e3 * t.sample / steps},
            "non_forward_share": 1 - t.forward / elapsed, "num_preemptions": llm.num_preemptions,
            "async_scheduling": core.is_async, "num_scheduler_steps": core.config.scheduler.num_scheduler_steps,
            "split_steps": cfg.split_steps,
            "tensor_parallel_size": cfg.engine.parallel.tensor_parallel_size,
            # rank 0's host time in collectives (all-reduces, logits all-gather, ids broadcast), waits for the
            # other ranks included; on CUDA without split_steps it times the launches only
            "collective_share": None if tp is None else tp.comm_seconds / elapsed,
            "requests": timings}


def _start_profile(path: str | None):
    """A running cProfile.Profile when a profile is asked for (it slows the host: the figures of a profiled
    run are not the benchmark's), else None."""
    if path is None:
        return None
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def _write_profile(profiler, path: str | None, num_lines: int = 40) -> None:
    if profiler is None:
        return
    import io
    import pstats

    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    for key in ("tottime", "cumulative"):
        stats.sort_stats(key).print_stats(num_lines)
    stats.print_stats(r"\((step|schedule|execute|update_from_output)\)")  # the engine step's three calls, always
    with open(path, "w") as f:
        f.write(text.getvalue())


def _sampling_params(llm, sampling: str, max_tokens: int):
    from llmserve import SamplingParams

    if sampling == "model":
        return llm.processor.default_sampling_params(max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run(cfg: OfflineBenchConfig) -> dict:
    with tempfile.TemporaryDirectory(prefix="llmserve-bench-") as scratch:  # the model it makes, removed after
        return _run(cfg, scratch)


def _run(cfg: OfflineBenchConfig, scratch: str) -> dict:
    from llmserve.model.loader import load_hf_config
    from llmserve.testing.maker import make_model

    if cfg.baseline not in (None, "hf"):
        raise ValueError("--baseline must be hf")
    if cfg.engine.model.model is None:
        _progress(cfg, f"writing a random-weight {cfg.arch} {cfg.shape} checkpoint")
    path = cfg.engine.model.model or make_model(cfg.arch, cfg.shape, scratch, seed=0)
    workload = make_workload(cfg, load_hf_config(path).vocab_size)
    _progress(cfg, f"loading the engine, then {cfg.num_requests} requests "
                   f"({sum(n for _, n in workload):,} output tokens) at once")
    results = {"config": asdict(cfg), "model_path": path, "engine": run_engine(cfg, path, workload)}
    _print(results)
    if cfg.baseline == "hf":
        from llmserve.bench.hf_baseline import run_hf_baseline

        results["hf"] = asdict(run_hf_baseline(path, workload, batch_size=cfg.baseline_batch_size,
                                                  dtype=cfg.engine.model.dtype))
        _print(results)
    if cfg.plot:
        from llmserve.bench.offline_plots import write_offline_plots

        print("plots: " + ", ".join(write_offline_plots(results, cfg.plot)))
    return results


def _progress(cfg: OfflineBenchConfig, stage: str) -> None:
    """A stage of the run on stderr (the results go to stdout), unless --quiet."""
    if not cfg.quiet:
        print(f"bench offline: {stage}", file=sys.stderr, flush=True)


def _print(results: dict) -> None:
    e = results["engine"]
    print(f"llmserve  {e['device']} {e['dtype']}: {e['num_output_tokens']} output tokens in {e['elapsed_s']:.1f} s"
          f" = {e['output_tok_s']:.1f} tok/s over {e['num_steps']} forwards ({e['num_preemptions']} preemptions, "
          f"async scheduling {'on' if e['async_scheduling'] else 'off'}, up to {e['num_scheduler_steps']} "
          f"forwards a step{_threads(e)})")
    split = ", ".join(f"{k} {v:.2f}" for k, v in e["mean_step_ms"].items())
    if e["split_steps"]:
        print(f"mean forward step (ms): {split}; non-forward share {100 * e['non_forward_share']:.1f}%")
    if e["collective_share"] is not None:
        print(f"tensor parallel {e['tensor_parallel_size']}: collectives {100 * e['collective_share']:.1f}% of the "
              f"run on rank 0")
    if "hf" in results:
        hf = results["hf"]
        print(f"hf generate (static batches, {hf['dtype']}): {hf['output_throughput']:.1f} tok/s; "
              f"ratio llmserve/hf = {e['output_tok_s'] / hf['output_throughput']:.2f}x")


def _threads(engine: dict) -> str:
    num = engine["num_threads"]
    return f", {num} thread{'' if num == 1 else 's'}" if engine["device"] == "cpu" else ""


def add_bench_offline_parser(subparsers):
    return add_bench_command(subparsers, "offline", "benchmark the engine in-process", OfflineBenchConfig, run)
