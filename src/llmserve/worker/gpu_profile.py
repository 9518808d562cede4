"""Sizing the KV cache on a GPU from a profiling forward.

Before the cache exists, one forward of a full token budget (max_num_batched_tokens prompt tokens,
then the logits of max_num_seqs rows) runs against a throwaway cache just big enough for it; the
peak of torch's allocator during it, plus what other libraries hold on the device (CUDA context,
cuBLAS workspaces: the device's used memory minus torch's reserved memory), is what the engine
needs besides its KV cache. The cache gets the rest of gpu_memory_utilization x total memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from llmserve.model.attention import AttentionBackend, AttentionInputs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryProfile:
    total_bytes: int  # the device's memory
    peak_torch_bytes: int  # torch allocator's peak during the profiling forward (weights included)
    non_torch_bytes: int  # used on the device outside torch's allocator


def kv_budget_from_profile(profile: MemoryProfile, gpu_memory_utilization: float) -> int:
    """Bytes left for the KV cache; ValueError when the weights and activations alone exceed the share."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    allowed = int(profile.total_bytes * gpu_memory_utilization)
    budget = allowed - profile.peak_torch_bytes - profile.non_torch_bytes
    if budget <= 0:
        raise ValueError(f"no GPU memory left for the KV cache: {gpu_memory_utilization:.2f} x "
                         f"{profile.total_bytes / 2**30:.1f} GiB allowed, the model's forward peaks at "
                         f"{profile.peak_torch_bytes / 2**30:.1f} GiB (+{profile.non_torch_bytes / 2**30:.1f} GiB "
                         f"outside torch): raise --gpu-memory-utilization or lower --max-num-batched-tokens")
    return budget


def _profiling_inputs(num_tokens: int, block_size: int, device: torch.device) -> tuple[AttentionInputs, torch.Tensor]:
    """One fresh prompt of num_tokens over blocks 1..n of a throwaway cache -> (inputs, positions [T])."""
    num_blocks = -(-num_tokens // block_size)
    positions = torch.arange(num_tokens, dtype=torch.int64, device=device)  # [T]
    inputs = AttentionInputs(
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_table=torch.arange(1, num_blocks + 1, dtype=torch.int32, device=device)[None, :],
        slot_mapping=positions + block_size, query_lens_cpu=[num_tokens], seq_lens_cpu=[num_tokens],
        block_size=block_size)
    return inputs, positions


@torch.inference_mode()
def profile_forward(model: torch.nn.Module, backend: AttentionBackend, kv_cache_shape, num_layers: int,
                    dtype: torch.dtype, device: torch.device, num_tokens: int, num_logit_rows: int) -> MemoryProfile:
    """Run the profiling forward on a CUDA device and measure it."""
    block_size = kv_cache_shape[2]  # [kv, num_blocks, block_size, heads, width]: K/V per head, or MLA's latents
    num_blocks = -(-num_tokens // block_size) + 1  # + the null block
    shape = (kv_cache_shape[0], num_blocks, *kv_cache_shape[2:])
    kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    inputs, positions = _profiling_inputs(num_tokens, block_size, device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    hidden = model(torch.zeros(num_tokens, dtype=torch.int64, device=device), positions, kv_caches,
                   backend.build_metadata(inputs), backend)  # [T, hidden]
    if getattr(model, "has_lm_head", True):  # an embedding model (--runner pooling) computes no logits
        model.compute_logits(hidden[-num_logit_rows:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - sum(c.numel() * c.element_size() for c in kv_caches)
    del kv_caches, hidden
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    profile = MemoryProfile(total_bytes=total, peak_torch_bytes=peak, non_torch_bytes=non_torch)
    logger.info("GPU memory profile: %.2f GiB total, forward peak %.2f GiB, %.2f GiB outside torch",
                total / 2**30, peak / 2**30, non_torch / 2**30)
    return profile
