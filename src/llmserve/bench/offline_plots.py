"""`bench offline --plot`: the run drawn by `bench serve`'s plots, as one load level (every request submitted
at once: concurrency = their count) with one line for the engine and one for transformers' generate (with
--baseline hf): output throughput, TTFT and end-to-end latency CDFs. No ITL: in-process, a request's tokens
are seen at its end."""

from __future__ import annotations

from llmserve.bench.client import RequestRecord, Target
from llmserve.bench.config import Level
from llmserve.bench.metrics import compute_metrics
from llmserve.bench.runner import BenchResult, LevelRun

ENGINE_LABEL, HF_LABEL = "llmserve (in-process)", "hf generate"


def request_timings(outputs, prompts: list[list[int]]) -> list[dict]:
    """Per request (in submission order): prompt length, output tokens, TTFT and end-to-end seconds from the
    engine's own timestamps (arrival, first token, finished)."""
    timings = []
    for out, prompt in zip(outputs, prompts):
        times = out.metrics
        arrival = times.get("arrival_time")
        timings.append({"prompt_len": len(prompt), "num_output_tokens": len(out.outputs[0].token_ids),
                        "ttft_s": _since(arrival, times.get("first_token_time")),
                        "e2e_s": _since(arrival, times.get("finished_time"))})
    return timings


def _since(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


def offline_bench_result(results: dict) -> BenchResult:
    """bench offline's results (with the engine's per-request timings) as a one-level BenchResult."""
    level = Level(concurrency=len(results["engine"]["requests"]), request_rate=None)
    engine = results["engine"]
    records = [RequestRecord(i, r["prompt_len"], r["num_output_tokens"], is_success=True, ttft_s=r["ttft_s"],
                             e2e_s=r["e2e_s"], num_prompt_tokens=r["prompt_len"],
                             num_output_tokens=r["num_output_tokens"])
               for i, r in enumerate(engine["requests"])]
    runs = [LevelRun(ENGINE_LABEL, level, compute_metrics(records, engine["elapsed_s"]), records)]
    targets = [Target(ENGINE_LABEL, "in-process", results["model_path"])]
    if "hf" in results:  # static batches: only the run's throughput is known
        hf = results["hf"]
        hf_records = [RequestRecord(i, r["prompt_len"], r["num_output_tokens"], is_success=True,
                                    num_prompt_tokens=r["prompt_len"], num_output_tokens=r["num_output_tokens"])
                      for i, r in enumerate(engine["requests"])]
        runs.append(LevelRun(HF_LABEL, level, compute_metrics(hf_records, hf["elapsed_s"]), hf_records))
        targets.append(Target(HF_LABEL, "in-process", results["model_path"]))
    return BenchResult(config=results["config"], servers=targets, levels=[level], runs=runs, notes=[])


def write_offline_plots(results: dict, out_dir: str) -> list[str]:
    from llmserve.bench.plots import write_plots

    return write_plots(offline_bench_result(results), out_dir)
