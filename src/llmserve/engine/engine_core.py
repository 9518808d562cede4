"""The engine core: one step is schedule -> execute -> update_from_output.

With async scheduling (CUDA by default) execute is split: the step schedules and launches step N+1,
then finishes step N (its sampled ids reach the host) and updates from it, so the host's work for
N+1 overlaps the device's work on N. Steps that may carry drafts run in order.

Owns the scheduler (what to run) and the model runner (running it). The front talks to it through
EngineCoreRequest / abort lists and gets EngineCoreOutputs back, in-process (LLM) or over ZMQ.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from llmserve.config import EngineConfig
from llmserve.core.request import Request
from llmserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from llmserve.core.scheduler import Scheduler
from llmserve.engine.messages import EngineCoreOutputs, EngineCoreRequest
from llmserve.model.attention import select_attention_backend
from llmserve.model.loader import ModelInfo, load_model, load_model_info, resolve_dtype, resolve_model_path
from llmserve.spec.draft import DraftModelProposer
from llmserve.spec.ngram import NgramProposer
from llmserve.worker.cpu_threads import apply_num_threads
from llmserve.worker.cuda_graphs import DecodeGraphs
from llmserve.worker.gpu_profile import kv_budget_from_profile, profile_forward
from llmserve.worker.kv_cache import allocate_kv_caches, bytes_per_block, needs_gpu_profile, num_kv_blocks
from llmserve.worker.model_runner import ModelRunner
from llmserve.worker.step_handle import StepHandle

logger = logging.getLogger(__name__)


MAX_DEFAULT_GRAPH_BATCH = 512  # graphs captured up to max_num_seqs, at most this (vLLM's default too)


def device_memory(device: torch.device) -> int:
    """Bytes of memory of a CUDA device (0 elsewhere): the scheduler's defaults scale with it."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).total_memory


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def model_source(config: EngineConfig) -> tuple[str, str]:
    """(served name, local path) of the configured model; the demo model when none is given."""
    if config.model.model is None:
        from llmserve.model.demo import demo_model_path

        return "llmserve-demo", demo_model_path()
    return config.model.model, resolve_model_path(config.model.model, config.model.revision)


