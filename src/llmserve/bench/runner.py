"""A benchmark run: probe the servers, warm them up, then each load level on each server.

With two servers, each level's requests are split into `rounds` slices run A B, B A, A B, ..., every slice on
the same requests (and arrival times) for both, so slow drift on a noisy machine hits both alike, and each
server goes first as often as the other (the order alone changes a server's figure: docs/benchmarks.md,
"Figures behind choices in the code"). A server's duration at a level is the sum of its slices' wall times.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import numpy as np
from tqdm import tqdm

from llmserve.bench import probe, scrape
from llmserve.bench.client import RequestRecord, Target, make_http_client, send_request
from llmserve.bench.client_procs import BUSY_CLIENT_SHARE, ClientProcesses, SliceRun, num_client_processes, send_slice
from llmserve.bench.config import BenchServeConfig, Level
from llmserve.bench.datasets import BenchRequest, Sampler, make_sampler
from llmserve.bench.load import arrival_times, run_closed_loop
from llmserve.bench.metrics import LevelMetrics, compute_metrics
from llmserve.bench.scrape import GrammarMetrics
from llmserve.bench.tokens import Tokenizer

Log = Callable[[str], None]


@dataclass(frozen=True)
class LevelRun:
    """One server at one load level."""

    server: str
    level: Level
    metrics: LevelMetrics
    records: list[RequestRecord]
    grammar: GrammarMetrics | None = None  # from the server's /metrics (llmserve only), else None


@dataclass(frozen=True)
class LevelWork:
    """The requests of one level, and their send times (open loop) or None (closed loop)."""

    requests: list[BenchRequest]
    arrivals_s: np.ndarray | None


@dataclass(frozen=True)
class BenchResult:
    config: dict
    servers: list[Target]
    levels: list[Level]
    runs: list[LevelRun]
    notes: list[str]
    grammar: dict[str, GrammarMetrics] = field(default_factory=dict)  # per server, probe and warm-up included

    def run(self, server: str, level: Level) -> LevelRun:
        return next(r for r in self.runs if r.server == server and r.level == level)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def run_benchmark(cfg: BenchServeConfig, tokenizer: Tokenizer | None, log: Log = _stderr) -> BenchResult:
    sampler = make_sampler(cfg.dataset, cfg.target.endpoint, tokenizer)
    warmup = sampler(max(cfg.load.warmup, 1), _rng(cfg.load.seed, 0))
    levels = cfg.levels
    notes: list[str] = []
    async with make_http_client() as client:
        bases = base_targets(cfg)
        at_start = await scrape.scrape_all(client, bases)
        targets = [await _connect(client, t, warmup[0], notes, log) for t in bases]
        for target in targets:
            await _warm_up(client, target, warmup[: cfg.load.warmup], levels[0], notes, log)
        runs: list[LevelRun] = []
        num_procs = max(num_client_processes(cfg.load.client_processes, lv.concurrency) for lv in levels)
        procs = ClientProcesses(num_procs) if num_procs > 1 else None
        try:
            with tqdm(total=len(levels) * len(targets) * cfg.load.num_requests, disable=not cfg.output.progress,
                      unit="req", file=sys.stderr, dynamic_ncols=True) as bar:
                sender = _SliceSender(client, procs, cfg.load.client_processes, bar, notes, log)
                for i, level in enumerate(levels):
                    runs += await _run_level(client, targets, level, _level_work(cfg, sampler, i), cfg, sender)
        finally:
            if procs is not None:
                procs.close()
        grammar = scrape.deltas(at_start, await scrape.scrape_all(client, targets))
    return BenchResult(dataclasses.asdict(cfg), targets, levels, runs, notes, grammar)


def base_targets(cfg: BenchServeConfig) -> list[Target]:
    """The servers as configured, before the probe (model may be empty: taken from /v1/models)."""
    t = cfg.target
    models = [t.model, t.compare_model]
    schema = cfg.json_schema
    return [Target(label, url, models[i] or "", t.endpoint, t.stream, t.ignore_eos, True, cfg.extra_body, t.timeout,
                   schema) for i, (label, url) in enumerate(zip(cfg.server_labels, cfg.urls))]


def _rng(seed: int, stream: int) -> np.random.Generator:
    """Stream 0: warm-up; stream i + 1: level i. Every server gets the same requests."""
    return np.random.default_rng([seed, stream])


def _level_work(cfg: BenchServeConfig, sampler: Sampler, level_index: int) -> LevelWork:
    rng = _rng(cfg.load.seed, level_index + 1)
    requests = sampler(cfg.load.num_requests, rng)
    rate = cfg.levels[level_index].request_rate
    return LevelWork(requests, None if rate is None else arrival_times(len(requests), rate, cfg.load.burstiness, rng))


async def _connect(client: aiohttp.ClientSession, base: Target, sample: BenchRequest, notes: list[str],
                   log: Log) -> Target:
    log(f"{base.label}: probing {base.url} ...")
    target, new_notes = await probe.connect(client, base, sample)
    for note in new_notes:
        log(f"note: {note}")
    notes.extend(new_notes)
    log(f"{target.label}: model {target.model!r}, {target.api_url}, "
        f"stream={target.is_streaming}, ignore_eos={target.is_ignore_eos_sent}")
    return target


async def _warm_up(client: aiohttp.ClientSession, target: Target, requests: list[BenchRequest], first: Level,
                   notes: list[str], log: Log) -> None:
    if not requests:
        return
    concurrency = min(len(requests), first.concurrency or len(requests))
    send = _sender(client, target, None)
    records, _ = await run_closed_loop(send, requests, range(len(requests)), concurrency)
    failed = [r for r in records if not r.is_success]
    if failed:
        note = f"{target.label}: {len(failed)} of {len(records)} warm-up requests failed ({failed[0].error})"
        log(f"note: {note}")
        notes.append(note)


def _sender(client: aiohttp.ClientSession, target: Target, bar: tqdm | None):
    async def send(req: BenchRequest, index: int) -> RequestRecord:
        rec = await send_request(client, target, req, index)
        if bar is not None:
            bar.update(1)
        return rec

    return send


class _SliceSender:
    """Sends a level's slices from this process or from the client processes, and notes a client that was busy
    enough to have capped what it measured."""

    def __init__(self, client: aiohttp.ClientSession, procs: ClientProcesses | None, setting: int, bar: tqdm,
                 notes: list[str], log: Log) -> None:
        self.client, self.procs, self.setting, self.bar = client, procs, setting, bar
        self.notes, self.log = notes, log

    async def run(self, target: Target, work: LevelWork, indices: list[int], level: Level) -> SliceRun:
        at_s = None if work.arrivals_s is None else (work.arrivals_s[indices] - work.arrivals_s[indices[0]]).tolist()
        num = num_client_processes(self.setting, level.concurrency)
        if num > 1 and self.procs is not None:
            run = await self.procs.send_slice(target, work.requests, indices, level.concurrency, at_s, num)
            self.bar.update(len(run.records))
        else:
            num = 1
            run = await send_slice(_sender(self.client, target, self.bar), work.requests, indices, level.concurrency,
                                   at_s)
        if run.client_cpu_share >= BUSY_CLIENT_SHARE:
            note = (f"{target.label} {level.name}: a client process used {100 * run.client_cpu_share:.0f}% of a core "
                    f"({num} process{'es' if num > 1 else ''}): its figures may be the client's limit; raise "
                    "--client-processes")
            self.log(f"note: {note}")
            self.notes.append(note)
        return run


async def _run_level(client: aiohttp.ClientSession, targets: list[Target], level: Level, work: LevelWork,
                     cfg: BenchServeConfig, sender: _SliceSender) -> list[LevelRun]:
    num_rounds = min(cfg.load.rounds, len(work.requests)) if len(targets) > 1 else 1
    slices = np.array_split(np.arange(len(work.requests)), num_rounds)
    records: dict[str, list[RequestRecord]] = {t.label: [] for t in targets}
    durations = dict.fromkeys(records, 0.0)
    before = await scrape.scrape_all(client, targets)
    for round_index, indices in enumerate(slices):
        for target in targets if round_index % 2 == 0 else targets[::-1]:
            sender.bar.set_description(f"{target.label} {level.name}")
            run = await sender.run(target, work, indices.tolist(), level)
            for rec in run.records:
                rec.start_s += durations[target.label]
            records[target.label] += run.records
            durations[target.label] += run.seconds
    grammar = scrape.deltas(before, await scrape.scrape_all(client, targets))
    metrics = {label: compute_metrics(recs, durations[label], cfg.slo_ms) for label, recs in records.items()}
    return [LevelRun(label, level, metrics[label], records[label], grammar.get(label)) for label in records]
