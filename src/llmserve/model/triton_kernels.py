"""Triton kernel of the GPU attention backend: causal attention over the paged KV cache.

One kernel serves every row of a step, whatever its mix of prefill chunks, cached prefixes, decode
tokens and speculative drafts. The grid is (query tiles, kv heads): a tile is up to BLOCK_Q query
tokens of one row, and a program takes those tokens times the G query heads of its kv head as the
rows of one matrix (BLOCK_Q * G_PAD of them, padded to at least 16 for tl.dot; GQA: each K/V block is
loaded once for all G heads).
It walks the row's keys BLOCK_N at a time through the block table (a key's block id and offset come
from its position, so BLOCK_N need not equal the KV block size), with an online softmax in float32.
Query j of a row (j counted from the row's first new token) sees keys 0 .. context_len + j; under a
sliding window W only context_len + j - W + 1 .. context_len + j, and the walk starts at the tile's first
query's window (blocks wholly before it are never read). Attention sinks (one logit per query head) add
exp(sink) to the softmax's denominator after the walk.

Everything the kernel reads per step lives in device tensors (no per-step host values except the
grid, which depends only on the number of tiles), so a decode step can be captured in a CUDA graph.
Decode steps of long rows and few programs may split each row's keys into parts (flash decoding, a third grid
axis; model/triton_splits.py merges them): `split_keys`, which the step's metadata sets.
Tested on CPU through Triton's interpreter (TRITON_INTERPRET=1) against the torch backend.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.model.split_keys import num_splits_for
from llmserve.model.triton_splits import combine_splits, partial_buffer


@triton.jit
def _paged_attention_kernel(
    out_ptr, partial_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr,
    tile_rows_ptr, tile_starts_ptr, sinks_ptr, scale, k_scale, v_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cp, stride_ch, stride_bt,
    NUM_HEADS: tl.constexpr, NUM_QUERIES_PER_KV: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_SINKS: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)  # which part of the row's keys (flash decoding: model/triton_splits.py)
    row = tl.load(tile_rows_ptr + tile)
    tile_start = tl.load(tile_starts_ptr + tile)  # first query of the tile, counted within its row
    q_begin = tl.load(query_start_ptr + row)
    query_len = tl.load(query_start_ptr + row + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + row)
    context_len = seq_len - query_len

    offs_m = tl.arange(0, BLOCK_M)  # [M]
    q_idx = tile_start + offs_m // G_PAD  # [M] query index within the row
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % G_PAD  # [M]
    is_row = (offs_m < BLOCK_Q * G_PAD) & (q_idx < query_len) & (offs_m % G_PAD < NUM_QUERIES_PER_KV)  # [M]
    offs_d = tl.arange(0, D_PAD)  # [D]
    is_dim = offs_d < HEAD_DIM
    q_tok = (q_begin + q_idx).to(tl.int64)
    q = tl.load(q_ptr + q_tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=is_row[:, None] & is_dim[None, :], other=0.0)  # [M, D]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    kv_end = tl.minimum(context_len + tile_start + BLOCK_Q, seq_len)  # keys the tile's last query sees
    offs_n = tl.arange(0, BLOCK_N)
    qk_scale = scale * 1.4426950408889634  # exp2 instead of exp
    q_pos = context_len + q_idx  # [M] each query's position
    kv_begin = tl.maximum(context_len + tile_start - window + 1, 0)  # the tile's first query's window (full: 0)
    split_len = tl.cdiv(tl.cdiv(tl.maximum(kv_end - kv_begin, 0), NUM_SPLITS), BLOCK_N) * BLOCK_N  # whole BLOCK_Ns
    split_begin = kv_begin + split * split_len
    split_end = tl.minimum(split_begin + split_len, kv_end)  # one split: kv_begin .. kv_end
    for start_n in range(split_begin, split_end, BLOCK_N):
        pos = start_n + offs_n  # [N]
        is_key = pos < split_end
        block_id = tl.load(block_table_ptr + row * stride_bt + pos // KV_BLOCK_SIZE, mask=is_key, other=0)
        base = block_id.to(tl.int64) * stride_cb + (pos % KV_BLOCK_SIZE) * stride_cp + kv_head * stride_ch  # [N]
        k = tl.load(k_cache_ptr + base[None, :] + offs_d[:, None], mask=is_key[None, :] & is_dim[:, None],
                    other=0.0).to(q.dtype)  # [D, N]; an fp8 cache is dequantized here (k_scale below)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * (qk_scale * k_scale)  # [M, N]
        is_seen = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > (q_pos - window)[:, None]) & is_key[None, :]
        s = tl.where(is_seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])  # [M, N]
        alpha = tl.exp2(m_i - m_safe)
        v = tl.load(v_cache_ptr + base[:, None] + offs_d[None, :], mask=is_key[:, None] & is_dim[None, :],
                    other=0.0).to(q.dtype)  # [N, D]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    if NUM_SPLITS == 1:
        if HAS_SINKS:  # exp(sink - max) in the denominator (m_i is in log2 units, scaled)
            sink = tl.load(sinks_ptr + head, mask=is_row, other=0.0).to(tl.float32)  # [M]
            l_i += tl.exp2(sink * 1.4426950408889634 - tl.where(m_i == float("-inf"), 0.0, m_i))
        acc = acc * v_scale / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + q_tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=is_row[:, None] & is_dim[None, :])
    else:  # the split's unnormalised sum, max and denominator (sinks and v_scale in the merge): [T, H, S, D_PAD + 2]
        base = ((q_tok * NUM_HEADS + head) * NUM_SPLITS + split) * (D_PAD + 2)  # [M]
        tl.store(partial_ptr + base[:, None] + offs_d[None, :], acc, mask=is_row[:, None])
        tl.store(partial_ptr + base + D_PAD, m_i, mask=is_row)
        tl.store(partial_ptr + base + D_PAD + 1, l_i, mask=is_row)


_FULL_WINDOW = 2 ** 30  # "no window": longer than any sequence, so the window test always passes


def block_q_for(max_query_len: int) -> int:
    """Query tokens per tile: 1 when every row decodes one token, else 16."""
    return 1 if max_query_len == 1 else 16


def paged_attention(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, tile_rows: torch.Tensor,
                    tile_starts: torch.Tensor, block_q: int, scale: float, k_scale: float = 1.0,
                    v_scale: float = 1.0, window: int = 0, sinks: torch.Tensor | None = None,
                    split_keys: bool = False) -> None:
    """out/q [T, H, D], kv_cache [2, N, bs, Hkv, D] (q's dtype, or float8_e4m3fn holding k / k_scale and
    v / v_scale), block_table [B, W] int32, seq_lens [B] int32,
    query_start_loc [B + 1] int32, tile_rows/tile_starts [tiles] int32 -> fills out's rows.
    window > 0: sliding window of that many keys (0 = full); sinks [H] float32 or None.
    split_keys: a decode step (block_q 1) with few programs splits its rows' keys (flash decoding)."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    assert q.stride(2) == 1 and out.stride(2) == 1 and kv_cache.stride(4) == 1, "head_dim must be contiguous"
    num_heads = q.shape[1]
    num_queries_per_kv = num_heads // num_kv_heads
    g_pad = triton.next_power_of_2(num_queries_per_kv)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    num_splits = num_splits_for(tile_rows.shape[0], num_kv_heads, block_q) if split_keys else 1
    partial = out  # unread with one split
    if num_splits > 1:
        partial = partial_buffer(q.shape[0], num_heads, num_splits, d_pad, q.device)
    grid = (tile_rows.shape[0], num_kv_heads, num_splits)
    window = window if window > 0 else _FULL_WINDOW
    sink_arg = sinks.float().contiguous() if sinks is not None else q  # unread without sinks
    _paged_attention_kernel[grid](
        out, partial, q, kv_cache[0], kv_cache[1], block_table, seq_lens, query_start_loc, tile_rows, tile_starts,
        sink_arg, scale, k_scale, v_scale, window, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_table.stride(0),
        NUM_HEADS=num_heads, NUM_QUERIES_PER_KV=num_queries_per_kv, G_PAD=g_pad, BLOCK_Q=block_q,
        BLOCK_M=max(16, block_q * g_pad), BLOCK_N=64 if d_pad <= 128 else 32,
        KV_BLOCK_SIZE=block_size, HEAD_DIM=head_dim, D_PAD=d_pad,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,  # None: the default for 16-bit inputs
        HAS_SINKS=sinks is not None, NUM_SPLITS=num_splits)
    if num_splits > 1:
        combine_splits(out, partial, head_dim, None if sinks is None else sink_arg, v_scale)


