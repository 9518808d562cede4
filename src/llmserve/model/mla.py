"""Multi-head Latent Attention (DeepSeek-V2/V3), over a paged cache of compressed latents.

Per token, `kv_a_proj_with_mqa` makes a latent c [L] (kv_lora_rank, RMS-normed) and one rope key k_r [R]
(qk_rope_head_dim) shared by all heads; the cache holds just that, [c, k_r] (L + R values a token a layer:
576 for V3, where per-head K and V would take 128 x (192 + 128) = 40,960). Head h's key and value are
up-projections of c by `kv_b_proj` (W_UK_h [Dn, L], W_UV_h [Dv, L]) plus k_r for the key's rope part, so

    score_h(t) = q_nope_h . W_UK_h c(t) + q_rope_h . k_r(t) = [W_UK_h^T q_nope_h, q_rope_h] . [c(t), k_r(t)]
    out_h      = W_UV_h sum_t p_h(t) c(t)

Rows over a cached prefix (decode, later chunks, prefix hits) take the absorbed form (vLLM's, SGLang's,
FlashMLA's): queries projected into the latent space (`_absorb_queries`), multi-query attention with one head
of width L + R over the cached entries, whose first L values are the value (model/attn_latent.py), then the
up-projection W_UV per head (`_expand_values`): nothing per head is cached or rebuilt for past tokens. Fresh
prompt rows take the expanded form over their own tokens (`_expand_keys_values`: K and V per head from the
step's latents), narrower attention than the absorbed one when the prompt is long.

The queries come from `q_proj`, or through a low-rank `q_a_proj` -> RMSNorm -> `q_b_proj` when q_lora_rank is
set. The rope features are rotated rotate-half style: model/deepseek.py reorders an interleaved checkpoint's
rope rows so that this equals its interleaved rotation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.model import attn_latent, deepseek
from llmserve.model.attention import AttentionBackend
from llmserve.model.layers import RMSNorm, apply_rotary
from llmserve.model.linear import Linear
from llmserve.model.parallel import ShardLayout, TensorParallel, column_linear, row_linear

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not config.rms_norm_eps
_LATENT_NORM_EPS = 1e-6


class LatentUpProjection(nn.Module):
    """kv_b_proj [H * (Dn + Dv), L] as a plain weight: read per head (W_UK, W_UV), never as one GEMM, so it
    is not a `Linear` (which the loader may re-lay out for the CPU GEMM)."""

    def __init__(self, kv_lora_rank: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, kv_lora_rank))


class MlaAttention(nn.Module):
    """x [T, hidden] -> [T, hidden]; kv_cache [1, num_blocks, block_size, 1, L + R] (`cache_shape`).

    With tensor parallelism (vLLM's split) a rank holds its heads' rows of q_proj / q_b_proj and kv_b_proj and
    their inputs of o_proj (an all-reduce sums the ranks' outputs); the latent projections, their norms and so
    the latent cache are whole on every rank."""

    def __init__(self, config, tp: TensorParallel | None = None, layout: ShardLayout | None = None):
        super().__init__()
        self.num_heads = config.num_attention_heads if layout is None else layout.q_heads[1]
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        bias = bool(getattr(config, "attention_bias", False))
        q_size = self.num_heads * (self.nope_dim + self.rope_dim)
        self.q_lora_rank = config.q_lora_rank
        if self.q_lora_rank is None:
            self.q_proj = column_linear(config.hidden_size, q_size, False, tp)
        else:
            self.q_a_proj = Linear(config.hidden_size, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = column_linear(self.q_lora_rank, q_size, False, tp)
        self.kv_a_proj_with_mqa = Linear(config.hidden_size, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = LatentUpProjection(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim))
        self.o_proj = row_linear(self.num_heads * self.v_dim, config.hidden_size, bias, tp)
        self.scale = deepseek.softmax_scale(config)
        self.window = 0  # no sliding window in DeepSeek; set by the decoder like every attention's

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                attn_metadata: object, attn_backend: AttentionBackend) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; attn_metadata is the torch backend's (model/attn_latent.py) or the Triton
        backend's (model/mla_triton.py)."""
        num_tokens = x.shape[0]
        q = self._queries(x).view(num_tokens, self.num_heads, self.nope_dim + self.rope_dim)  # [T, H, Dn + R]
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_rope = apply_rotary(q_rope, *cos_sin)
        entries = self._latent_entries(x, cos_sin)  # [T, L + R]
        attn_latent.write_entries(kv_cache, attn_metadata.slot_mapping, entries)
        if attn_backend.name == "triton":
            out = self._attend_triton(q_nope, q_rope, kv_cache, attn_metadata)
        else:  # fresh rows' expanded form reads the entries as the cache holds them, as later rows will
            out = self._attend_torch(q_nope, q_rope, attn_latent.as_cached(entries, kv_cache.dtype), kv_cache,
                                     attn_metadata)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_dim))

    def _attend_triton(self, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                       metadata) -> torch.Tensor:
        """Every row in the absorbed form through the Triton kernel (model/mla_triton.py) -> out [T, H, Dv]."""
        from llmserve.model import mla_triton  # triton is imported only where the Triton backend is used

        q_latent = self._absorb_queries(q_nope)  # [T, H, L]
        latent_out = torch.empty(q_latent.shape, dtype=q_latent.dtype, device=q_latent.device)
        mla_triton.paged_latent_attention(latent_out, q_latent, q_rope, kv_cache, metadata.block_table,
                                          metadata.seq_lens, metadata.query_start_loc, metadata.tile_rows,
                                          metadata.tile_starts, metadata.block_q, self.scale)
        return self._expand_values(latent_out)

    def _attend_torch(self, q_nope: torch.Tensor, q_rope: torch.Tensor, entries: torch.Tensor,
                      kv_cache: torch.Tensor, attn_metadata) -> torch.Tensor:
        """The torch backend's rows: the C++ kernel's (CPU), then its groups -> out [T, H, Dv]."""
        attn_latent.check_metadata(attn_metadata)
        num_tokens = q_nope.shape[0]
        out = self._attend_kernel_rows(q_nope, q_rope, kv_cache, attn_metadata)  # [T, H, Dv] or None
        groups = attn_latent.groups(attn_metadata, is_kernel_used=out is not None)
        if out is None and len(groups) == 1 and groups[0].is_in_token_order and groups[0].num_rows == num_tokens:
            out = self._attend_group(q_nope, q_rope, entries, kv_cache, groups[0])  # decode rows only
        else:
            out = q_nope.new_empty(num_tokens, self.num_heads, self.v_dim) if out is None else out
            for group in groups:
                attn_latent.scatter(out, self._attend_group(q_nope, q_rope, entries, kv_cache, group), group)
        return out

    def _attend_kernel_rows(self, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                            metadata) -> torch.Tensor | None:
        """The C++ kernel's rows in the absorbed form -> out [T, H, Dv] (the other rows' entries undefined: the
        groups fill them); None when the kernel takes none. Only the kernel's tokens are projected in and out."""
        if not attn_latent.kernel_takes(metadata, q_rope, kv_cache):
            return None
        tokens = attn_latent.kernel_tokens(metadata)  # None: every token
        if tokens is not None:
            q_nope, q_rope = q_nope.index_select(0, tokens), q_rope.index_select(0, tokens)
        absorbed = torch.cat([self._absorb_queries(q_nope), q_rope], dim=-1)  # [n, H, L + R]
        num_tokens = metadata.slot_mapping.shape[0]
        queries = absorbed if tokens is None else \
            absorbed.new_empty(num_tokens, *absorbed.shape[1:]).index_copy_(0, tokens, absorbed)  # [T, H, L + R]
        latent_out = attn_latent.attend_kernel_rows(queries, kv_cache, metadata, self.scale)[..., :self.kv_lora_rank]
        if tokens is None:
            return self._expand_values(latent_out)
        out = latent_out.new_empty(num_tokens, self.num_heads, self.v_dim)
        return out.index_copy_(0, tokens, self._expand_values(latent_out.index_select(0, tokens)))

    def _attend_group(self, q_nope: torch.Tensor, q_rope: torch.Tensor, entries: torch.Tensor,
                      kv_cache: torch.Tensor, group) -> torch.Tensor:
        """One group of rows -> its out [Bg * Q, H, Dv]: absorbed over the cache, or expanded for fresh rows."""
        q_nope, q_rope = attn_latent.group_rows(q_nope, group), attn_latent.group_rows(q_rope, group)
        if group.block_table is None:
            k, v = self._expand_keys_values(attn_latent.group_rows(entries, group))
            return attn_latent.attend_expanded(torch.cat([q_nope, q_rope], dim=-1), k, v, group, self.scale)
        queries = torch.cat([self._absorb_queries(q_nope), q_rope], dim=-1)  # [n, H, L + R]
        latent_out = attn_latent.attend_absorbed(queries, kv_cache, group, self.scale, self.kv_lora_rank)
        return self._expand_values(latent_out)

    def _expand_keys_values(self, entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """entries [n, L + R] -> per-head k [n, H, Dn + R] (the rope key shared by all heads), v [n, H, Dv]."""
        latent, k_rope = entries.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = F.linear(latent, self.kv_b_proj.weight).view(-1, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope[:, None, :].expand(-1, self.num_heads, -1)], dim=-1)
        return k, v

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def _latent_entries(self, x: torch.Tensor, cos_sin) -> torch.Tensor:
        """x [T, hidden] -> the tokens' cache entries [T, L + R]: the normed latent, then the rotated rope key."""
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_rope = apply_rotary(k_rope.contiguous()[:, None, :], *cos_sin)[:, 0]  # [T, R], one head
        return torch.cat([self.kv_a_layernorm(latent.contiguous()), k_rope], dim=-1)

    def _per_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj as W_UK [H, Dn, L] and W_UV [H, Dv, L] (views)."""
        weight = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return weight[:, :self.nope_dim], weight[:, self.nope_dim:]

    def _absorb_queries(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, Dn] -> W_UK_h^T q_nope_h for each head: [T, H, L]."""
        w_uk, _ = self._per_head()
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [H, T, Dn] @ [H, Dn, L]

    def _expand_values(self, latent_out: torch.Tensor) -> torch.Tensor:
        """latent_out [T, H, L] -> W_UV_h latent_out_h for each head: [T, H, Dv]."""
        _, w_uv = self._per_head()
        return torch.bmm(latent_out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [H, T, L] @ [H, L, Dv]


def cache_shape(num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int) -> tuple[int, ...]:
    """One layer's latent cache: [1, num_blocks, block_size, 1, L + R], the backends' five axes with one
    "kv" entry (not K and V) of one head (shared by all), so that sizing and allocation read it as any cache."""
    return (1, num_blocks, block_size, 1, kv_lora_rank + rope_dim)