class EngineCore:
    def __init__(self, config: EngineConfig, has_front_beside: bool = False) -> None:
        """has_front_beside: this process serves beside an HTTP front (the engine-core process), which
        picks the CPU thread count for a small model (worker/cpu_threads.py)."""
        config.validate()  # before loading anything: a bad value fails in milliseconds
        self.device = resolve_device(config.model.device)
        config = dataclasses.replace(config, scheduler=config.scheduler.for_device(self.device.type,
                                                                                   device_memory(self.device)))
        self.config = config
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        name, path = model_source(config)
        self.model_info: ModelInfo = load_model_info(name, path, self.dtype, config.model.max_model_len)
        config.validate(self.model_info.max_model_len)  # the relations that need the model's context length
        model = load_model(path, self.dtype, self.device, self.model_info.max_model_len)
        self.num_threads = apply_num_threads(config.model.num_threads, model, self.device.type,
                                             has_front_beside)
        self.draft_info, draft_model = self._load_draft()
        attn_backend = select_attention_backend(self.device, config.model.attention_backend)
        self.num_blocks = self._num_blocks(model, attn_backend)
        kv_caches = allocate_kv_caches(model.kv_cache_shape(self.num_blocks, config.cache.block_size),
                                       self.model_info.num_layers, self.dtype, self.device)
        proposer = self._proposer(attn_backend, draft_model)
        graphs = self._decode_graphs(model, attn_backend, kv_caches)
        self.runner = ModelRunner(model, attn_backend, kv_caches, config.cache.block_size,
                                  self.model_info.vocab_size, self.device, config.model.seed, proposer, graphs,
                                  config.scheduler.max_num_seqs, self.model_info.max_model_len)
        self.scheduler = Scheduler(config.scheduler, config.cache, self.num_blocks, self.model_info.max_model_len,
                                   config.speculative)
        self.is_async = bool(config.scheduler.async_scheduling)
        self.in_flight: tuple[SchedulerOutput, StepHandle] | None = None  # launched, not finished
        logger.info("engine ready: %s on %s (%s, threads: %d), %d KV blocks of %d tokens, max_num_seqs %d, "
                    "token budget %d, async scheduling %s", name, self.device, self.dtype, self.num_threads,
                    self.num_blocks, config.cache.block_size, config.scheduler.max_num_seqs,
                    config.scheduler.max_num_batched_tokens, "on" if self.is_async else "off")

    def _load_draft(self) -> tuple[ModelInfo | None, torch.nn.Module | None]:
        """The draft model of --speculative draft: same vocabulary as the target, same dtype."""
        spec = self.config.speculative
        if spec.speculative != "draft":
            return None, None
        path = resolve_model_path(spec.draft_model, None)
        info = load_model_info(spec.draft_model, path, self.dtype, self.model_info.max_model_len)
        if info.vocab_size != self.model_info.vocab_size:
            raise ValueError(f"draft model vocabulary ({info.vocab_size}) differs from the target's "
                             f"({self.model_info.vocab_size}): it must share the tokenizer")
        return info, load_model(path, self.dtype, self.device, self.model_info.max_model_len)

    def _proposer(self, attn_backend, draft_model: torch.nn.Module | None):
        spec = self.config.speculative
        if spec.speculative == "ngram":
            return NgramProposer(spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max)
        if spec.speculative != "draft":
            return None
        info, block_size = self.draft_info, self.config.cache.block_size
        kv_caches = allocate_kv_caches(draft_model.kv_cache_shape(self.num_blocks, block_size),
                                       info.num_layers, self.dtype, self.device)
        return DraftModelProposer(draft_model, attn_backend, kv_caches, block_size, spec.num_speculative_tokens,
                                  self.model_info.max_model_len, self.device, self.config.model.seed)

    def _num_blocks(self, model: torch.nn.Module, attn_backend) -> int:
        """Blocks that fit the budget; with a draft model each block also holds the draft's KV."""
        cache, block_bytes, budget = self.config.cache, 0, None
        for info in (self.model_info, self.draft_info):
            if info is not None:
                block_bytes += bytes_per_block(info.num_layers, cache.block_size, info.num_kv_heads,
                                               info.head_dim, self.dtype)
        if needs_gpu_profile(cache, self.device):
            sched = self.config.scheduler
            profile = profile_forward(model, attn_backend, model.kv_cache_shape(1, cache.block_size),
                                      self.model_info.num_layers, self.dtype, self.device,
                                      min(sched.max_num_batched_tokens, self.model_info.max_model_len),
                                      sched.max_num_seqs)
            budget = kv_budget_from_profile(profile, cache.gpu_memory_utilization)
        return num_kv_blocks(cache, block_bytes, self.model_info.max_model_len, budget)

    def _decode_graphs(self, model: torch.nn.Module, attn_backend,
                       kv_caches: list[torch.Tensor]) -> DecodeGraphs | None:
        """CUDA graphs of decode batches, captured now (CUDA with the Triton backend, unless --enforce-eager)."""
        cfg = self.config.model
        if self.device.type != "cuda" or cfg.enforce_eager or attn_backend.name != "triton":
            return None
        max_blocks = -(-self.model_info.max_model_len // self.config.cache.block_size)
        max_batch = min(cfg.max_graph_batch or MAX_DEFAULT_GRAPH_BATCH, self.config.scheduler.max_num_seqs)
        graphs = DecodeGraphs(model, attn_backend, kv_caches, max_batch, max_blocks, self.device)
        graphs.capture()
        return graphs

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request.from_engine_core_request(request, self.model_info.max_model_len))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.in_flight is not None

    def step(self) -> EngineCoreOutputs:
        start = time.perf_counter()
        if self.is_async and not self.scheduler.can_speculate():
            outputs = self._step_overlapped()
        elif self.in_flight is not None:
            outputs = self._finish_in_flight()  # leaving overlap: the step in flight first
        else:
            sched_out = self.scheduler.schedule()
            outputs = self.scheduler.update_from_output(sched_out, self._execute(sched_out))
        if outputs.stats is not None:
            outputs.stats.step_time = time.perf_counter() - start
        return outputs

    def _execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        if sched_out.is_empty:
            self.runner.drop_finished(sched_out.finished_req_ids)
            return ModelRunnerOutput([], [])
        return self.runner.execute(sched_out)

    def _step_overlapped(self) -> EngineCoreOutputs:
        """Schedule and launch step N+1, then finish and update from step N."""
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            self.runner.drop_finished(sched_out.finished_req_ids)
            if self.in_flight is None:
                return self.scheduler.update_from_output(sched_out, ModelRunnerOutput([], []))
            return self._finish_in_flight()
        handle = self.runner.launch(sched_out)
        previous, self.in_flight = self.in_flight, (sched_out, handle)
        if previous is None:  # the first step of a run: nothing finished yet
            return EngineCoreOutputs(outputs=self.scheduler.take_aborted_outputs())
        return self.scheduler.update_from_output(previous[0], self.runner.finish(previous[1]))

    def _finish_in_flight(self) -> EngineCoreOutputs:
        (sched_out, handle), self.in_flight = self.in_flight, None
        return self.scheduler.update_from_output(sched_out, self.runner.finish(handle))

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def num_free_blocks(self) -> int:
        return self.scheduler.kv.pool.get_num_free_blocks()

    def cache_stats(self) -> tuple[int, int, float, int]:
        """(usable KV blocks, free KV blocks, usage fraction, unfinished requests) right now."""
        pool = self.scheduler.kv.pool
        return (pool.num_usable_blocks, pool.get_num_free_blocks(), pool.usage(),
                self.scheduler.get_num_unfinished_requests())

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        pending = set(self.scheduler.requests) | self.scheduler.finished_req_ids
        assert set(self.runner.states) <= pending, "runner holds finished requests"
        self.runner.check_integrity()
