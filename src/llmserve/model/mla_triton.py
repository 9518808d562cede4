"""Triton kernel of Multi-head Latent Attention on the GPU: the absorbed form read from the latent cache in place.

Each token's cache entry is [c, k_r] (L + R values, model/mla.py). With the queries absorbed into the latent space
(q_latent_h = W_UK_h^T q_nope_h, done by the caller) head h's score of key t and its output are

    s_h(t) = (q_latent_h . c(t) + q_rope_h . k_r(t)) * scale        out_h = sum_t softmax(s_h)(t) c(t)   [L]

so every head reads the same entries: multi-query attention with one kv head of width L + R whose value is its
first L features. The caller turns out_h into the head's value with W_UV_h.

The kernel takes the Triton backend's metadata (model/attn_triton.py: query tiles of one row, block tables,
sequence lengths), so one launch serves every row of a step (decode, chunks, drafts) and a decode step captures
in a CUDA graph (no host value but the grid). A program takes BLOCK_Q queries of one row times BLOCK_H heads as
the rows of one matrix (16 of them: tl.dot's least): BLOCK_H = 16 heads of one query when every row decodes,
16 queries of one head otherwise. It walks the row's entries BLOCK_N at a time through the block table, loading
each block of entries once for both dots (scores and output), with an online softmax in float32. A decode step
with few programs (few rows: V3's 128 heads make 8 programs a row) also splits each row's entries into up to 16
parts (flash decoding, model/triton_splits.py, which merges them); the number of parts follows the step's shape
only, so a captured graph keeps it.

Fresh prompt rows take this absorbed form too (more work per token than the torch backend's expanded form for
long prompts, the same result). Tested on CPU through Triton's interpreter against a float64 reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.model.split_keys import num_splits_for
from llmserve.model.triton_splits import combine_splits, partial_buffer

_ROWS = 16  # query rows of a program: BLOCK_Q * BLOCK_H


@triton.jit
def _latent_attention_kernel(
    out_ptr, partial_ptr, q_latent_ptr, q_rope_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr,
    tile_rows_ptr, tile_starts_ptr, scale,
    stride_lt, stride_lh, stride_rt, stride_rh, stride_ot, stride_oh, stride_cb, stride_cp, stride_bt,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr, LATENT_DIM: tl.constexpr, L_PAD: tl.constexpr, ROPE_DIM: tl.constexpr,
    R_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    tile = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(tile_rows_ptr + tile)
    tile_start = tl.load(tile_starts_ptr + tile)  # first query of the tile, counted within its row
    q_begin = tl.load(query_start_ptr + row)
    query_len = tl.load(query_start_ptr + row + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + row)
    context_len = seq_len - query_len

    offs_m = tl.arange(0, BLOCK_Q * BLOCK_H)  # [M]
    q_idx = tile_start + offs_m // BLOCK_H  # [M] query index within the row
    head = head_block * BLOCK_H + offs_m % BLOCK_H  # [M]
    is_row = (q_idx < query_len) & (head < NUM_HEADS)  # [M]
    q_tok = (q_begin + q_idx).to(tl.int64)
    offs_l = tl.arange(0, L_PAD)
    is_l = offs_l < LATENT_DIM
    offs_r = tl.arange(0, R_PAD)
    is_r = offs_r < ROPE_DIM
    q_latent = tl.load(q_latent_ptr + q_tok[:, None] * stride_lt + head[:, None] * stride_lh + offs_l[None, :],
                       mask=is_row[:, None] & is_l[None, :], other=0.0)  # [M, L]
    q_rope = tl.load(q_rope_ptr + q_tok[:, None] * stride_rt + head[:, None] * stride_rh + offs_r[None, :],
                     mask=is_row[:, None] & is_r[None, :], other=0.0)  # [M, R]

    m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_H, L_PAD], tl.float32)
    kv_end = tl.minimum(context_len + tile_start + BLOCK_Q, seq_len)  # entries the tile's last query sees
    split_len = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N  # a split's share, whole BLOCK_Ns
    split_begin = split * split_len
    split_end = tl.minimum(split_begin + split_len, kv_end)
    offs_n = tl.arange(0, BLOCK_N)
    qk_scale = scale * 1.4426950408889634  # exp2 instead of exp
    q_pos = context_len + q_idx  # [M] each query's position
    for start_n in range(split_begin, split_end, BLOCK_N):
        pos = start_n + offs_n  # [N]
        is_key = pos < split_end
        block_id = tl.load(block_table_ptr + row * stride_bt + pos // KV_BLOCK_SIZE, mask=is_key, other=0)
        base = block_id.to(tl.int64) * stride_cb + (pos % KV_BLOCK_SIZE) * stride_cp  # [N]
        latent = tl.load(cache_ptr + base[:, None] + offs_l[None, :], mask=is_key[:, None] & is_l[None, :],
                         other=0.0).to(q_latent.dtype)  # [N, L]: the keys' first part and the values
        k_rope = tl.load(cache_ptr + base[None, :] + LATENT_DIM + offs_r[:, None],
                         mask=is_key[None, :] & is_r[:, None], other=0.0).to(q_rope.dtype)  # [R, N]
        s = tl.dot(q_latent, tl.trans(latent), input_precision=DOT_PRECISION)
        s = (s + tl.dot(q_rope, k_rope, input_precision=DOT_PRECISION)) * qk_scale  # [M, N]
        s = tl.where((pos[None, :] <= q_pos[:, None]) & is_key[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])  # [M, N]
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent, input_precision=DOT_PRECISION)
        m_i = m_new
    if NUM_SPLITS == 1:
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + q_tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_l[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=is_row[:, None] & is_l[None, :])
    else:  # the split's unnormalised sum, its max and its denominator: partial [T, H, S, L_PAD + 2] float32
        base = ((q_tok * NUM_HEADS + head) * NUM_SPLITS + split) * (L_PAD + 2)  # [M]
        tl.store(partial_ptr + base[:, None] + offs_l[None, :], acc, mask=is_row[:, None])
        tl.store(partial_ptr + base + L_PAD, m_i, mask=is_row)
        tl.store(partial_ptr + base + L_PAD + 1, l_i, mask=is_row)


def paged_latent_attention(out: torch.Tensor, q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                           tile_rows: torch.Tensor, tile_starts: torch.Tensor, block_q: int, scale: float,
                           num_splits: int | None = None) -> None:
    """out/q_latent [T, H, L], q_rope [T, H, R], kv_cache [1, N, bs, 1, L + R] (q's dtype, or float16 / fp8 with
    scale 1, widened as it is read), block_table [B, W]
    int32, seq_lens [B] int32, query_start_loc [B + 1] int32, tile_rows/tile_starts [tiles] int32 (tiles of
    block_q queries, model/attn_triton.py) -> fills out's rows with each head's softmax-weighted latents.
    num_splits (a power of 2; None: `num_splits_for`) > 1 cuts each row's entries into that many parts attended
    apart, then merged by a second kernel (flash decoding)."""
    _, _, block_size, _, width = kv_cache.shape
    num_heads, latent_dim = q_latent.shape[1], q_latent.shape[2]
    rope_dim = q_rope.shape[2]
    assert width == latent_dim + rope_dim, "a cache entry is [latent, rope key]"
    assert q_latent.stride(2) == 1 and q_rope.stride(2) == 1 and out.stride(2) == 1 and kv_cache.stride(4) == 1
    assert block_q in (1, _ROWS), "a tile is one decode query or 16 queries"
    block_h = _ROWS // block_q
    num_head_blocks = triton.cdiv(num_heads, block_h)
    if num_splits is None:
        num_splits = num_splits_for(tile_rows.shape[0], num_head_blocks, block_q)
    assert num_splits == 1 or block_q == 1, "only decode steps split their rows' entries"
    l_pad = max(16, triton.next_power_of_2(latent_dim))
    partial = out  # unread with one split
    if num_splits > 1:  # [T, H, S, L_PAD + 2] float32: each split's sum, max and denominator
        partial = partial_buffer(q_latent.shape[0], num_heads, num_splits, l_pad, q_latent.device)
    grid = (tile_rows.shape[0], num_head_blocks, num_splits)
    _latent_attention_kernel[grid](
        out, partial, q_latent, q_rope, kv_cache, block_table, seq_lens, query_start_loc, tile_rows, tile_starts,
        scale,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), block_table.stride(0),
        NUM_HEADS=num_heads, BLOCK_H=block_h, BLOCK_Q=block_q, BLOCK_N=16 if l_pad >= 256 else 32,
        KV_BLOCK_SIZE=block_size, LATENT_DIM=latent_dim, L_PAD=l_pad, ROPE_DIM=rope_dim,
        R_PAD=max(16, triton.next_power_of_2(rope_dim)),
        DOT_PRECISION="ieee" if q_latent.dtype == torch.float32 else None,  # None: the default for 16-bit inputs
        NUM_SPLITS=num_splits)
    if num_splits > 1:
        combine_splits(out, partial, latent_dim)
