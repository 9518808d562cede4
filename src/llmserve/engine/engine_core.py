"""The engine core: one step is schedule -> execute -> update_from_output.

With async scheduling (CUDA by default) execute is split: the step schedules and launches step N+1,
then finishes step N (its sampled ids reach the host) and updates from it, so the host's work for
N+1 overlaps the device's work on N. Steps that may carry drafts run in order.

Owns the scheduler (what to run) and the worker (the model, its KV cache and the runner that runs it). The front talks to it through
EngineCoreRequest / abort lists and gets EngineCoreOutputs back, in-process (LLM) or over ZMQ.
With --tensor-parallel-size N > 1 the worker is rank 0 of N and steps go through a TPExecutor, which
broadcasts each step to the other ranks first (worker/tp_executor.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from llmserve.config import EngineConfig
from llmserve.core.kv_cache_groups import KVCacheLayout, kv_cache_layout
from llmserve.core.request import Request
from llmserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from llmserve.core.scheduler import Scheduler
from llmserve.engine.kv_transfer import KVReceiver, KVSender, build_kv_connector
from llmserve.engine.startup_summary import startup_line
from llmserve.heap import freeze_startup_heap
from llmserve.messages import EngineCoreOutputs, EngineCoreRequest, KVTierStats
from llmserve.model import deepseek, quant
from llmserve.model.loader import (ModelInfo, load_hf_config, load_model_info, load_tokenizer, resolve_dtype,
                                   resolve_model_path)
from llmserve.model.parallel import check_tensor_parallel
from llmserve.model.pooler_config import is_embedding_checkpoint, is_sentence_transformers
from llmserve.structured.compiler import GrammarCompiler
from llmserve.structured.matcher import RequestGrammar
from llmserve.worker.cpu_threads import xgrammar_threads
from llmserve.worker.decode_window import WindowEnds
from llmserve.worker.step_handle import StepHandle
from llmserve.worker.worker import Worker, device_memory, resolve_device

logger = logging.getLogger(__name__)
GRAMMAR_POLL_S = 0.005  # an engine whose only requests wait for their grammar checks its inputs this often
LORA_READ_POLL_S = 0.005  # likewise one waiting for its adapter's read from disk (worker/lora_reader.py)
KV_LOAD_POLL_S = 0.005  # likewise one waiting for its KV tiers' loads or saves (core/kv_loading.py, kv_saving.py)


def model_source(config: EngineConfig) -> tuple[str, str]:
    """(served name, local path) of the configured model; the demo model when none is given."""
    if config.model.model is None:
        from llmserve.model.demo import demo_model_path

        return "llmserve-demo", demo_model_path()
    return config.model.model, resolve_model_path(config.model.model, config.model.revision)


def log_kv_cache_layout(layout: KVCacheLayout, layer_windows: tuple[int, ...]) -> tuple[int, ...]:
    """Each KV cache group's window (core/kv_cache_groups.py), logged where some layer slides."""
    if layout.is_hybrid:
        logger.info("KV cache: %s: each sliding group gives back the blocks that left its window", layout.describe())
    elif layout.group_windows[0]:
        logger.info("KV cache: every layer slides (window %d): blocks before the window go back to the pool",
                    layout.group_windows[0])
    elif any(layer_windows):
        logger.info("KV cache: full and sliding-window layers in one group (--disable-hybrid-kv-cache-manager): "
                    "every block is kept for the whole sequence, so the window raises no KV capacity")
    return layout.group_windows


def checked_kv_cache_layout(config: EngineConfig, layer_windows: tuple[int, ...]) -> KVCacheLayout:
    """The KV cache groups (the worker makes the same). A draft model keeps its cache in the target's first
    group's blocks (spec/draft.py), which must then be a full-attention group (it keeps every block); without one
    the draft is refused before anything loads."""
    layout = kv_cache_layout(layer_windows, not config.cache.disable_hybrid_kv_cache_manager)
    if layout.is_hybrid and config.speculative.has_draft_cache and layout.group_windows[0] != 0:
        raise ValueError("--speculative draft with a model whose layers all slide, over windows of several "
                         "sizes, is not supported with per-group block tables (the draft's cache needs a "
                         "full-attention group): add --disable-hybrid-kv-cache-manager")
    return layout


