"""Text tables of a run (one block per level, then a markdown summary) and the results JSON."""

from __future__ import annotations

import dataclasses
import os

import msgspec

from llmserve.bench.config import Level
from llmserve.bench.metrics import LevelMetrics, Stats
from llmserve.bench.runner import BenchResult, LevelRun
from llmserve.bench.scrape import GrammarMetrics

_WIDTH = 34
_STAT_NAMES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))
_STAT_FIELDS = (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99"))


def metric_rows(m: LevelMetrics) -> list[tuple[str, float | None]]:
    """(name, value) of every figure the level table shows, in order."""
    rows: list[tuple[str, float | None]] = [
        ("Successful requests", m.num_completed), ("Failed requests", m.num_failed),
        ("Duration (s)", m.duration_s), ("Input tokens", m.total_input_tokens),
        ("Output tokens", m.total_output_tokens), ("Request throughput (req/s)", m.request_throughput),
        ("Output throughput (tok/s)", m.output_throughput), ("Total throughput (tok/s)", m.total_token_throughput),
    ]
    if m.goodput is not None:
        rows.append(("Goodput (req/s)", m.goodput))
    for attr, name in _STAT_NAMES:
        stats: Stats | None = getattr(m, attr)
        rows += [(f"{label} {name} (ms)", None if stats is None else getattr(stats, f)) for f, label in _STAT_FIELDS]
    return rows


def grammar_rows(g: GrammarMetrics | None) -> list[tuple[str, float | None]]:
    """Structured outputs over the level, from the server's /metrics (all None when it exports none)."""
    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else seconds * 1000.0

    return [("Grammar compiles", None if g is None else g.num_compiles),
            ("Mean grammar compile (ms)", None if g is None else ms(g.mean_compile_s)),
            ("Max grammar compile (ms, <=)", None if g is None else ms(g.max_compile_s)),
            ("Grammar cache hit rate (%)", None if g is None or g.cache_hit_rate is None else 100 * g.cache_hit_rate)]


def was_grammar_used(g: GrammarMetrics | None) -> bool:
    """The server looked up or compiled a grammar: a run without a schema shows no grammar rows."""
    return g is not None and (g.num_queries > 0 or g.num_compiles > 0)


def format_level(result: BenchResult, level: Level) -> str:
    runs = [result.run(t.label, level) for t in result.servers]
    labels = [r.server for r in runs]
    width = max(13, *map(len, labels)) + 1  # each column: its whole label, a space apart
    head = [f"{'':<{_WIDTH}}" + "".join(f"{lb:>{width}}" for lb in labels)]
    if len(runs) == 2:
        head[0] += f" {'ratio B/A':>15}"
    columns = [metric_rows(r.metrics) for r in runs]
    if any(was_grammar_used(r.grammar) for r in runs):
        columns = [col + grammar_rows(r.grammar) for col, r in zip(columns, runs)]
    lines = [_row(name, [col[i][1] for col in columns], width) for i, (name, _) in enumerate(columns[0])]
    errors = [f"{r.server}: " + ", ".join(f"{k}={v}" for k, v in r.metrics.errors.items()) for r in runs if r.metrics.errors]
    title = f" {level.name} ".center(_WIDTH + width * len(runs) + (16 if len(runs) == 2 else 0), "=")
    return "\n".join([title, *head, *lines, *(f"Errors {e}" for e in errors), *_first_errors(runs)])


def _row(name: str, values: list[float | None], width: int) -> str:
    text = f"{name:<{_WIDTH}}" + "".join(f"{_fmt(v):>{width}}" for v in values)
    if len(values) == 2:
        text += f"{_ratio(values[0], values[1]):>16}"
    return text


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:d}" if isinstance(value, int) else f"{value:.2f}"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or a == 0:
        return "-"
    return f"{b / a:.2f}x"


def _first_errors(runs: list[LevelRun]) -> list[str]:
    lines = []
    for run in runs:
        num_retried = sum(r.num_retries > 0 for r in run.records)
        if num_retried:
            lines.append(f"Sent again ({run.server}): {num_retried} request(s) whose kept-alive connection the "
                         "server closed unanswered")
        failed = next((r for r in run.records if not r.is_success), None)
        if failed is not None:
            lines.append(f"First error ({run.server}, request {failed.index}): {failed.error_kind}: {failed.error}")
    return lines


def format_summary(result: BenchResult) -> str:
    """A markdown table, one row per (level, server)."""
    head = ["level", "server", "ok", "failed", "req/s", "out tok/s", "total tok/s", "TTFT p50", "TTFT p99",
            "TPOT p50", "ITL p50", "ITL p99", "E2E p50"]
    rows = [_summary_row(run) for level in result.levels for run in (result.run(t.label, level) for t in result.servers)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n(latencies in ms)"


def _summary_row(run: LevelRun) -> list[str]:
    m = run.metrics

    def stat(s: Stats | None, f: str) -> str:
        return "-" if s is None else f"{getattr(s, f):.1f}"

    return [run.level.name, run.server, str(m.num_completed), str(m.num_failed), f"{m.request_throughput:.2f}",
            f"{m.output_throughput:.1f}", f"{m.total_token_throughput:.1f}", stat(m.ttft_ms, "median"),
            stat(m.ttft_ms, "p99"), stat(m.tpot_ms, "median"), stat(m.itl_ms, "median"), stat(m.itl_ms, "p99"),
            stat(m.e2e_ms, "median")]


def format_grammar_totals(result: BenchResult) -> str:
    """One line per server that looked up or compiled grammars: the whole run, probe and warm-up included."""
    lines = []
    for label, g in result.grammar.items():
        if not was_grammar_used(g):
            continue
        mean = "-" if g.mean_compile_s is None else f"{g.mean_compile_s * 1000:.1f} ms"
        top = "-" if g.max_compile_s is None else f"<= {g.max_compile_s * 1000:g} ms"
        rate = "-" if g.cache_hit_rate is None else f"{100 * g.cache_hit_rate:.1f}%"
        lines.append(f"Grammar, whole run ({label}): {g.num_compiles} compiles, mean {mean}, max {top}; "
                     f"cache hit rate {rate} ({g.num_hits} of {g.num_queries} lookups)")
    return "\n".join(lines)


def format_result(result: BenchResult) -> str:
    blocks = [format_level(result, lv) for lv in result.levels] + [format_summary(result)]
    totals = format_grammar_totals(result)
    return "\n\n".join(blocks + ([totals] if totals else []))


def result_to_dict(result: BenchResult) -> dict:
    """Everything the run measured, every per-request record included (plain JSON types)."""
    return {
        "config": result.config,
        "servers": [dataclasses.asdict(t) for t in result.servers],
        "notes": result.notes,
        "runs": [_run_dict(run) for run in result.runs],
        "grammar": {label: dataclasses.asdict(g) for label, g in result.grammar.items()},
    }


def _run_dict(run: LevelRun) -> dict:
    level = {"name": run.level.name, **dataclasses.asdict(run.level)}
    return {"server": run.server, "level": level, "metrics": dataclasses.asdict(run.metrics),
            "grammar": None if run.grammar is None else dataclasses.asdict(run.grammar),
            "records": [dataclasses.asdict(r) for r in run.records]}


def write_results(result: BenchResult, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(result_to_dict(result)), indent=1))
