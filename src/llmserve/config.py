"""Frozen configuration records. Each default is written once, here; the CLI is built from them."""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any

from llmserve.json_flags import parse_json_object_flag
from llmserve.pooling import RUNNERS, parse_pooler_override


def check(is_ok: bool, flag: str, message: str) -> None:
    """ValueError('--flag: message') unless `is_ok`: a config error names the CLI flag that sets it."""
    if not is_ok:
        raise ValueError(f"--{flag}: {message}")


def check_min(flag: str, value: float | None, minimum: float) -> None:
    """`value` (None: unset, allowed) is at least `minimum`."""
    check(value is None or value >= minimum, flag, f"must be >= {minimum}, got {value}")


def check_choice(flag: str, value: Any, choices: tuple[Any, ...]) -> None:
    check(value in choices, flag, f"must be one of {', '.join(map(str, choices))}; got {value!r}")


def check_field_choices(config) -> None:
    """Each set field of a config dataclass whose metadata lists `choices` (the CLI's too) holds one of them:
    the list is written once, beside the field."""
    for f in dataclasses.fields(config):
        value, choices = getattr(config, f.name), f.metadata.get("choices")
        if choices is not None and value is not None:
            check_choice(f.metadata.get("flag", f.name.replace("_", "-")), value, tuple(choices))