def resolve_runner(config: EngineConfig, path: str) -> EngineConfig:
    """--runner auto made pooling for an embedding checkpoint (model/pooler_config.py), else generate, and the
    config checked again (a pooling engine refuses some flags)."""
    if config.model.runner != "auto":
        return config
    runner = "pooling" if is_embedding_checkpoint(path) else "generate"
    if runner == "pooling":
        logger.info("%s is an embedding model: serving it with --runner pooling (POST /v1/embeddings)", path)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, runner=runner))
    config.validate()
    return config


def pooling_engine_config(config: EngineConfig) -> EngineConfig:
    """A pooling engine's steps run in order, one forward each (its requests end when their prompt does:
    nothing to overlap, no decode step); the prefix cache holds no hidden states, so only last-token
    pooling, which needs none of the cached tokens', keeps it (as vLLM does)."""
    if not config.model.is_pooling:
        return config
    scheduler = dataclasses.replace(config.scheduler, async_scheduling=False, num_scheduler_steps=1)
    return dataclasses.replace(config, scheduler=scheduler)


class EngineCore:
    def __init__(self, config: EngineConfig, is_served: bool = False) -> None:
        """is_served: this process serves beside an HTTP front (the engine-core process), which
        picks the CPU thread count for a small model (worker/cpu_threads.py)."""
        config.validate()  # before loading anything: a bad value fails in milliseconds
        name, path = model_source(config)
        config = pooling_engine_config(resolve_runner(config, path))
        self.device = resolve_device(config.model.device)
        config = dataclasses.replace(config, scheduler=config.scheduler.for_device(self.device.type,
                                                                                   device_memory(self.device)))
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        config = dataclasses.replace(config, speculative=config.speculative.for_device(
            self.device.type, self.dtype == torch.float32))
        self.config = config
        self.model_info: ModelInfo = load_model_info(name, path, self.dtype, config.model.max_model_len,
                                                     config.model.quantization, config.model.disable_sliding_window,
                                                     config.model.is_pooling, config.model.pooler_config)
        is_latent = self.model_info.architecture in deepseek.ARCHITECTURES  # its int8 cache: any width (torch reads it)
        quant.check_supported(self.model_info.quantization, config.cache.kv_cache_dtype, self.device, self.dtype,
                              None if is_latent else self.model_info.head_dim)
        config.validate(self.model_info.max_model_len)  # the relations that need the model's context length
        kv_layout = checked_kv_cache_layout(config, self.model_info.layer_windows)
        if self.model_info.pooler is None and is_sentence_transformers(path):
            logger.warning("%s is a sentence-transformers (embedding) model served with --runner generate: "
                           "drop --runner generate to serve its embeddings (POST /v1/embeddings)", name)
        if self.model_info.pooler is not None and self.model_info.pooler.pooling_type != "LAST":
            config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, enable_prefix_caching=False))
            self.config = config
        self.tp_executor = self._tp_executor(config, path, is_served)
        self.worker = self.tp_executor.worker if self.tp_executor else \
            Worker(config, self.model_info, path, self.device, self.dtype, is_served)
        self.runner, self.num_blocks, self.num_threads = self.worker.runner, self.worker.num_blocks, self.worker.num_threads
        self.threads_reason = self.worker.threads_reason
        assert self.worker.kv_layout == kv_layout, "the worker's KV cache groups differ from the scheduler's"
        self.executor = self.tp_executor or self.runner  # what runs steps: launch / finish / execute / drop_finished
        self.kv_connector = build_kv_connector(config.kv_transfer, self.runner.kv_caches)
        self.scheduler = Scheduler(config.scheduler, config.cache, self.num_blocks, self.model_info.max_model_len,
                                   config.speculative, log_kv_cache_layout(kv_layout, self.model_info.layer_windows),
                                   self.kv_connector, config.lora.max_loras if config.lora.enable_lora else 0,
                                   self.runner.lora)
        self.kv_sender, self.kv_receiver = self._kv_transports(config)
        self.is_async = bool(config.scheduler.async_scheduling)
        tokenizer_path = resolve_model_path(config.model.tokenizer, config.model.revision) if config.model.tokenizer else path
        self.grammars = GrammarCompiler(lambda: load_tokenizer(tokenizer_path), self.model_info.vocab_size,
                                        self.model_info.eos_token_ids, num_threads=xgrammar_threads())
        self.in_flight: tuple[SchedulerOutput, StepHandle] | None = None  # launched, not finished
        logger.info("%s", startup_line(self))
        freeze_startup_heap()

    def _kv_transports(self, config: EngineConfig) -> tuple[KVSender | None, KVReceiver | None]:
        mode = config.kv_transfer.disaggregation_mode
        if mode == "prefill":
            kv = self.scheduler.kv
            return KVSender(kv.pool, self.runner.kv_caches, config.cache.block_size, kv.num_groups), None
        if mode == "decode":
            receiver = KVReceiver(self.kv_connector, config.kv_transfer.disaggregation_kv_port,
                                  self.scheduler.kv.num_groups)
            kv_transfer = dataclasses.replace(config.kv_transfer, disaggregation_kv_port=receiver.port)
            self.config = dataclasses.replace(config, kv_transfer=kv_transfer)  # port 0: the one bound
            return None, receiver
        return None, None

    def _tp_executor(self, config: EngineConfig, path: str, is_served: bool):
        size = config.parallel.tensor_parallel_size
        if size == 1:
            return None
        # before spawning: a clear error in milliseconds
        check_tensor_parallel(load_hf_config(path), size, config.parallel.enable_expert_parallel)
        # each rank's slices quantized (model/quant/parallel.py); fp8's CUDA decode kernel and step kinds were
        # not tried over ranks yet
        if self.model_info.quantization == "fp8" and self.device.type == "cuda":
            raise ValueError(f"--tensor-parallel-size {size} with quantization (fp8) on CUDA is not supported yet: "
                             "serve it with --quantization int8, unquantized (--quantization none) or on one rank")
        if self.device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"--tensor-parallel-size {size} needs {size} GPUs; {torch.cuda.device_count()} visible")
        from llmserve.worker.tp_executor import TPExecutor

        return TPExecutor(config, self.model_info, self.device, self.dtype, is_served)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do without tensor parallelism)."""
        if self.tp_executor is not None:
            self.tp_executor.shutdown()
        for part in (self.kv_receiver, self.kv_sender, self.kv_connector):
            if part is not None:
                part.close()

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.lora is not None and not self.config.lora.enable_lora:
            raise ValueError(f"request {request.request_id} asks for LoRA adapter {request.lora.lora_name!r}, "
                             "but this engine runs without --enable-lora")
        core_request = Request.from_engine_core_request(request, self.model_info.max_model_len)
        if self.kv_sender is not None and request.sampling_params.kv_transfer_params is not None:
            block_size = self.config.cache.block_size
            hashes = core_request.update_block_hashes(block_size)[:core_request.num_prompt_tokens // block_size]
            self.kv_sender.add(request, list(hashes))  # its prompt's full blocks go to the decode server
        constraint = request.sampling_params.structured_outputs
        if constraint is not None:  # compiled on the grammar thread; the request waits for it aside
            core_request.grammar = RequestGrammar(self.grammars.submit(constraint), constraint.reasoning_end)
        self.scheduler.add_request(core_request)

    def interrupt_windows_on_input(self, has_input: Callable[[], bool]) -> None:
        """For an engine whose outputs are read as they come (the engine-core process), a multi-step ends
        after the forward where `has_input()` turns true, or where some row ran its last forward
        (worker/decode_window.py): a request that arrives meanwhile waits one forward, not the window, and
        a finished request's output leaves at once (its client may be waiting to send the next). Not with
        tensor parallelism, whose ranks run each window whole (they cannot see this engine's input)."""
        if self.tp_executor is None:
            self.runner.window_ends = WindowEnds(has_input=has_input, is_at_first_finish=True)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.in_flight is not None or self._has_kv_saves()

    def _has_kv_saves(self) -> bool:
        """Saves to the KV tiers on their way (their blocks held, or not in the tiers yet): the engine steps
        (waiting on them) until they are done, so that when it goes idle nothing is held and the tiers are whole."""
        return self.kv_connector is not None and (self.scheduler.kv.saves.num_held > 0
                                                  or not self.kv_connector.wait_for_saves(timeout=0))

    def step(self) -> EngineCoreOutputs:
        start = time.perf_counter()
        # Drafts need the previous step's tokens before the next is scheduled: no overlap. Grammars need them
        # only before the next step's bitmask, which `_step_overlapped` lets the runner wait for.
        if self.is_async and not self.scheduler.can_speculate():
            outputs = self._step_overlapped()
        elif self.in_flight is not None:
            outputs = self._finish_in_flight()  # leaving overlap: the step in flight first
        else:
            sched_out = self._schedule()
            outputs = self.scheduler.update_from_output(sched_out, self._execute(sched_out))
        if self.kv_sender is not None:
            self.kv_sender.on_outputs(outputs)  # before the next schedule can evict the blocks it sends
        if outputs.stats is not None:
            outputs.stats.step_time = time.perf_counter() - start
            outputs.stats.grammar = self.grammars.take_stats()
            outputs.stats.expert_balance = self._take_expert_balance()
            outputs.stats.kv_tiers = self._take_kv_stats()
            if self.runner.lora is not None:
                outputs.stats.resident_loras = self.runner.lora.resident_names()
        return outputs

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's step; then the KV tiers' loads and saves it started run in the background
        (core/kv_loading.py, core/kv_saving.py). A step with nothing to run waits briefly for what would give it
        some (a grammar's compile, an adapter's read, a KV load or save) instead of spinning."""
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty and self.in_flight is None and len(self.scheduler.compiling):
            self.scheduler.compiling.wait(GRAMMAR_POLL_S)  # nothing to run until a grammar compiles
        if sched_out.is_empty and self.in_flight is None and self.runner.lora is not None:
            self.runner.lora.reader.wait(LORA_READ_POLL_S)  # nothing to run until an adapter's read ends
        if self.kv_connector is not None:  # also lets go of blocks matched but not loaded
            self.kv_connector.apply()
            if sched_out.is_empty and self.in_flight is None:  # nothing to run until a load or a save ends
                if not self.scheduler.wait_for_kv(KV_LOAD_POLL_S):
                    self.kv_connector.wait_for_saves(KV_LOAD_POLL_S)
        return sched_out

    def _take_kv_stats(self) -> KVTierStats | None:
        stats = self.kv_connector.take_stats() if self.kv_connector is not None else None
        num_sent = self.kv_sender.take_num_sent() if self.kv_sender is not None else 0
        if num_sent:
            stats = stats or KVTierStats()
            stats.num_sent_blocks = num_sent
        return stats

    def _take_expert_balance(self) -> float | None:
        take = getattr(self.runner.model, "take_expert_balance", None)  # CausalLM's; other models have none
        return None if take is None else take()

    def _execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        if sched_out.is_empty:
            self.executor.drop_finished(sched_out.finished_req_ids)
            return ModelRunnerOutput([], [])
        return self.executor.execute(sched_out)

    def _step_overlapped(self) -> EngineCoreOutputs:
        """Schedule and launch step N+1, then finish and update from step N."""
        sched_out = self._schedule()
        if sched_out.is_empty:
            self.executor.drop_finished(sched_out.finished_req_ids)
            if self.in_flight is None:
                return self.scheduler.update_from_output(sched_out, ModelRunnerOutput([], []))
            return self._finish_in_flight()
        previous, self.in_flight = self.in_flight, None
        finished: list[EngineCoreOutputs] = []

        def finish_previous() -> None:  # step N's update, once; inside the launch when step N+1 has grammars
            if previous is not None and not finished:
                finished.append(self.scheduler.update_from_output(previous[0], self.executor.finish(previous[1])))

        # With grammars the runner calls back once N+1's forward is queued: N's tokens advance the matchers
        # while the device runs that forward, and N+1's bitmask follows them.
        handle = self.executor.launch(sched_out, catch_up=finish_previous if sched_out.grammar is not None else None)
        self.in_flight = (sched_out, handle)
        if previous is None:  # the first step of a run: nothing finished yet
            return EngineCoreOutputs(outputs=self.scheduler.take_aborted_outputs())
        finish_previous()
        return finished[0]

    def _finish_in_flight(self) -> EngineCoreOutputs:
        (sched_out, handle), self.in_flight = self.in_flight, None
        return self.scheduler.update_from_output(sched_out, self.executor.finish(handle))

    def reset_prefix_cache(self) -> bool:
        is_reset = self.scheduler.reset_prefix_cache()
        if is_reset and self.kv_connector is not None:
            self.kv_connector.reset()
        return is_reset

    def num_free_blocks(self) -> int:
        return self.scheduler.kv.pool.get_num_free_blocks()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        pending = set(self.scheduler.requests) | self.scheduler.finished_req_ids
        assert set(self.runner.states) <= pending, "runner holds finished requests"
        self.runner.check_integrity()
        if self.kv_connector is not None:
            self.kv_connector.check_integrity()
