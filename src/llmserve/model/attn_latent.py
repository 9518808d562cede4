"""Attention over a latent cache (Multi-head Latent Attention, model/mla.py), on the torch backend's groups.

A layer's cache is [1, num_blocks, block_size, 1, L + R]: one entry per token, [c, k_r]. Attention runs on the
rows' groups that the torch backend's `build_metadata` made for the step (model/attn_torch.py: padded token
indices, block tables truncated to the group's longest row, causal masks), one scaled_dot_product_attention a
group:
- rows over a cached prefix (decode, chunks after the first, prefix hits) take the absorbed form: queries
  [.., H, L + R] against their rows' entries gathered through the block table, multi-query attention with one
  kv head whose keys are the whole entries and values their first L features; decode rows fold the H heads
  into the query axis (q [Bg, 1, H, L + R] against k [Bg, 1, K, L + R]);
- fresh prompt rows take the expanded form over their own tokens (K and V per head up-projected from the
  step's latents, never cached): causal attention of width Dn + R (192 for V3) rather than L + R (576).
A float16 or fp8 cache (--kv-cache-dtype) is widened to the queries' dtype as it is read; an int8 one holds each
entry quantized symmetrically with its own float32 scale in 4 more bytes ([1, N, bs, 1, L + R + 4], the dense int8
cache's row layout: model/attention.py `quantize_int8_rows`), read back as q * scale.
On CPU the C++ kernel attends the rows it takes (decode-like ones; every row for float32 with AVX2) in the
absorbed form straight from the cache, which it reads as both its K and its V half (`attend_kernel_rows`);
where it cannot (another dtype, no build) they come back as groups (`KernelRows.fallback_groups`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve.model import cpu_kernels
from llmserve.model.attention import FP8_KV_DTYPE, K_SCALE, quantize_int8_rows, to_fp8
from llmserve.model.attn_torch import GroupMetadata, TorchAttentionMetadata


def write_entries(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, entries: torch.Tensor) -> None:
    """Store entries [T, L + R] at slot_mapping [T] int64 of kv_cache [1, N, bs, 1, L + R]: in the cache's dtype
    (--kv-cache-dtype: float16 rounds, fp8 divides by the per-tensor scale and saturates to e4m3's range, int8
    quantizes each entry with its own scale, stored in the row's last 4 bytes)."""
    rows = kv_cache.view(-1, kv_cache.shape[-1])
    if kv_cache.dtype == torch.int8:
        rows.index_copy_(0, slot_mapping, quantize_int8_rows(entries.float()))
    elif kv_cache.dtype == FP8_KV_DTYPE:  # CPU's index_copy_ has no float8 kernel: copy the bytes
        rows.view(torch.uint8).index_copy_(0, slot_mapping, to_fp8(entries, K_SCALE).view(torch.uint8))
    else:
        rows.index_copy_(0, slot_mapping, entries.to(kv_cache.dtype))


def as_cached(entries: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """entries [T, L + R] as the cache returns them (stored in cache_dtype, read back in entries' dtype), so that
    the expanded form of fresh rows reads what the absorbed form of later rows reads."""
    if cache_dtype == entries.dtype:
        return entries
    if cache_dtype == FP8_KV_DTYPE:
        return to_fp8(entries, K_SCALE).to(entries.dtype) * K_SCALE
    if cache_dtype == torch.int8:
        return _dequantized(quantize_int8_rows(entries.float()), entries.dtype)
    return entries.to(cache_dtype).to(entries.dtype)


def gather_entries(kv_cache: torch.Tensor, block_table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The blocks of block_table [n] int64 of kv_cache [1, N, bs, 1, L + R] -> [n, bs, 1, L + R] in dtype."""
    if kv_cache.dtype == torch.int8:
        return _dequantized(kv_cache[0].index_select(0, block_table), dtype)
    if kv_cache.dtype == FP8_KV_DTYPE:  # no float8 index_select on CPU: gather the bytes
        stored = kv_cache[0].view(torch.uint8).index_select(0, block_table).view(FP8_KV_DTYPE)
        return stored.to(dtype) * K_SCALE
    return kv_cache[0].index_select(0, block_table).to(dtype)


def _dequantized(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 entries with their scales [..., L + R + 4] -> [..., L + R] in dtype: q * scale, in float32 as the C++
    kernel widens them."""
    scale = rows[..., -4:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :-4].float() * scale).to(dtype)


def check_metadata(metadata: object) -> None:
    """TypeError unless the step's metadata is the torch backend's (the only one that reads a latent cache)."""
    if not isinstance(metadata, TorchAttentionMetadata):
        raise TypeError(f"a latent cache is read through the torch attention backend's metadata, "
                        f"not {type(metadata).__name__}")


def kernel_takes(metadata: TorchAttentionMetadata, queries: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the C++ kernel attends the step's kernel rows (built, and their dtype one it reads; an int8 cache
    only by its AVX2 path, for an entry width a multiple of 8)."""
    is_readable = kv_cache.dtype != torch.int8 or ((kv_cache.shape[-1] - 4) % 8 == 0 and cpu_kernels.has_avx2_kernels())
    return metadata.kernel is not None and cpu_kernels.supports(queries, kv_cache) and is_readable


def groups(metadata: TorchAttentionMetadata, is_kernel_used: bool) -> list[GroupMetadata]:
    """The step's rows the torch groups attend (full attention: DeepSeek has no sliding window): all but the
    kernel's when it is used."""
    kernel_groups = [] if metadata.kernel is None or is_kernel_used else metadata.kernel.fallback_groups(0)
    return kernel_groups + metadata.groups_for(0)


def kernel_tokens(metadata: TorchAttentionMetadata) -> torch.Tensor | None:
    """The flat token indices [n] int64 of the kernel's rows; None when they are every token of the step (no
    row left to the groups)."""
    if not metadata.groups_for(0):
        return None
    kernel = metadata.kernel
    rows = kernel.rows.long()
    starts = kernel.query_start_loc[rows].long()
    lens = kernel.query_start_loc[rows + 1].long() - starts
    first_of_token = torch.repeat_interleave(starts - (lens.cumsum(0) - lens), lens)  # [n] start minus its offset
    return first_of_token + torch.arange(int(lens.sum()), device=rows.device)


def attend_kernel_rows(queries: torch.Tensor, kv_cache: torch.Tensor, metadata: TorchAttentionMetadata,
                       scale: float) -> torch.Tensor:
    """Absorbed queries [T, H, L + R] (only the kernel's rows are read) over their rows' cached entries, read in
    place -> [T, H, L + R] (the kernel's rows written; the last R features of each are the rope keys' weighted
    sum, for the caller to drop). The kernel sees the cache as its K and its V half at once (stride 0: the same
    memory), one kv head."""
    both_halves = kv_cache.expand(2, *kv_cache.shape[1:])  # [2, N, bs, 1, L + R], no copy
    kernel, out = metadata.kernel, queries.new_empty(queries.shape)
    cpu_kernels.paged_attention(out, queries, both_halves, kernel.block_table, kernel.seq_lens,
                                kernel.query_start_loc, kernel.rows, scale)
    return out


def group_rows(x: torch.Tensor, group: GroupMetadata) -> torch.Tensor:
    """x [T, ...] -> the group's padded query slots [Bg * Q, ...] (pads read token 0)."""
    return x[:group.num_rows] if group.is_in_token_order else x.index_select(0, group.token_index)


def attend_absorbed(queries: torch.Tensor, kv_cache: torch.Tensor, group: GroupMetadata, scale: float,
                    latent_dim: int) -> torch.Tensor:
    """The group's absorbed queries [Bg * Q, H, L + R] over its rows' cached entries -> [Bg * Q, H, L]."""
    num_heads, width = queries.shape[1], queries.shape[2]
    keys = gather_entries(kv_cache, group.block_table, queries.dtype)
    keys = keys.view(group.num_rows, 1, -1, width)  # [Bg, 1, K, L + R]
    values = keys[..., :latent_dim]  # [Bg, 1, K, L]
    if group.max_query_len == 1:  # heads as queries of the one kv head
        out = F.scaled_dot_product_attention(queries.view(group.num_rows, 1, num_heads, width), keys, values,
                                             attn_mask=group.attn_mask, scale=scale)  # [Bg, 1, H, L]
        return out.view(group.num_rows, num_heads, latent_dim)
    qb = queries.view(group.num_rows, group.max_query_len, num_heads, width).transpose(1, 2)  # [Bg, H, Q, L + R]
    out = F.scaled_dot_product_attention(qb, keys, values, attn_mask=group.attn_mask, scale=scale,
                                         enable_gqa=True)  # [Bg, H, Q, L]
    return out.transpose(1, 2).reshape(-1, num_heads, latent_dim)


def attend_expanded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: GroupMetadata,
                    scale: float) -> torch.Tensor:
    """Fresh prompt rows (no cached prefix) over their own tokens, per head: q/k [Bg * Q, H, Dn + R],
    v [Bg * Q, H, Dv] -> [Bg * Q, H, Dv]."""
    def per_row(x: torch.Tensor) -> torch.Tensor:  # [Bg * Q, H, D] -> [Bg, H, Q, D]
        return x.view(group.num_rows, group.max_query_len, *x.shape[1:]).transpose(1, 2)

    out = F.scaled_dot_product_attention(per_row(q), per_row(k), per_row(v), attn_mask=group.attn_mask, scale=scale,
                                         is_causal=group.attn_mask is None)  # [Bg, H, Q, Dv]
    return out.transpose(1, 2).reshape(-1, q.shape[1], v.shape[-1])


def scatter(out: torch.Tensor, group_out: torch.Tensor, group: GroupMetadata) -> None:
    """Write the group's real query slots of group_out [Bg * Q, ...] into out [T, ...]."""
    if group.valid_slots is not None:
        group_out = group_out.index_select(0, group.valid_slots)
    out.index_copy_(0, group.valid_tokens, group_out)
