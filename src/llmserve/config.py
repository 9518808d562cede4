"""Frozen configuration records. Each default is written once, beside its field (here, or in a section's own
module: config_scheduler.py, config_speculative.py; the checks they share: config_checks.py); the CLI is
built from them."""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import dataclass, field

from llmserve.config_checks import check, check_choice, check_field_choices, check_min, parse_bytes
from llmserve.config_scheduler import SchedulerConfig
from llmserve.config_speculative import SpeculativeConfig, take_speculative_config
from llmserve.pooling import RUNNERS, parse_pooler_override


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
        "help": "largest decode batch captured in a CUDA graph (default: max_num_seqs, at most 512), and largest mixed "
                "step in tokens (default: the token budget, at most 512)",
        "flag": "max-cudagraph-capture-size", "aliases": ["max-graph-batch"]})
    cudagraph_mode: str = field(default="FULL", metadata={
        "help": "FULL: CUDA graphs of decode steps and of mixed steps (prompt chunks beside decode rows, prompts "
                "alone) of up to --max-cudagraph-capture-size tokens | FULL_DECODE_ONLY: of decode steps only "
                "(vLLM's compilation-config cudagraph_mode names; --enforce-eager: none)",
        "choices": ["FULL", "FULL_DECODE_ONLY"]})
    quantization: str | None = field(default=None, metadata={"help": "int8 (W8A8 dynamic per token, CPU and CUDA) | fp8 (float8 e4m3 weights and activations; CUDA compute capability >= 8.9, CPU runs a reference path) | none (default: the checkpoint's own: fp8 for an FP8 checkpoint, else none)", "choices": ["int8", "fp8", "none"]})
    load_format: str = field(default="auto", metadata={"help": "auto (the checkpoint's safetensors) | dummy (random "
                             "weights made on the device, for benchmarks: of the model only config.json and the "
                             "tokenizer are read; `make-model --no-weights` writes just those; a draft model loads "
                             "as usual)", "choices": ["auto", "dummy"]})
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
                                "quarter of the bytes plus a scale per token and kv head (an MLA model's latent: "
                                "per token), the kernel widens it and computes in float32)",
                                "choices": list(KV_CACHE_DTYPES)})
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
class ParallelConfig:
    tensor_parallel_size: int = field(default=1, metadata={"help": "split every layer over this many devices, one "
                                      "process each (CUDA: GPUs 0..N-1 over NCCL; CPU: processes over gloo, for tests)"})
    enable_expert_parallel: bool = field(default=False, metadata={"help": "Mixture-of-Experts models with "
                                         "--tensor-parallel-size N: each rank holds E/N whole experts instead of "
                                         "a 1/N slice of every expert (attention stays tensor-parallel; docs/moe.md)"})
    all2all_backend: str = field(default="allgather_reducescatter", metadata={
        "help": "how expert parallelism gets tokens to their experts (vLLM's flag): allgather_reducescatter (every "
                "rank computes its experts' pairs of every token, one all-reduce sums them) or all2allv (each rank "
                "sends its 1/N of the tokens' routed rows to their experts' ranks and gets the outputs back: "
                "torch.distributed.all_to_all_single; docs/moe.md)",
        "choices": ["allgather_reducescatter", "all2allv"]})

    def validate(self) -> None:
        check_field_choices(self)
        check_min("tensor-parallel-size", self.tensor_parallel_size, 1)
        check(not self.enable_expert_parallel or self.tensor_parallel_size > 1, "enable-expert-parallel",
              "needs --tensor-parallel-size 2 or more (the ranks the experts are placed on)")
        check(self.all2all_backend == "allgather_reducescatter" or self.enable_expert_parallel, "all2all-backend",
              f"{self.all2all_backend} dispatches tokens to experts' ranks: needs --enable-expert-parallel")


DISAGGREGATION_MODES = ("null", "prefill", "decode")
DEFAULT_DISK_TIER_BYTES = "16GiB"
DEFAULT_DECODE_HOST_TIER_BYTES = "2GiB"
DEFAULT_KV_PORT = 14579  # vLLM's kv_port default


@dataclass(frozen=True)
class KVTransferConfig:
    """KV blocks beyond the device's cache: the tiers below it and prefill/decode disaggregation
    (docs/disaggregation.md)."""

    kv_offload_memory: str | None = field(default=None, metadata={
        "help": "host memory for copies of the cached KV blocks the device lets go of, e.g. 8GiB (more than the "
                "device's KV cache: what the device evicts stays here): a later prefix hit there is copied back "
                "instead of recomputed (default: off; a decode server's default: "
                f"{DEFAULT_DECODE_HOST_TIER_BYTES}, where its prefill server's blocks arrive)"})
    kv_offload_disk: str | None = field(default=None, metadata={
        "help": "a directory for KV blocks evicted from host memory (or let go of by the device, without "
                "--kv-offload-memory); each block file is checksummed, a bad one is recomputed (default: off)"})
    kv_offload_disk_bytes: str | None = field(default=None, metadata={
        "help": f"bytes of --kv-offload-disk (default: {DEFAULT_DISK_TIER_BYTES})"})
    disaggregation_mode: str = field(default="null", metadata={
        "help": "null (prefill and decode in one engine) | prefill (compute prompts and send their KV blocks "
                "to the decode server a request names) | decode (receive KV blocks on --disaggregation-kv-port); "
                "SGLang's flag, the router pairs the two: llmserve route --pd-disaggregation",
        "choices": list(DISAGGREGATION_MODES)})
    disaggregation_kv_port: int = field(default=DEFAULT_KV_PORT, metadata={
        "help": "decode server: the TCP port its KV receiver binds (ZMQ), advertised at GET /kv_transfer (0: a free "
                "port the system picks, as Ray Serve's decode replicas do)"})

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
        check(0 <= self.disaggregation_kv_port < 65536, "disaggregation-kv-port",
              f"must be a TCP port (1-65535, or 0 for any free one), got {self.disaggregation_kv_port}")
        check(self.disaggregation_kv_port == DEFAULT_KV_PORT or self.disaggregation_mode == "decode",
              "disaggregation-kv-port", "only with --disaggregation-mode decode (the decode server binds it)")


LORA_DTYPES = ("auto", "bfloat16", "float16")


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
    lora_dtype: str = field(default="auto", metadata={
        "help": "the adapters' dtype in their slots: auto (the model's) | bfloat16 | float16; products sum in "
                "float32 either way (bfloat16 slots on a float32 model halve the bytes a step reads)",
        "choices": list(LORA_DTYPES)})

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
        check_choice("lora-dtype", self.lora_dtype, LORA_DTYPES)
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
    check(not config.speculative.has_draft_cache, flag,
          "is not supported with a draft model or EAGLE head yet (its KV blocks are not copied)")


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


def _take_positional_model(args: argparse.Namespace) -> None:
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model is not None and args.model != tag:
        raise ValueError(f"--model: the model is given twice ({tag!r} and --model {args.model!r}); give it once")
    args.model = tag


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    _take_positional_model(args)
    take_speculative_config(args)
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
