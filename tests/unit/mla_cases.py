"""Shared by the latent-attention tests: a random MlaAttention, a paged step over its latent cache (fresh prompts,
continued prefixes, decode rows), and a float64 reference that expands K and V per head over each whole sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kv_int8_rows import dequantize_int8_rows

from llmserve.model import mla
from llmserve.model.attention import quantize_int8_rows
from llmserve.model.attention import AttentionInputs
from llmserve.model.layers import RotaryEmbedding, apply_rotary, rope_params_from_config
from llmserve.testing.paged_batch import PagedBatchBuilder

HIDDEN, HEADS, KV_LORA, ROPE, NOPE, V_DIM = 32, 4, 24, 8, 16, 12
BLOCK_SIZE, NUM_BLOCKS = 4, 64
ROWS = [(0, 7), (5, 3), (9, 1), (0, 1), (13, 1)]  # (cached tokens, new tokens) per request


@dataclass
class LatentStep:
    """One step's batch in float64: the new tokens' x [T, hidden] and cos/sin, the cache with the cached prefixes'
    entries written, the backends' inputs, and the reference output [T, hidden]."""

    attention: mla.MlaAttention
    new_x: torch.Tensor
    cos_sin: tuple[torch.Tensor, torch.Tensor]
    cache: torch.Tensor  # [1, N, bs, 1, L + R]
    inputs: AttentionInputs
    expected: torch.Tensor


def make_attention(q_lora_rank: int | None, num_heads: int = HEADS) -> mla.MlaAttention:
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(hidden_size=HIDDEN, num_attention_heads=num_heads, kv_lora_rank=KV_LORA,
                              q_lora_rank=q_lora_rank, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=V_DIM)
    torch.manual_seed(0)
    attention = mla.MlaAttention(config).double()
    with torch.no_grad():
        for param in attention.parameters():
            param.normal_(0.0, 0.3)
    return attention


def reference(attention: mla.MlaAttention, x: torch.Tensor, cos_sin, num_new: int,
              cache_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """One request: x [S, hidden] of its whole sequence -> the last num_new tokens' output [n, hidden], K and V
    expanded per head for every token from its latent entry as a cache of cache_dtype holds it, float64."""
    num_tokens, num_heads = x.shape[0], attention.num_heads
    q = attention._queries(x).view(num_tokens, num_heads, NOPE + ROPE)
    q_rope = apply_rotary(q[..., NOPE:].contiguous(), *cos_sin)
    q = torch.cat([q[..., :NOPE], q_rope], dim=-1)[-num_new:]  # [n, H, Dn + R]
    entries = rounded(attention._latent_entries(x, cos_sin), cache_dtype)  # [S, L + R]
    k, v = attention._expand_keys_values(entries)  # [S, H, Dn + R], [S, H, Dv]
    scores = torch.einsum("qhd,shd->hqs", q, k) * attention.scale
    is_visible = torch.arange(num_tokens)[None, :] <= torch.arange(num_tokens - num_new, num_tokens)[:, None]
    probs = scores.masked_fill(~is_visible, float("-inf")).softmax(-1)
    return attention.o_proj(torch.einsum("hqs,shd->qhd", probs, v).reshape(num_new, num_heads * V_DIM))


def rounded(entries: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """entries [S, L + R] as a cache of cache_dtype holds them, in float64 (int8: quantized per entry in float32)."""
    if cache_dtype == torch.int8:
        return dequantize_int8_rows(quantize_int8_rows(entries.float())).double()
    return entries.to(cache_dtype).double()


def stored(cache: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """The step's float64 cache [1, N, bs, 1, L + R] stored in cache_dtype (int8: [.., L + R + 4] with the scales)."""
    return quantize_int8_rows(cache.float()) if cache_dtype == torch.int8 else cache.to(cache_dtype)


@torch.no_grad()
def make_step(q_lora_rank: int | None, rows: list[tuple[int, int]] = ROWS, num_heads: int = HEADS,
              block_size: int = BLOCK_SIZE, num_blocks: int = NUM_BLOCKS, device: str = "cpu",
              cache_dtype: torch.dtype = torch.float64) -> LatentStep:
    """rows: (cached tokens, new tokens) per request; everything on `device` but the reference (on the CPU);
    cache_dtype: the latent cache's (the reference rounds every entry through it)."""
    attention = make_attention(q_lora_rank, num_heads)
    rotary = RotaryEmbedding(ROPE, rope_params_from_config(
        type("Config", (), {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})()))
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(cached + new, HIDDEN, generator=gen, dtype=torch.float64) for cached, new in rows]
    cache = torch.zeros(mla.cache_shape(num_blocks, block_size, KV_LORA, ROPE), dtype=torch.float64)
    builder = PagedBatchBuilder(num_blocks, block_size, seed=2)
    for req, ((cached, _), x) in enumerate(zip(rows, xs)):  # the cached prefixes' entries, as earlier steps wrote
        slots = torch.tensor(builder.add_cached(req, cached), dtype=torch.int64)
        entries = attention._latent_entries(x[:cached], rotary.cos_sin(torch.arange(cached), torch.float64))
        cache.view(-1, KV_LORA + ROPE).index_copy_(0, slots, entries)
    _, positions, inputs = builder.step([(req, [0] * new) for req, (_, new) in enumerate(rows)], device)
    expected = torch.cat([reference(attention, x, rotary.cos_sin(torch.arange(x.shape[0]), torch.float64), new,
                                    cache_dtype) for (_, new), x in zip(rows, xs)])
    new_x = torch.cat([x[cached:] for (cached, _), x in zip(rows, xs)])
    cos_sin = tuple(t.to(device) for t in rotary.cos_sin(positions.cpu(), torch.float64))
    return LatentStep(attention.to(device), new_x.to(device), cos_sin, cache.to(device), inputs, expected)
