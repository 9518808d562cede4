"""Figures from the target server's own /metrics (Prometheus text), scraped before and after a load level.

For now llmserve's structured-output metrics: grammar cache lookups and hits, and the compile time of each
new grammar (a histogram, so a level gives the number of compiles, their mean, and the upper bound of the
bucket that holds the slowest). A server without them (vLLM, llama.cpp, no /metrics at all) gives None,
and the report shows nothing for them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from llmserve.bench.client import Target

QUERIES = "llmserve:grammar_cache_queries_total"
HITS = "llmserve:grammar_cache_hits_total"
COMPILE = "llmserve:grammar_compile_seconds"
SCRAPE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class GrammarTotals:
    """The server's grammar metrics at one scrape: totals since its start, summed over label sets."""

    num_queries: float
    num_hits: float
    num_compiles: float
    compile_sum_s: float
    compile_buckets: dict[float, float]  # upper bound `le` -> compiles at or below it (cumulative)


@dataclass(frozen=True)
class GrammarMetrics:
    """Structured outputs between two scrapes."""

    num_queries: int  # grammar cache lookups
    num_hits: int
    cache_hit_rate: float | None  # hits / queries; None without queries
    num_compiles: int  # new grammars compiled
    mean_compile_s: float | None  # None without compiles
    max_compile_s: float | None  # upper bound of the bucket of the slowest compile (inf: over the last bound)


def parse_grammar_totals(text: str) -> GrammarTotals | None:
    """The grammar metrics in a /metrics body; None when the server exports none (or the text is not Prometheus)."""
    values: dict[str, float] = defaultdict(float)
    buckets: dict[float, float] = defaultdict(float)
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == COMPILE + "_bucket":
                    buckets[float(sample.labels["le"])] += sample.value
                elif sample.name in (QUERIES, HITS, COMPILE + "_count", COMPILE + "_sum"):
                    values[sample.name] += sample.value
    except (ValueError, TypeError, KeyError, IndexError):
        return None
    if len(values) < 4:
        return None
    return GrammarTotals(values[QUERIES], values[HITS], values[COMPILE + "_count"], values[COMPILE + "_sum"],
                         dict(buckets))


def grammar_delta(before: GrammarTotals | None, after: GrammarTotals | None) -> GrammarMetrics | None:
    """What happened between two scrapes; None if either lacks the metrics or the server restarted between."""
    if before is None or after is None:
        return None
    queries, hits = round(after.num_queries - before.num_queries), round(after.num_hits - before.num_hits)
    compiles = round(after.num_compiles - before.num_compiles)
    if min(queries, hits, compiles) < 0:
        return None
    mean = (after.compile_sum_s - before.compile_sum_s) / compiles if compiles else None
    return GrammarMetrics(queries, hits, hits / queries if queries else None, compiles, mean,
                          _max_bound(before, after, compiles))


def _max_bound(before: GrammarTotals, after: GrammarTotals, compiles: int) -> float | None:
    """The smallest bucket bound that holds every compile between the scrapes."""
    if not compiles:
        return None
    for le in sorted(after.compile_buckets):
        if round(after.compile_buckets[le] - before.compile_buckets.get(le, 0.0)) >= compiles:
            return le
    return math.inf


async def scrape_grammar(client: aiohttp.ClientSession, url: str) -> GrammarTotals | None:
    """GET {url}/metrics; None when it fails or lacks the grammar metrics (never raises for the server's sake)."""
    try:
        async with client.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as response:
            status, text = response.status, (await response.read()).decode(errors="replace")
    except (aiohttp.ClientError, TimeoutError):
        return None
    return parse_grammar_totals(text) if status == 200 else None


Scrapes = dict[str, GrammarTotals | None]  # server label -> its grammar totals (None: none exported)


async def scrape_all(client: aiohttp.ClientSession, targets: Sequence[Target]) -> Scrapes:
    return {t.label: await scrape_grammar(client, t.url) for t in targets}


def deltas(before: Scrapes, after: Scrapes) -> dict[str, GrammarMetrics]:
    """Per server label, for the servers that export the metrics at both scrapes."""
    found = {label: grammar_delta(before.get(label), totals) for label, totals in after.items()}
    return {label: m for label, m in found.items() if m is not None}
