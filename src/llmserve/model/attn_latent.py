"""Attention over a latent cache (Multi-head Latent Attention, model/mla.py), on the torch backend's groups.

A layer's cache is [1, num_blocks, block_size, 1, L + R]: one entry per token, [c, k_r]. With absorbed queries
[T, H, L + R] the attention is multi-query attention with a single kv head: keys are the whole entries, values
their first L features. It runs on the rows' groups that the torch backend's `build_metadata` made for the
step (model/attn_torch.py: padded token indices, block tables truncated to the group's longest row, causal
masks), one scaled_dot_product_attention a group:
- decode rows fold the H heads into the query axis (q [Bg, 1, H, L + R] against k [Bg, 1, K, L + R]);
- rows continuing a cached prefix gather their entries through the block table;
- fresh prompt rows attend over the step's own entries (nothing read back from the cache).
Rows the C++ kernel would take for per-head caches come back as groups too (`KernelRows.fallback_groups`):
the kernel reads K and V per head, not latents.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve.model.attn_torch import GroupMetadata, TorchAttentionMetadata


def write_entries(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, entries: torch.Tensor) -> None:
    """Store entries [T, L + R] at slot_mapping [T] int64 of kv_cache [1, N, bs, 1, L + R]."""
    kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, slot_mapping, entries.to(kv_cache.dtype))


def _groups(metadata: TorchAttentionMetadata) -> list[GroupMetadata]:
    """Every row of the step as torch groups (full attention: DeepSeek has no sliding window)."""
    kernel_groups = [] if metadata.kernel is None else metadata.kernel.fallback_groups(0)
    return kernel_groups + metadata.groups_for(0)


def _keys(entries: torch.Tensor, kv_cache: torch.Tensor, group: GroupMetadata) -> torch.Tensor:
    """The group's keys [Bg, 1, K, L + R]: gathered from the cache, or the step's own entries (fresh rows)."""
    width = kv_cache.shape[-1]
    if group.block_table is None:
        return entries.index_select(0, group.token_index).view(group.num_rows, 1, group.max_query_len, width)
    gathered = kv_cache[0].index_select(0, group.block_table)  # [Bg * nb, bs, 1, L + R]
    return gathered.view(group.num_rows, 1, -1, width)


def _attend_group(queries: torch.Tensor, entries: torch.Tensor, kv_cache: torch.Tensor, group: GroupMetadata,
                  scale: float, latent_dim: int) -> torch.Tensor:
    """queries [T, H, L + R] -> the group's latent outputs [Bg * Q, H, L] (padded slots included)."""
    num_heads, width = queries.shape[1], queries.shape[2]
    qg = queries[:group.num_rows] if group.is_in_token_order else queries.index_select(0, group.token_index)
    keys = _keys(entries, kv_cache, group)  # [Bg, 1, K, L + R]
    values = keys[..., :latent_dim]  # [Bg, 1, K, L]
    if group.max_query_len == 1:  # heads as queries of the one kv head
        out = F.scaled_dot_product_attention(qg.view(group.num_rows, 1, num_heads, width), keys, values,
                                             attn_mask=group.attn_mask, scale=scale)  # [Bg, 1, H, L]
        return out.view(group.num_rows, num_heads, latent_dim)
    qb = qg.view(group.num_rows, group.max_query_len, num_heads, width).transpose(1, 2)  # [Bg, H, Q, L + R]
    out = F.scaled_dot_product_attention(qb, keys, values, attn_mask=group.attn_mask, scale=scale,
                                         is_causal=group.attn_mask is None, enable_gqa=True)  # [Bg, H, Q, L]
    return out.transpose(1, 2).reshape(-1, num_heads, latent_dim)


def attend(queries: torch.Tensor, entries: torch.Tensor, kv_cache: torch.Tensor, metadata: object, scale: float,
           latent_dim: int) -> torch.Tensor:
    """Store the step's entries [T, L + R], then attend: absorbed queries [T, H, L + R] -> [T, H, L] (each
    head's softmax-weighted sum of its row's latents)."""
    if not isinstance(metadata, TorchAttentionMetadata):
        raise TypeError(f"a latent cache is read through the torch attention backend's metadata, "
                        f"not {type(metadata).__name__}")
    write_entries(kv_cache, metadata.slot_mapping, entries)
    if kv_cache.dtype != entries.dtype:
        raise TypeError("the latent cache must hold the model's dtype")
    groups = _groups(metadata)
    if len(groups) == 1 and groups[0].is_in_token_order and groups[0].num_rows == queries.shape[0]:
        return _attend_group(queries, entries, kv_cache, groups[0], scale, latent_dim)
    out = queries.new_empty(queries.shape[0], queries.shape[1], latent_dim)
    for group in groups:
        group_out = _attend_group(queries, entries, kv_cache, group, scale, latent_dim)
        if group.valid_slots is not None:
            group_out = group_out.index_select(0, group.valid_slots)
        out.index_copy_(0, group.valid_tokens, group_out)
    return out
