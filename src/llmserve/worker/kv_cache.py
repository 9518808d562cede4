"""Sizing and allocating the paged KV cache from a memory budget."""

from __future__ import annotations

import torch

from llmserve.config import CacheConfig, parse_bytes

DEFAULT_CPU_FRACTION = 0.25  # of available RAM, when no budget is given
DEFAULT_CPU_CAP = 8 * 2**30


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def available_cpu_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 * 2**30


def kv_cache_budget(cache: CacheConfig, device: torch.device, weight_bytes: int) -> int:
    """Bytes for the KV cache: --kv-cache-memory, else a share of free device memory."""
    if cache.kv_cache_memory is not None:
        return parse_bytes(cache.kv_cache_memory)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        return max(0, int(total * cache.gpu_memory_utilization) - used - int(0.05 * total))
    return min(int(available_cpu_memory() * DEFAULT_CPU_FRACTION), DEFAULT_CPU_CAP)


def num_kv_blocks(cache: CacheConfig, device: torch.device, block_bytes: int, weight_bytes: int,
                  max_model_len: int) -> int:
    """Blocks that fit the budget (plus the null block); at least one full-length sequence must fit."""
    if cache.num_kv_blocks is not None:
        num_blocks = cache.num_kv_blocks
    else:
        num_blocks = kv_cache_budget(cache, device, weight_bytes) // block_bytes
    num_needed = -(-max_model_len // cache.block_size) + 1
    if num_blocks < num_needed:
        raise ValueError(f"the KV cache holds {num_blocks} blocks of {cache.block_size} tokens, fewer than one "
                         f"sequence of max_model_len={max_model_len} needs ({num_needed}): raise "
                         f"--kv-cache-memory / --num-kv-blocks or lower --max-model-len")
    return num_blocks


def allocate_kv_caches(shape: tuple[int, ...], num_layers: int, dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, Hkv, D] tensor per layer."""
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