@triton.jit
def _write_kv_kernel(k_cache_ptr, v_cache_ptr, k_ptr, v_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cs, stride_ch, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr,
                     D_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, H_PAD)[:, None]
    dims = tl.arange(0, D_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HEAD_DIM)
    cache_offs = slot * stride_cs + heads * stride_ch + dims
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    tl.store(k_cache_ptr + cache_offs, k, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(v_cache_ptr + cache_offs, v, mask=mask)


def can_write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """A cache of k's own dtype (no quantization on the way), contiguous, and k/v rows with contiguous head_dim."""
    return (kv_cache.dtype == k.dtype == v.dtype and kv_cache.is_contiguous() and k.stride(2) == 1
            and v.stride(2) == 1)


def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k/v [T, Hkv, D] (strided views of the qkv projection, say) into kv_cache [2, N, bs, Hkv, D] at
    slot_mapping [T]: one launch for both, where index_copy_ takes one each."""
    num_tokens, num_heads, head_dim = k.shape
    if not num_tokens:
        return
    k_cache, v_cache = kv_cache[0].view(-1, num_heads, head_dim), kv_cache[1].view(-1, num_heads, head_dim)
    _write_kv_kernel[(num_tokens,)](
        k_cache, v_cache, k, v, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        H_PAD=triton.next_power_of_2(num_heads), D_PAD=triton.next_power_of_2(head_dim), num_warps=1)