LARGE_GPU_MEMORY = 70 * 2**30  # an 80 GB card (H100, A100-80G) and up: vLLM's larger defaults
CPU_SCHEDULER_STEPS = 64  # decode forwards a CPU engine step may run (SchedulerConfig.num_scheduler_steps)
KV_CACHE_DTYPES = ("auto", "fp8", "fp16", "int8")  # which device/dtype each runs on: model/quant check_supported


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = field(default=None, metadata={"help": "HF directory or hub id (default: the embedded demo model)"})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer directory or hub id (default: the model's)"})
    revision: str | None = field(default=None, metadata={"help": "hub revision"})
    dtype: str = field(default="auto", metadata={"help": "auto | float32 | bfloat16 | float16", "choices": ["auto", "float32", "bfloat16", "float16"]})
    max_model_len: int | None = field(default=None, metadata={"help": "context length (default: the model's)"})
    seed: int = field(default=0, metadata={"help": "seed of the engine's sampler for unseeded requests"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda"})
    attention_backend: str = field(default="auto", metadata={"help": "auto (triton on CUDA, torch + C++ kernel on CPU) | torch | triton", "choices": ["auto", "torch", "triton"]})
    disable_sliding_window: bool = field(default=False, metadata={"help": "full attention on every layer, the context "
                                         "(max_model_len) capped to the smallest sliding window (vLLM's flag; "
                                         "no-op without windows)"})
    enforce_eager: bool = field(default=False, metadata={"help": "never capture CUDA graphs (CUDA only; CPU is always eager)"})
    max_graph_batch: int | None = field(default=None, metadata={
        "help": "largest decode batch captured in a CUDA graph (default: max_num_seqs, at most 512)",
        "flag": "max-cudagraph-capture-size", "aliases": ["max-graph-batch"]})
    quantization: str | None = field(default=None, metadata={"help": "int8 (W8A8 dynamic per token, CPU and CUDA) | fp8 (float8 e4m3 weights and activations; CUDA compute capability >= 8.9, CPU runs a reference path) | none (default: the checkpoint's own: fp8 for an FP8 checkpoint, else none)", "choices": ["int8", "fp8", "none"]})
    num_threads: int | None = field(default=None, metadata={"help": "CPU threads of the model's ops (default: one per "
                                    "core; a server on CPU gives a model too small to split one, leaving the rest to its HTTP front)"})
    runner: str = field(default="auto", metadata={"help": "auto (pooling for an embedding checkpoint: a "
                        "sentence-transformers folder or a bare decoder such as Qwen3Model; else generate) | generate "
                        "(completions, chat, responses) | pooling (an embedding model: /v1/embeddings only, each "
                        "prompt pooled into one vector)", "choices": ["auto", "generate", "pooling"]})
    pooler_config: str | None = field(default=None, metadata={"help": "--runner pooling: JSON overriding the "
                                      "checkpoint's pooling: pooling_type (LAST | MEAN | CLS), normalize (true | false) "
                                      "(default: a sentence-transformers folder's own, else LAST, normalized)"})

    def validate(self) -> None:
        check_field_choices(self)
        check_min("max-model-len", self.max_model_len, 1)
        check(self.device in ("auto", "cpu") or self.device.split(":")[0] == "cuda", "device",
              f"must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        check_min("max-cudagraph-capture-size", self.max_graph_batch, 1)
        check_min("num-threads", self.num_threads, 1)
        check(self.pooler_config is None or self.runner != "generate", "pooler-config",
              "only for an embedding model (--runner pooling, or auto on an embedding checkpoint)")
        parse_pooler_override(self.pooler_config)  # ValueError naming --pooler-config

    @property
    def is_pooling(self) -> bool:
        """--runner pooling, or auto resolved to it (engine/runner_choice.py); False while auto is unresolved."""
        return self.runner == "pooling"


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    kv_cache_memory: str | None = field(default=None, metadata={"help": "KV cache bytes, e.g. 4GiB (default on CPU: "
                                        "a quarter of available RAM, at most 8GiB and twice what --max-num-seqs "
                                        "sequences of --max-model-len fill; on CUDA: what --gpu-memory-utilization "
                                        "leaves)", "flag": "kv-cache-memory-bytes", "aliases": ["kv-cache-memory"]})
    num_kv_blocks: int | None = field(default=None, metadata={
        "help": "exact number of KV blocks (overrides --kv-cache-memory-bytes)", "flag": "num-gpu-blocks-override",
        "aliases": ["num-kv-blocks"]})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse cached KV blocks of shared prefixes",
                                                                "aliases": ["prefix-caching"]})
    gpu_memory_utilization: float = field(default=0.9, metadata={"help": "fraction of GPU memory the engine may use"})
    kv_cache_dtype: str = field(default="auto", metadata={"help": "auto (the model's dtype) | fp8 (float8 e4m3: half "
                                "a bfloat16 cache's bytes; Triton backend reads it, the CPU torch path is a reference) "
                                "| fp16 (float32 models on CPU: half the bytes, twice the blocks; the CPU kernel reads "
                                "it with F16C and computes in float32) | int8 (float32 models on CPU with the AVX2 kernels: a "
                                "quarter of the bytes plus a scale per token and kv head, the kernel widens it and "
                                "computes in float32)", "choices": list(KV_CACHE_DTYPES)})
    disable_hybrid_kv_cache_manager: bool = field(default=False, metadata={"help": "one block table for every "
                                                  "layer of a model that mixes full and sliding-window layers, "
                                                  "which then keeps every block of its sliding layers too (vLLM's "
                                                  "flag; default: a KV cache group per attention kind, "
                                                  "core/kv_cache_groups.py)"})

    def validate(self) -> None:
        check_field_choices(self)
        check_min("block-size", self.block_size, 1)
        if self.kv_cache_memory is not None:
            check(parse_bytes(self.kv_cache_memory, "kv-cache-memory-bytes") > 0, "kv-cache-memory-bytes",
                  f"must be positive, got {self.kv_cache_memory!r}")
        check_min("num-gpu-blocks-override", self.num_kv_blocks, 2)  # the null block and one more
        check(0 < self.gpu_memory_utilization <= 1, "gpu-memory-utilization",
              f"must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int | None = field(default=None, metadata={"help": "most requests running at once (default: 128 on "
                                     "CPU; on CUDA 1024 with 70 GiB of device memory or more, else 256)"})
    max_num_batched_tokens: int | None = field(default=None, metadata={"help": "token budget of one engine step "
                                               "(default: on CUDA 8192 with 70 GiB of device memory or more, else 2048; "
                                               "512 on CPU, where 2,048 tokens are seconds of compute: shorter steps "
                                               "give earlier first tokens, shorter stalls)"})
    enable_chunked_prefill: bool = field(default=True, metadata={"help": "split long prompts across steps"})
    max_prefill_tokens_while_decoding: int | None = field(default=None, metadata={"help": "while requests decode, at most this many prompt tokens per step: bounds inter-token latency (default: the whole token budget)"})
    policy: str = field(default="fcfs", metadata={"help": "fcfs | priority", "choices": ["fcfs", "priority"],
                                                  "flag": "scheduling-policy", "aliases": ["policy"]})
    async_scheduling: bool | None = field(default=None, metadata={"help": "schedule and prepare step N+1 while the "
                                          "device runs step N (default: on for CUDA, off on CPU, where the host is "
                                          "the device and nothing overlaps)"})
    num_scheduler_steps: int | None = field(default=None, metadata={"help": "decode forwards one engine step may "
                                            "run back to back when no request watches its tokens one by one (every "
                                            "running request reports only its final output, as offline generate's "
                                            "do; the server reads every token), none waits for a free seat and none "
                                            "has drafts or a grammar: scheduling, bookkeeping and outputs once per "
                                            f"this many tokens (default: {CPU_SCHEDULER_STEPS} on CPU, where that host work "
                                            "competes with the forward; 1, off, with async scheduling, which "
                                            "overlaps it instead)"})

    def validate(self) -> None:
        check_field_choices(self)
        check_min("max-num-seqs", self.max_num_seqs, 1)
        check_min("num-scheduler-steps", self.num_scheduler_steps, 1)
        check(not (self.async_scheduling and (self.num_scheduler_steps or 1) > 1), "num-scheduler-steps",
              f"{self.num_scheduler_steps} runs without async scheduling: add --no-async-scheduling")
        check_min("max-num-batched-tokens", self.max_num_batched_tokens, 1)
        check_min("max-prefill-tokens-while-decoding", self.max_prefill_tokens_while_decoding, 1)

    def for_device(self, device_type: str, device_memory: int = 0) -> SchedulerConfig:
        """This config with the device's defaults filled in (`device_memory`: bytes of a CUDA device)."""
        is_big_gpu = device_type == "cuda" and device_memory >= LARGE_GPU_MEMORY
        defaults = {"max_num_seqs": 128 if device_type != "cuda" else 1024 if is_big_gpu else 256,
                    "max_num_batched_tokens": 512 if device_type != "cuda" else 8192 if is_big_gpu else 2048,
                    "async_scheduling": device_type == "cuda" and (self.num_scheduler_steps or 1) == 1}
        is_async = defaults["async_scheduling"] if self.async_scheduling is None else self.async_scheduling
        defaults["num_scheduler_steps"] = 1 if is_async or device_type == "cuda" else CPU_SCHEDULER_STEPS
        unset = {name: value for name, value in defaults.items() if getattr(self, name) is None}
        return dataclasses.replace(self, **unset) if unset else self


@dataclass(frozen=True)
class SpeculativeConfig:
    speculative: str | None = field(default=None, metadata={"help": "speculative decoding: ngram (prompt lookup) | draft (a smaller model); default off", "choices": ["ngram", "draft"]})
    num_speculative_tokens: int = field(default=4, metadata={"help": "draft tokens proposed per request and step (k)"})
    draft_model: str | None = field(default=None, metadata={"help": "HF directory or hub id of the draft model (--speculative draft); same tokenizer as the target"})
    ngram_max: int = field(default=4, metadata={"help": "ngram: longest suffix matched against the prompt and output so far"})
    ngram_min: int = field(default=1, metadata={"help": "ngram: shortest suffix matched"})
    speculative_max_batch: int = field(default=8, metadata={"help": "switch speculation off for a step when more requests than this run (measured: docs/benchmarks.md)"})
    speculative_dynamic: bool = field(default=False, metadata={"help": "speculate, per step and request, only where the measured cost of drafting and verifying buys more tokens per second than plain decoding, from each request's running acceptance (docs/speculative.md; experimental: on CPU it matches the cap alone at batch 1-8 within noise and beats always speculating above it, docs/benchmarks.md); off: every request speculates up to --speculative-max-batch"})
    draft_vocab_size: int | None = field(default=None, metadata={"help": "--speculative draft: the draft's "
                                         "head keeps only the first N token ids (the most frequent in BPE and "
                                         "SentencePiece vocabularies; EAGLE-3 and FR-Spec reduce the draft's "
                                         "vocabulary so): a cheaper draft forward, still exact; default: the "
                                         "whole vocabulary"})
    draft_token_map: str | None = field(default=None, metadata={"help": "--speculative draft: a JSON list of token "
                                        "ids, most frequent first (FR-Spec's frequency-ranked vocabulary): the "
                                        "draft's head keeps these (the first --draft-vocab-size of them when "
                                        "given) instead of the first ids"})
    speculative_queue_drafts: bool = field(default=False, metadata={"help": "draft model on CUDA with graphs: queue the next step's proposal on the device behind each verification whose rows all carried k drafts, so the host waits once for both (experimental: measured slower on an H100, docs/benchmarks.md)"})

    @property
    def is_enabled(self) -> bool:
        return self.speculative is not None

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past the scheduled tokens that the draft model writes while it proposes."""
        return self.num_speculative_tokens if self.speculative == "draft" else 0

    def validate(self) -> None:
        check_field_choices(self)
        check_min("num-speculative-tokens", self.num_speculative_tokens, 1)
        check_min("ngram-min", self.ngram_min, 1)
        check(self.ngram_min <= self.ngram_max, "ngram-max",
              f"must be >= --ngram-min ({self.ngram_min}), got {self.ngram_max}")
        check_min("speculative-max-batch", self.speculative_max_batch, 1)
        check(isinstance(self.speculative_dynamic, bool), "speculative-dynamic",
              f"must be true or false, got {self.speculative_dynamic!r}")
        check(isinstance(self.speculative_queue_drafts, bool), "speculative-queue-drafts",
              f"must be true or false, got {self.speculative_queue_drafts!r}")
        check((self.speculative == "draft") == (self.draft_model is not None), "draft-model",
              "required with --speculative draft, and only then")
        check_min("draft-vocab-size", self.draft_vocab_size, 1)
        check(self.draft_vocab_size is None or self.speculative == "draft", "draft-vocab-size",
              "only with --speculative draft")
        check(self.draft_token_map is None or self.speculative == "draft", "draft-token-map",
              "only with --speculative draft")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = field(default=1, metadata={"help": "split every layer over this many devices, one "
                                      "process each (CUDA: GPUs 0..N-1 over NCCL; CPU: processes over gloo, for tests)"})

    def validate(self) -> None:
        check_field_choices(self)
        check_min("tensor-parallel-size", self.tensor_parallel_size, 1)


DISAGGREGATION_MODES = ("null", "prefill", "decode")
DEFAULT_DISK_TIER_BYTES = "16GiB"
DEFAULT_DECODE_HOST_TIER_BYTES = "2GiB"
DEFAULT_KV_PORT = 14579  # vLLM's kv_port default


@dataclass(frozen=True)
class KVTransferConfig:
    """KV blocks beyond the device's cache: the tiers below it and prefill/decode disaggregation
    (docs/disaggregation.md)."""

    kv_offload_memory: str | None = field(default=None, metadata={
        "help": "host memory for KV blocks evicted from the device's prefix cache, e.g. 8GiB: a later prefix "
                "hit there is copied back instead of recomputed (default: off; a decode server's default: "
                f"{DEFAULT_DECODE_HOST_TIER_BYTES}, where its prefill server's blocks arrive)"})
    kv_offload_disk: str | None = field(default=None, metadata={
        "help": "a directory for KV blocks evicted from host memory (or from the device, without "
                "--kv-offload-memory); each block file is checksummed, a bad one is recomputed (default: off)"})
    kv_offload_disk_bytes: str | None = field(default=None, metadata={
        "help": f"bytes of --kv-offload-disk (default: {DEFAULT_DISK_TIER_BYTES})"})
    disaggregation_mode: str = field(default="null", metadata={
        "help": "null (prefill and decode in one engine) | prefill (compute prompts and send their KV blocks "
                "to the decode server a request names) | decode (receive KV blocks on --disaggregation-kv-port); "
                "SGLang's flag, the router pairs the two: llmserve route --pd-disaggregation",
        "choices": list(DISAGGREGATION_MODES)})
    disaggregation_kv_port: int = field(default=DEFAULT_KV_PORT, metadata={
        "help": "decode server: the TCP port its KV receiver binds (ZMQ), advertised at GET /kv_transfer"})

    @property
    def is_offloading(self) -> bool:
        return (self.kv_offload_memory is not None or self.kv_offload_disk is not None
                or self.disaggregation_mode == "decode")

    def host_tier_bytes(self) -> int | None:
        if self.kv_offload_memory is not None:
            return parse_bytes(self.kv_offload_memory, "kv-offload-memory")
        return parse_bytes(DEFAULT_DECODE_HOST_TIER_BYTES) if self.disaggregation_mode == "decode" else None

    def disk_tier_bytes(self) -> int:
        return parse_bytes(self.kv_offload_disk_bytes or DEFAULT_DISK_TIER_BYTES, "kv-offload-disk-bytes")

    def validate(self) -> None:
        if self.kv_offload_memory is not None:
            check(parse_bytes(self.kv_offload_memory, "kv-offload-memory") > 0, "kv-offload-memory",
                  f"must be positive, got {self.kv_offload_memory!r}")
        check(self.kv_offload_disk != "", "kv-offload-disk", "must name a directory")
        check(self.kv_offload_disk_bytes is None or self.kv_offload_disk is not None, "kv-offload-disk-bytes",
              "only with --kv-offload-disk")
        check(self.disk_tier_bytes() > 0, "kv-offload-disk-bytes",
              f"must be positive, got {self.kv_offload_disk_bytes!r}")
        check_choice("disaggregation-mode", self.disaggregation_mode, DISAGGREGATION_MODES)
        check(0 < self.disaggregation_kv_port < 65536, "disaggregation-kv-port",
              f"must be a TCP port (1-65535), got {self.disaggregation_kv_port}")
        check(self.disaggregation_kv_port == DEFAULT_KV_PORT or self.disaggregation_mode == "decode",
              "disaggregation-kv-port", "only with --disaggregation-mode decode (the decode server binds it)")


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = field(default=False, metadata={"help": "serve LoRA adapters (PEFT's format) of the model: "
                              "a request picks one by its `model` name (docs/lora.md)"})
    lora_modules: tuple[str, ...] = field(default=(), metadata={
        "help": "adapters served from start-up, as NAME=PATH (PATH: a PEFT adapter directory); more load at run "
                "time through POST /v1/load_lora_adapter", "nargs": "+", "metavar": "NAME=PATH"})
    max_loras: int = field(default=1, metadata={"help": "adapters resident on the device at once (slots): a "
                           "step's requests use at most this many different adapters"})
    max_lora_rank: int = field(default=16, metadata={"help": "largest adapter rank r served (slots are sized for it)"})
    max_cpu_loras: int | None = field(default=None, metadata={"help": "adapters kept in host memory, least recently "
                                      "used dropped first (default: --max-loras; at least --max-loras)"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules or ()))  # the CLI gives a list

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def modules(self) -> dict[str, str]:
        """--lora-modules as {name: path}, in the order given."""
        return dict(module.split("=", 1) for module in self.lora_modules)

    def validate(self) -> None:
        check_min("max-loras", self.max_loras, 1)
        check_min("max-lora-rank", self.max_lora_rank, 1)
        check_min("max-cpu-loras", self.max_cpu_loras, self.max_loras)
        names = [module.split("=", 1)[0] for module in self.lora_modules]
        for module in self.lora_modules:
            name, is_pair, path = module.partition("=")
            check(is_pair and bool(name.strip()) and bool(path.strip()), "lora-modules",
                  f"expected NAME=PATH, got {module!r}")
        check(len(set(names)) == len(names), "lora-modules", f"an adapter name is given twice: {names}")
        check(self.enable_lora or not self.lora_modules, "lora-modules", "only with --enable-lora")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    parallel: ParallelConfig = ParallelConfig()
    lora: LoRAConfig = LoRAConfig()
    kv_transfer: KVTransferConfig = KVTransferConfig()

    def validate(self, max_model_len: int | None = None) -> None:
        """Each section's values, then the relations between them. `max_model_len`: the context length
        resolved from the model (default: --max-model-len, when given)."""
        for section in (self.model, self.cache, self.scheduler, self.speculative, self.parallel, self.lora,
                        self.kv_transfer):
            section.validate()
        check_model_len(self, max_model_len or self.model.max_model_len)
        check_tensor_parallel_combinations(self)
        check_pooling_combinations(self)
        check_kv_transfer_combinations(self)
        check(self.cache.kv_cache_dtype != "int8" or self.model.attention_backend != "triton", "kv-cache-dtype",
              "int8 is read by the CPU attention kernel only (--attention-backend auto or torch), not by triton")


def check_tensor_parallel_combinations(config: EngineConfig) -> None:
    """What tensor parallelism does not run with yet: refused at start-up rather than wrong later."""
    if config.parallel.tensor_parallel_size == 1:
        return
    check(config.speculative.speculative is None, "tensor-parallel-size",
          "speculative decoding (--speculative) is not supported with tensor parallelism")
    check(not config.lora.enable_lora, "tensor-parallel-size", "LoRA adapters (--enable-lora) are not supported "
          "with tensor parallelism yet")
    check(":" not in config.model.device, "tensor-parallel-size",
          f"ranks use devices cuda:0..N-1; --device {config.model.device!r} names one device")


def check_pooling_combinations(config: EngineConfig) -> None:
    """What a pooling engine (prompt-only work: no sampled token, no decode step) does not run with."""
    if not config.model.is_pooling:
        return
    check(config.speculative.speculative is None, "speculative", "not with --runner pooling (nothing is decoded)")
    check(not config.scheduler.async_scheduling, "async-scheduling",
          "not with --runner pooling (a step's pooled vectors end its requests: nothing to overlap)")
    check((config.scheduler.num_scheduler_steps or 1) == 1, "num-scheduler-steps",
          "not with --runner pooling (multi-step runs decode steps only)")


def check_kv_transfer_combinations(config: EngineConfig) -> None:
    """What the KV tiers and disaggregation run with: blocks are found by prefix-cache hashes, and the copies
    cover one rank's target-model cache."""
    kv = config.kv_transfer
    flag = "disaggregation-mode" if kv.disaggregation_mode != "null" else \
        "kv-offload-memory" if kv.kv_offload_memory is not None else "kv-offload-disk"
    if not kv.is_offloading and kv.disaggregation_mode == "null":
        return
    check(config.cache.enable_prefix_caching, flag, "needs prefix caching (drop --no-enable-prefix-caching)")
    check(config.parallel.tensor_parallel_size == 1, flag, "is not supported with tensor parallelism yet")
    check(config.speculative.speculative != "draft", flag,
          "is not supported with a draft model yet (its KV blocks are not copied)")


def check_model_len(config: EngineConfig, max_model_len: int | None) -> None:
    """A whole sequence must fit the KV cache and, without chunked prefill, one step's token budget
    (else a long prompt, or a preempted request's recompute, waits forever)."""
    if max_model_len is None:
        return
    cache, sched = config.cache, config.scheduler
    if cache.num_kv_blocks is not None:
        capacity = (cache.num_kv_blocks - 1) * cache.block_size  # less the null block
        check(capacity >= max_model_len, "num-gpu-blocks-override", f"{cache.num_kv_blocks} blocks of {cache.block_size} "
              f"tokens hold {capacity} tokens (one block is reserved as the null block), fewer than one sequence "
              f"of {max_model_len} tokens (--max-model-len; unset: the model's limit): ask for at least "
              f"{-(-max_model_len // cache.block_size) + 1} blocks, or lower --max-model-len")
    budget = sched.max_num_batched_tokens
    if not sched.enable_chunked_prefill and budget is not None:
        check(budget >= max_model_len, "max-num-batched-tokens", f"{budget} is below --max-model-len "
              f"{max_model_len}: without --enable-chunked-prefill a prompt must fit one step")


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str, flag: str | None = None) -> int:
    """'4GiB' -> 4294967296; '512MB' -> 512000000; '1000' -> 1000. `flag`: named in the error."""
    s = text.strip().lower().replace("_", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = s[len(num):].strip()
    try:
        if unit in _UNITS:
            return int(float(num) * _UNITS[unit])
    except ValueError:
        pass
    prefix = f"--{flag}: " if flag else ""
    raise ValueError(f"{prefix}cannot parse a byte size from {text!r} (examples: 4GiB, 512MB)")


class CommandLineParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line naming the flag, not the whole usage first (exit 2).
    Its sub-commands' parsers are of this class too (argparse gives them the parent's)."""

    def error(self, message: str) -> typing.NoReturn:
        message = message.removeprefix("argument ")
        if message.endswith("expected one argument"):
            message += " (a value that starts with '-' goes as --flag=VALUE)"
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _base_type(tp: typing.Any) -> type:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one --flag per field of a frozen config dataclass (bools become --x / --no-x). A field's metadata may
    name its flag (`flag`: vLLM's name where it means the same) and former names still accepted (`aliases`)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flags = ["--" + f.metadata.get("flag", f.name.replace("_", "-"))]
        aliases = ["--" + alias for alias in f.metadata.get("aliases", ())]
        tp = _base_type(hints[f.name])
        help_ = f.metadata.get("help", "")
        if aliases:
            help_ += f" ({', '.join(aliases)}: its former name, accepted for one more release)"
        extra = {key: f.metadata[key] for key in ("nargs", "metavar") if key in f.metadata}
        if tp is bool:
            parser.add_argument(*flags, *aliases, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=f.default, help=help_)
        else:
            parser.add_argument(*flags, *aliases, dest=f.name, type=tp, default=f.default,
                                help=f"{help_} (default: {f.default})" if f.default is not None else help_,
                                choices=f.metadata.get("choices"), **extra)


def dataclass_from_args(cls: type, args: argparse.Namespace):
    """Build a config dataclass from parsed args, taking the fields the parser has."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    return cls(**values)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, and the model as a positional argument too (`llmserve serve MODEL`, as vLLM's)."""
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model to serve (the same as --model)")
    for cls in (ModelConfig, CacheConfig, SchedulerConfig, SpeculativeConfig, ParallelConfig, LoRAConfig,
                KVTransferConfig):
        add_dataclass_args(parser, cls)
    parser.add_argument("--speculative-config", metavar="JSON", help="vLLM's speculative decoding settings as one "
                        "JSON object, beside the flags above: method (ngram | draft_model), model, "
                        "num_speculative_tokens, prompt_lookup_max, prompt_lookup_min, disable_by_batch_size, "
                        "draft_vocab_size")


# --speculative-config's keys (vLLM's names) -> SpeculativeConfig's fields
SPECULATIVE_CONFIG_KEYS = {"method": "speculative", "model": "draft_model",
                           "num_speculative_tokens": "num_speculative_tokens", "prompt_lookup_max": "ngram_max",
                           "prompt_lookup_min": "ngram_min", "disable_by_batch_size": "speculative_max_batch",
                           "draft_vocab_size": "draft_vocab_size"}
SPECULATIVE_METHODS = {"ngram": "ngram", "draft_model": "draft", "draft": "draft"}


def _take_speculative_config(args: argparse.Namespace) -> None:
    """--speculative-config's JSON onto the speculative flags; a setting given both ways is refused."""
    text = getattr(args, "speculative_config", None)
    if text is None:
        return
    settings = parse_json_object_flag("speculative-config", text, SPECULATIVE_CONFIG_KEYS)
    if "model" in settings and "method" not in settings:
        settings["method"] = "draft_model"  # as vLLM infers it
    defaults = {f.name: f.default for f in dataclasses.fields(SpeculativeConfig)}
    for key, value in settings.items():
        name = SPECULATIVE_CONFIG_KEYS[key]
        if key == "method":
            if value not in SPECULATIVE_METHODS:
                raise ValueError(f"--speculative-config: method {value!r} is not supported; supported: "
                                 f"{', '.join(SPECULATIVE_METHODS)}")
            value = SPECULATIVE_METHODS[value]
        if getattr(args, name) not in (defaults[name], value):
            raise ValueError(f"--speculative-config: {key} is also given by its own flag "
                             f"(--{name.replace('_', '-')}); give it once")
        setattr(args, name, value)


def _take_positional_model(args: argparse.Namespace) -> None:
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model is not None and args.model != tag:
        raise ValueError(f"--model: the model is given twice ({tag!r} and --model {args.model!r}); give it once")
    args.model = tag


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    _take_positional_model(args)
    _take_speculative_config(args)
    return EngineConfig(model=dataclass_from_args(ModelConfig, args),
                        cache=dataclass_from_args(CacheConfig, args),
                        scheduler=dataclass_from_args(SchedulerConfig, args),
                        speculative=dataclass_from_args(SpeculativeConfig, args),
                        parallel=dataclass_from_args(ParallelConfig, args),
                        lora=dataclass_from_args(LoRAConfig, args),
                        kv_transfer=dataclass_from_args(KVTransferConfig, args))


def engine_kwargs(config: EngineConfig) -> dict:
    """An EngineConfig as the flat keyword arguments LLM(...) and build_engine_config take."""
    parts = [getattr(config, f.name) for f in dataclasses.fields(config)]
    return {f.name: getattr(part, f.name) for part in parts for f in dataclasses.fields(part)}


def is_local_model(model: str) -> bool:
    """--model (or --tokenizer, --draft-model) names a local directory rather than a hub id: it starts like
    a path, or exists."""
    return model.startswith(("/", ".", "~")) or os.path.exists(model)


def cache_dir() -> str:
    """Where llmserve keeps what it builds (the demo model)."""
    root = os.environ.get("LLMSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "llmserve")
    os.makedirs(root, exist_ok=True)
    return root
