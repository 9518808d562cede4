"""Prometheus metrics of one server (its own CollectorRegistry; names prefixed `llmserve:`).

prometheus_client accepts ':' in metric names (vLLM's `vllm:` names use it too). docs/metrics.md lists
each metric with its vLLM equivalent. Per-request latencies are measured here, on the front, from
the engine outputs as they arrive (engine timestamps for queue time); the engine's gauges (queues, KV
cache) come from the stats each step's outputs carry, so a scrape asks nothing of the engine and
answers even while a step runs long.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from llmserve.messages import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, GrammarStats, KVTierStats,
                                     SchedulerStats, SpecDecodeStats)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0)
_LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BALANCE_BUCKETS = (1.0, 1.1, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class _RequestTimes:
    arrival_time: float
    num_prompt_tokens: int
    last_token_time: float = 0.0
    num_generation_tokens: int = 0
    finish_reason: str | None = None  # set here when the front finished it (a stop string)
    lora_name: str | None = None  # the LoRA adapter it ran with


class ServerMetrics:
    """Implements async_llm.StatLogger; `render()` is the /metrics body."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.requests: dict[str, _RequestTimes] = {}
        self.spec_totals = SpecDecodeStats()  # since start, for the derived gauges
        self.max_loop_lag = 0.0
        self._make_gauges()
        self._make_counters()
        self._make_histograms()

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(f"llmserve:{name}", doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(f"llmserve:{name}", doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def _histogram(self, name: str, doc: str, buckets) -> Histogram:
        return Histogram(f"llmserve:{name}", doc, ["model_name"], buckets=buckets,
                         registry=self.registry).labels(self.model_name)

    def _make_gauges(self) -> None:
        self.num_running = self._gauge("num_requests_running", "Requests in the running batch.")
        self.num_waiting = self._gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = self._gauge("kv_cache_usage_perc", "KV cache usage: fraction of blocks in use (0..1).")
        self.num_free_blocks = self._gauge("kv_cache_free_blocks", "KV blocks free (as of the last engine step).")
        self.num_blocks = self._gauge("kv_cache_blocks", "KV blocks in the cache.")
        self.num_in_flight = self._gauge("num_requests_in_flight", "Engine requests the front is waiting on.")
        self.loop_lag_max = self._gauge("event_loop_lag_max_seconds", "Longest event-loop lag seen since start.")
        self.num_lora_adapters = self._gauge("lora_adapters", "LoRA adapters served by name (a router reads "
                                             "GET /v1/models again when this changes).")
        self.lora_resident = Gauge("llmserve:lora_adapter_resident", "1 for each LoRA adapter in a slot of the "
                                   "engine (as of the last engine step), 0 once swapped out.",
                                   ["model_name", "lora_name"], registry=self.registry)
        self.resident_loras: frozenset[str] = frozenset()  # the adapters in the engine's slots, by name

    def _make_counters(self) -> None:
        self.prefix_queries = self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = self._counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = self._counter("num_preemptions", "Requests preempted (their KV freed, recomputed later).")
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of requests that started generating.")
        self.generation_tokens = self._counter("generation_tokens", "Tokens generated.")
        self.spec_drafts = self._counter("spec_decode_num_drafts", "Rows verified with draft tokens.")
        self.spec_draft_tokens = self._counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted = self._counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = Counter("llmserve:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted at each draft position (0-based).",
                                             ["model_name", "position"], registry=self.registry)
        self.spec_acceptance_rate = self._gauge("spec_decode_acceptance_rate",
                                                "Accepted / verified draft tokens since start.")
        self.spec_mean_accepted_length = self._gauge("spec_decode_mean_accepted_length",
                                                     "Tokens per verified row and step (accepted drafts + 1) since start.")
        self.grammar_queries = self._counter("grammar_cache_queries", "Grammar cache lookups (structured outputs).")
        self.grammar_hits = self._counter("grammar_cache_hits", "Grammar cache lookups that found a compiled grammar.")
        self.request_success = Counter("llmserve:request_success", "Finished requests by finish reason.",
                                       ["model_name", "finished_reason"], registry=self.registry)
        self.lora_request_success = Counter("llmserve:lora_request_success", "Finished requests of each LoRA "
                                            "adapter, by finish reason.", ["model_name", "lora_name",
                                                                           "finished_reason"], registry=self.registry)
        self.lora_generation_tokens = Counter("llmserve:lora_generation_tokens", "Tokens generated by each LoRA "
                                              "adapter's requests.", ["model_name", "lora_name"],
                                              registry=self.registry)
        self.kv_tier_hits = Counter("llmserve:kv_offload_hit_tokens", "Prompt tokens loaded from a KV tier below "
                                    "the device (host memory or disk) instead of computed.", ["model_name", "tier"],
                                    registry=self.registry)
        self.kv_offloaded = self._counter("kv_offload_saved_blocks", "KV blocks the device let go of, copied to "
                                          "host memory or disk.")
        self.kv_corrupt = self._counter("kv_offload_corrupt_blocks", "Disk KV blocks that failed their checks "
                                        "(recomputed, never used).")
        self.kv_sent = self._counter("kv_transfer_sent_blocks", "KV blocks a prefill server sent to decode servers.")
        self.kv_received = self._counter("kv_transfer_received_blocks", "KV blocks a decode server received.")

    def _make_histograms(self) -> None:
        self.ttft = self._histogram("time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds", "Time between output steps of a request.",
                                   _LATENCY_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to finish.", _E2E_BUCKETS)
        self.queue_time = self._histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                          _LATENCY_BUCKETS)
        self.prompt_len = self._histogram("request_prompt_tokens", "Prompt length of finished requests.",
                                          _TOKEN_BUCKETS)
        self.output_len = self._histogram("request_generation_tokens", "Output length of finished requests.",
                                          _TOKEN_BUCKETS)
        self.step_tokens = self._histogram("iteration_tokens_total", "Tokens scheduled per engine step.",
                                           _TOKEN_BUCKETS)
        self.loop_lag = self._histogram("event_loop_lag_seconds",
                                        "How late a 20 ms timer on the server's event loop wakes up.", _LAG_BUCKETS)
        self.grammar_compile = self._histogram("grammar_compile_seconds", "Time to compile one new grammar.",
                                               _COMPILE_BUCKETS)
        self.expert_balance = self._histogram("moe_expert_load_max_over_mean",
                                              "Mixture-of-Experts models: tokens per expert, max over mean "
                                              "(1 = even), per engine step, averaged over the MoE layers.",
                                              _BALANCE_BUCKETS)

    # ---- StatLogger ----------------------------------------------------------------------------

    def on_request_added(self, request: EngineCoreRequest) -> None:
        lora_name = None if request.lora is None else request.lora.lora_name
        self.requests[request.request_id] = _RequestTimes(request.arrival_time, len(request.prompt_token_ids),
                                                          lora_name=lora_name)

    def on_engine_outputs(self, outputs: EngineCoreOutputs) -> None:
        now = time.time()
        for out in outputs.outputs:
            times = self.requests.get(out.request_id)
            if times is not None:
                self._on_output(out, times, now)
        if outputs.stats is not None:
            self.on_scheduler_stats(outputs.stats)
        self.num_in_flight.set(len(self.requests))

    def on_finished_by_stop_string(self, engine_request_ids: list[str]) -> None:
        for request_id in engine_request_ids:
            times = self.requests.get(request_id)
            if times is not None:
                times.finish_reason = "stop"

    def _set_resident(self, names: frozenset[str]) -> None:
        for name in names ^ self.resident_loras:
            self.lora_resident.labels(self.model_name, name).set(float(name in names))
        self.resident_loras = names

    def _on_output(self, out: EngineCoreOutput, times: _RequestTimes, now: float) -> None:
        num_new = len(out.new_token_ids)
        if num_new:
            if times.num_generation_tokens == 0:
                self.ttft.observe(now - times.arrival_time)
                self.prompt_tokens.inc(times.num_prompt_tokens)
                if out.scheduled_time is not None:
                    self.queue_time.observe(max(0.0, out.scheduled_time - times.arrival_time))
            else:
                self.itl.observe(now - times.last_token_time)
            times.last_token_time = now
            times.num_generation_tokens += num_new
            self.generation_tokens.inc(num_new)
            if times.lora_name is not None:
                self.lora_generation_tokens.labels(self.model_name, times.lora_name).inc(num_new)
        if out.finish_reason is not None:
            del self.requests[out.request_id]
            reason = times.finish_reason or str(out.finish_reason)
            self.request_success.labels(self.model_name, reason).inc()
            if times.lora_name is not None:
                self.lora_request_success.labels(self.model_name, times.lora_name, reason).inc()
            self.e2e.observe(now - times.arrival_time)
            self.prompt_len.observe(times.num_prompt_tokens)
            self.output_len.observe(times.num_generation_tokens)

    def on_scheduler_stats(self, stats: SchedulerStats) -> None:
        if stats.resident_loras is not None:
            self._set_resident(frozenset(stats.resident_loras))
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        if stats.num_kv_blocks:
            self.num_blocks.set(stats.num_kv_blocks)
            self.num_free_blocks.set(stats.num_free_kv_blocks)
        self.prefix_queries.inc(stats.prefix_cache_queries)
        self.prefix_hits.inc(stats.prefix_cache_hits)
        self.preemptions.inc(stats.num_preemptions)
        if stats.num_scheduled_tokens:
            self.step_tokens.observe(stats.num_scheduled_tokens)
        if stats.spec is not None:
            self._on_spec_stats(stats.spec)
        if stats.grammar is not None:
            self._on_grammar_stats(stats.grammar)
        if stats.expert_balance is not None:
            self.expert_balance.observe(stats.expert_balance)
        if stats.kv_tiers is not None:
            self._on_kv_tier_stats(stats.kv_tiers)

    def _on_kv_tier_stats(self, kv: KVTierStats) -> None:
        self.kv_tier_hits.labels(self.model_name, "host").inc(kv.num_host_hit_tokens)
        self.kv_tier_hits.labels(self.model_name, "disk").inc(kv.num_disk_hit_tokens)
        self.kv_offloaded.inc(kv.num_offloaded_blocks)
        self.kv_corrupt.inc(kv.num_corrupt_blocks)
        self.kv_sent.inc(kv.num_sent_blocks)
        self.kv_received.inc(kv.num_received_blocks)

    def _on_spec_stats(self, spec: SpecDecodeStats) -> None:
        self.spec_drafts.inc(spec.num_drafts)
        self.spec_draft_tokens.inc(spec.num_draft_tokens)
        self.spec_accepted.inc(spec.num_accepted_tokens)
        for position, num in enumerate(spec.accepted_per_position):
            self.spec_accepted_per_pos.labels(self.model_name, str(position)).inc(num)
        totals = self.spec_totals
        totals.num_drafts += spec.num_drafts
        totals.num_draft_tokens += spec.num_draft_tokens
        totals.num_accepted_tokens += spec.num_accepted_tokens
        self.spec_acceptance_rate.set(totals.num_accepted_tokens / max(totals.num_draft_tokens, 1))
        self.spec_mean_accepted_length.set(1 + totals.num_accepted_tokens / max(totals.num_drafts, 1))

    def _on_grammar_stats(self, grammar: GrammarStats) -> None:
        self.grammar_queries.inc(grammar.num_queries)
        self.grammar_hits.inc(grammar.num_hits)
        for seconds in grammar.compile_seconds:
            self.grammar_compile.observe(seconds)

    def on_loop_lag(self, seconds: float) -> None:
        self.loop_lag.observe(seconds)
        if seconds > self.max_loop_lag:
            self.max_loop_lag = seconds
            self.loop_lag_max.set(seconds)

    def set_cache_size(self, num_kv_blocks: int) -> None:
        """The empty cache, until the first step reports (the engine's READY message gives its size)."""
        self.num_blocks.set(num_kv_blocks)
        self.num_free_blocks.set(num_kv_blocks)

    def render(self) -> bytes:
        return generate_latest(self.registry)
