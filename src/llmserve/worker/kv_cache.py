"""Sizing and allocating the paged KV cache from a memory budget."""

from __future__ import annotations

import math

import torch

from llmserve.config import CacheConfig, parse_bytes
from llmserve.core.kv_cache_groups import KVCacheLayout
from llmserve.model import huge_pages

DEFAULT_CPU_FRACTION = 0.25  # of available RAM, when no budget is given
DEFAULT_CPU_CAP = 8 * 2**30


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Cache elements of one token's kv head: head_dim, plus 4 int8 holding the row's float32 scale for an int8
    cache (--kv-cache-dtype int8; model/attention.py)."""
    return head_dim + 4 if dtype == torch.int8 else head_dim


def cache_bytes_per_block(block_shape: tuple[int, ...], num_layers: int, dtype: torch.dtype) -> int:
    """Bytes of one block over all layers, from the model's `kv_cache_shape(1, block_size)`: the cache's real
    layout (K and V per kv head, or one latent entry per token: model/mla.py)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return num_layers * math.prod(block_shape[:-1]) * row_width(block_shape[-1], dtype) * elem


def kv_bytes_per_token(kv_caches: list[torch.Tensor]) -> int:
    """Cache bytes one token takes over all layers, read off the allocated caches [kv, N, bs, heads, width]."""
    return sum(c.numel() // (c.shape[1] * c.shape[2]) * c.element_size() for c in kv_caches)


def available_cpu_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 * 2**30


def kv_cache_budget(cache: CacheConfig) -> int:
    """Bytes for the KV cache: --kv-cache-memory-bytes, else a share of available RAM (a GPU's budget comes from
    worker.gpu_profile)."""
    if cache.kv_cache_memory is not None:
        return parse_bytes(cache.kv_cache_memory)
    return min(int(available_cpu_memory() * DEFAULT_CPU_FRACTION), DEFAULT_CPU_CAP)


def needs_gpu_profile(cache: CacheConfig, device: torch.device) -> bool:
    """A CUDA cache without an explicit size is sized from a profiling forward."""
    return device.type == "cuda" and cache.kv_cache_memory is None and cache.num_kv_blocks is None


def num_kv_blocks(cache: CacheConfig, block_bytes: int, max_model_len: int, max_num_seqs: int,
                  budget: int | None = None, num_groups: int = 1, blocks_per_seq: int | None = None) -> int:
    """Blocks that fit the budget (plus the null block); at least one full-length sequence must fit:
    blocks_per_seq, the most it holds at once in every KV cache group (core/kv_cache_groups.py: a block holds
    one group's layers; default: one group of full attention).

    budget: bytes measured on a GPU; None = --num-gpu-blocks-override, --kv-cache-memory-bytes or the CPU default, which
    is capped by what max_num_seqs sequences of max_model_len tokens fill (`cpu_cap_blocks`)."""
    if cache.num_kv_blocks is not None:
        num_blocks = cache.num_kv_blocks
    elif budget is not None or cache.kv_cache_memory is not None:
        num_blocks = (kv_cache_budget(cache) if budget is None else budget) // block_bytes
    else:
        num_blocks = min(kv_cache_budget(cache) // block_bytes,
                         cpu_cap_blocks(max_num_seqs, max_model_len, cache.block_size) * num_groups)
    num_needed = (-(-max_model_len // cache.block_size) if blocks_per_seq is None else blocks_per_seq) + 1
    if num_blocks < num_needed:
        raise ValueError(f"the KV cache holds {num_blocks} blocks of {cache.block_size} tokens, fewer than one "
                         f"sequence of max_model_len={max_model_len} needs ({num_needed}, one of them reserved as "
                         f"the null block): raise "
                         f"--kv-cache-memory-bytes / --num-gpu-blocks-override or lower --max-model-len")
    return num_blocks


def cpu_cap_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """The CPU default's cap: twice the blocks that max_num_seqs sequences of max_model_len tokens fill (as
    many again to keep finished prefixes), plus the null block. More would cost start-up time (zeroing and a
    record a block; docs/benchmarks.md, "Figures behind choices in the code") and resident memory."""
    return 2 * max_num_seqs * -(-max_model_len // block_size) + 1


def allocate_kv_caches(shape: tuple[int, ...], num_layers: int, dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, Hkv, D] tensor per layer (D + 4 for int8: `row_width`); on CPU one
    huge-page arena holds them all where the machine has transparent huge pages (model/huge_pages.py)."""
    shape = (*shape[:-1], row_width(shape[-1], dtype))
    caches = huge_pages.zeros(num_layers, shape, dtype) if torch.device(device).type == "cpu" else None
    return caches or [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def layer_kv_caches(slots: list[torch.Tensor], layout: KVCacheLayout) -> list[torch.Tensor]:
    """Each layer's cache tensor: with KV cache groups the j-th layer of every group writes tensor j (a block
    belongs to one group at a time, core/kv_cache_groups.py); with one group, one tensor a layer."""
    return [slots[slot] for slot in layout.layer_slots]
