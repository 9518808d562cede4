"""The engine's start-up line: what is on, with its sizes, in one place a user reads once (the model and
device, the runner (generate, or pooling and how), the linear layers' kernel, the KV cache's dtype and size,
prefix caching, speculation, the scheduler's overlap and steps, CUDA graphs, threads)."""

from __future__ import annotations

import torch

from llmserve.config import KVTransferConfig, SpeculativeConfig
from llmserve.model import cpu_isa, cpu_kernels, fused_cuda
from llmserve.pooling import PoolerConfig
from llmserve.worker.kv_cache import kv_bytes_per_token


def linear_kernel(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, quantization: str | None) -> str:
    """Which kernel the model's linear layers run on this machine."""
    if quantization == "int8":
        if device.type == "cuda":
            return "int8 (torch._int_mm)"
        has_panels = any(getattr(m, "panels", None) is not None for m in model.modules())
        return "int8 (llmserve's exact AVX2 kernel: oneDNN has no VNNI here)" if has_panels else \
            "int8 (oneDNN with VNNI, torch._int_mm)"
    if quantization == "fp8":
        return "fp8 (Triton kernels)" if device.type == "cuda" else "fp8 (torch reference path)"
    if device.type == "cuda":
        rows = fused_cuda.cuda_gemv_rows() if dtype in (torch.bfloat16, torch.float16) else 0
        return f"cuBLAS, the Triton GEMV up to {rows} rows" if rows else "cuBLAS"
    if dtype == torch.float32 and cpu_kernels.packs_linears():
        return f"llmserve's {cpu_kernels.panel_isa()} panels"
    if dtype == torch.bfloat16 and cpu_kernels.has_bf16_gemv() and cpu_isa.has_fast_bf16() \
            and cpu_isa.linear_path() != "onednn":
        return "llmserve's AVX512-BF16 GEMV for decode rows, oneDNN beyond"
    return "oneDNN"


def speculation(spec: SpeculativeConfig) -> str:
    if not spec.is_enabled:
        return "speculative off"
    method = f"ngram {spec.ngram_min}-{spec.ngram_max}" if spec.speculative == "ngram" else \
        f"{spec.speculative} {spec.draft_model}"
    rule = "dynamic" if spec.speculative_dynamic else "always"
    return f"speculative {method}, k={spec.num_speculative_tokens}, up to batch {spec.speculative_max_batch} ({rule})"


def runner_kind(pooler: PoolerConfig | None) -> str:
    if pooler is None:
        return "runner generate"
    return f"runner pooling ({pooler.pooling_type} pooling, {'normalized' if pooler.normalize else 'not normalized'})"


def kv_cache(kv_caches: list[torch.Tensor], num_blocks: int, block_size: int, num_groups: int = 1) -> str:
    """With KV cache groups (core/kv_cache_groups.py) a block holds one group's layers: the tokens are those of
    the blocks shared out evenly, and layers of different groups share a tensor (its bytes counted once; a
    token's bytes are every layer's)."""
    tensors = {id(t): t for t in kv_caches}.values()
    num_bytes = sum(t.numel() * t.element_size() for t in tensors)
    dtype = str(kv_caches[0].dtype).removeprefix("torch.") if kv_caches else "?"
    per_token = kv_bytes_per_token(kv_caches)
    groups = f" in {num_groups} groups" if num_groups > 1 else ""
    return (f"KV cache {dtype}, {num_blocks} blocks of {block_size} tokens{groups} "
            f"({num_blocks // num_groups * block_size:,} tokens, {per_token:,} bytes a token, "
            f"{num_bytes / 2**30:.2f} GiB)")


def kv_tiers(config: KVTransferConfig) -> str | None:
    """The KV tiers below the device and the disaggregation role, when any is on."""
    parts = []
    host = config.host_tier_bytes()
    if host:
        parts.append(f"host {host / 2**30:.2f} GiB")
    if config.kv_offload_disk:
        parts.append(f"disk {config.disk_tier_bytes() / 2**30:.2f} GiB in {config.kv_offload_disk}")
    if config.disaggregation_mode != "null":
        port = f" (KV port {config.disaggregation_kv_port})" if config.disaggregation_mode == "decode" else ""
        parts.append(f"{config.disaggregation_mode} server{port}")
    return "KV tiers: " + ", ".join(parts) if parts else None


def startup_line(core) -> str:
    """'engine ready: ...' for a started EngineCore, naming every feature that is on, and off where one would
    look for it."""
    config, info, runner = core.config, core.model_info, core.runner
    sched = config.scheduler
    graphs = "CUDA graphs off" if runner.graphs is None else f"CUDA graphs up to batch {runner.graphs.sizes[-1]}"
    if runner.mixed_graphs is not None:
        graphs += f", mixed steps up to {runner.mixed_graphs.sizes[-1]} tokens"
    parts = [f"engine ready: {info.name} on {core.device}, {info.dtype}", runner_kind(info.pooler),
             f"linears {linear_kernel(runner.model, core.device, core.dtype, info.quantization)}",
             kv_cache(runner.kv_caches, core.num_blocks, config.cache.block_size, core.scheduler.kv.num_groups),
             f"prefix caching {'on' if config.cache.enable_prefix_caching else 'off'}",
             *filter(None, [kv_tiers(config.kv_transfer)]),
             speculation(config.speculative),
             f"async scheduling {'on' if core.is_async else 'off'}", f"scheduler steps {sched.num_scheduler_steps}",
             graphs, f"threads {core.num_threads} ({core.threads_reason})",
             f"max_model_len {info.max_model_len}, max_num_seqs {sched.max_num_seqs}, token budget "
             f"{sched.max_num_batched_tokens}"]
    return "; ".join(parts)
