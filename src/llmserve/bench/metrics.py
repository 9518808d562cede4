"""Serving metrics of one load level, as vLLM's `bench serve` defines them.

Over the successful requests:
- TTFT: send to first text chunk. E2E: send to last text chunk (or the whole answer, not streaming).
- TPOT = (E2E - TTFT) / (output tokens - 1), for requests of more than one output token.
- ITL: every gap between successive text chunks, pooled over requests.
- Throughputs divide by the level's wall time: completed requests, output tokens, input + output tokens.
- Goodput: completed requests/s whose TTFT, TPOT (0 for one-token outputs) and E2E all meet the SLOs.
Percentiles interpolate linearly (numpy's default).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from llmserve.bench.client import RequestRecord

MS_PER_S = 1000.0


@dataclass(frozen=True)
class Stats:
    """Summary of a latency, in milliseconds."""

    mean: float
    median: float
    p90: float
    p99: float
    std: float
    count: int

    @classmethod
    def of_seconds(cls, values_s: Sequence[float]) -> Stats | None:
        if not values_s:
            return None
        ms = np.asarray(values_s, dtype=np.float64) * MS_PER_S
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        return cls(float(ms.mean()), float(p50), float(p90), float(p99), float(ms.std()), len(ms))


@dataclass(frozen=True)
class LevelMetrics:
    num_requests: int
    num_completed: int
    num_failed: int
    errors: dict[str, int]  # failed requests by error kind
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output tokens) / s
    goodput: float | None  # requests / s within the SLOs (None without SLOs)
    ttft_ms: Stats | None
    tpot_ms: Stats | None
    itl_ms: Stats | None
    e2e_ms: Stats | None


def tpot_s(rec: RequestRecord) -> float | None:
    """Time per output token after the first; None without a TTFT or with one output token or fewer."""
    if rec.ttft_s is None or rec.e2e_s is None or rec.num_output_tokens <= 1:
        return None
    return (rec.e2e_s - rec.ttft_s) / (rec.num_output_tokens - 1)


def is_within_slo(rec: RequestRecord, slo_ms: dict[str, float]) -> bool:
    values_s = {"ttft": rec.ttft_s, "tpot": tpot_s(rec) or 0.0, "e2e": rec.e2e_s}
    return all(values_s[name] is not None and values_s[name] * MS_PER_S <= limit for name, limit in slo_ms.items())


def compute_metrics(records: Sequence[RequestRecord], duration_s: float,
                    slo_ms: dict[str, float] | None = None) -> LevelMetrics:
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in records if r.is_success]
    failed = [r for r in records if not r.is_success]
    total_in = sum(r.num_prompt_tokens for r in ok)
    total_out = sum(r.num_output_tokens for r in ok)
    tpots = [t for r in ok if (t := tpot_s(r)) is not None]
    num_good = sum(is_within_slo(r, slo_ms) for r in ok) if slo_ms else None
    return LevelMetrics(
        num_requests=len(records), num_completed=len(ok), num_failed=len(failed),
        errors=dict(sorted(Counter(r.error_kind or "unknown" for r in failed).items())),
        duration_s=duration_s, total_input_tokens=total_in, total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s, output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        goodput=None if num_good is None else num_good / duration_s,
        ttft_ms=Stats.of_seconds([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot_ms=Stats.of_seconds(tpots),
        itl_ms=Stats.of_seconds([gap for r in ok for gap in r.itl_s]),
        e2e_ms=Stats.of_seconds([r.e2e_s for r in ok if r.e2e_s is not None]),
    )
