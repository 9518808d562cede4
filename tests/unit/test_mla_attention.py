"""Multi-head Latent Attention over the latent cache against a float64 reference that expands K and V per head
over each request's whole sequence: fresh prompt rows (the expanded form), rows continuing a cached prefix and
decode rows (the absorbed form over cached latents), in one step, with and without the C++ kernel's rows."""

from __future__ import annotations

import pytest
import torch

from llmserve.model import cpu_kernels, mla
from llmserve.model.attn_torch import TorchAttentionBackend
from llmserve.model.layers import RotaryEmbedding, apply_rotary, rope_params_from_config
from llmserve.testing.paged_batch import PagedBatchBuilder

HIDDEN, HEADS, KV_LORA, ROPE, NOPE, V_DIM = 32, 4, 24, 8, 16, 12
BLOCK_SIZE, NUM_BLOCKS = 4, 64
ROWS = [(0, 7), (5, 3), (9, 1), (0, 1), (13, 1)]  # (cached tokens, new tokens) per request


def _attention(q_lora_rank: int | None) -> mla.MlaAttention:
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(hidden_size=HIDDEN, num_attention_heads=HEADS, kv_lora_rank=KV_LORA,
                              q_lora_rank=q_lora_rank, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=V_DIM)
    torch.manual_seed(0)
    attention = mla.MlaAttention(config).double()
    with torch.no_grad():
        for param in attention.parameters():
            param.normal_(0.0, 0.3)
    return attention


def _reference(attention: mla.MlaAttention, x: torch.Tensor, cos_sin, num_new: int) -> torch.Tensor:
    """One request: x [S, hidden] of its whole sequence -> the last num_new tokens' output [n, hidden], K and V
    expanded per head for every token, float64."""
    num_tokens = x.shape[0]
    q = attention._queries(x).view(num_tokens, HEADS, NOPE + ROPE)
    q_rope = apply_rotary(q[..., NOPE:].contiguous(), *cos_sin)
    q = torch.cat([q[..., :NOPE], q_rope], dim=-1)[-num_new:]  # [n, H, Dn + R]
    k, v = attention._expand_keys_values(attention._latent_entries(x, cos_sin))  # [S, H, Dn + R], [S, H, Dv]
    scores = torch.einsum("qhd,shd->hqs", q, k) * attention.scale
    is_visible = torch.arange(num_tokens)[None, :] <= torch.arange(num_tokens - num_new, num_tokens)[:, None]
    probs = scores.masked_fill(~is_visible, float("-inf")).softmax(-1)
    return attention.o_proj(torch.einsum("hqs,shd->qhd", probs, v).reshape(num_new, HEADS * V_DIM))


@pytest.mark.parametrize("q_lora_rank", [None, 12])
@pytest.mark.parametrize(("use_cpu_kernel", "kernel_takes_prompts", "dtype", "tolerance"), [
    (False, False, torch.float64, 1e-10),  # torch groups only
    (None, False, torch.float32, 1e-5),  # the C++ kernel's decode-like rows, groups for the prompts
    (None, True, torch.float32, 1e-5),  # the C++ kernel's every row
])
def test_fresh_continuing_and_decode_rows_equal_per_head_attention(q_lora_rank, use_cpu_kernel, kernel_takes_prompts,
                                                                   dtype, tolerance):
    if use_cpu_kernel is None and not cpu_kernels.available():
        pytest.skip("the C++ kernels do not build here")
    attention = _attention(q_lora_rank)
    rotary = RotaryEmbedding(ROPE, rope_params_from_config(
        type("Config", (), {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})()))
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(cached + new, HIDDEN, generator=gen, dtype=torch.float64) for cached, new in ROWS]
    cache = torch.zeros(mla.cache_shape(NUM_BLOCKS, BLOCK_SIZE, KV_LORA, ROPE), dtype=torch.float64)
    builder = PagedBatchBuilder(NUM_BLOCKS, BLOCK_SIZE, seed=2)
    with torch.no_grad():
        for req, ((cached, _), x) in enumerate(zip(ROWS, xs)):  # the cached prefixes' entries, as earlier steps wrote
            slots = torch.tensor(builder.add_cached(req, cached), dtype=torch.int64)
            entries = attention._latent_entries(x[:cached], rotary.cos_sin(torch.arange(cached), torch.float64))
            cache.view(-1, KV_LORA + ROPE).index_copy_(0, slots, entries)
        _, positions, inputs = builder.step([(req, [0] * new) for req, (_, new) in enumerate(ROWS)])
        expected = torch.cat([_reference(attention, x, rotary.cos_sin(torch.arange(x.shape[0]), torch.float64), new)
                              for (_, new), x in zip(ROWS, xs)])
        backend = TorchAttentionBackend(use_cpu_kernel=use_cpu_kernel, kernel_takes_prompts=kernel_takes_prompts)
        new_x = torch.cat([x[cached:] for (cached, _), x in zip(ROWS, xs)])
        attention, cache = attention.to(dtype), cache.to(dtype)
        metadata = backend.build_metadata(inputs)
        out = attention(new_x.to(dtype), rotary.cos_sin(positions, dtype), cache, metadata, backend)
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)
    assert cache.view(-1, KV_LORA + ROPE)[inputs.slot_mapping].abs().sum() > 0  # the new tokens' entries were stored
