"""Gemma 3 text (`Gemma3ForCausalLM`, model_type gemma3_text): its parts of the shared decoder.

Read as transformers' modeling_gemma3 computes it:
- RMSNorm scales by (1 + w) (w stored, zeros at init), all in float32, cast back after (`GemmaRMSNorm`); every
  layer norms before and after its attention and before and after its MLP, and q and k per head;
- embeddings multiplied by sqrt(hidden_size) rounded to the embedding's dtype;
- a GeLU-tanh gated MLP (`hidden_activation` gelu_pytorch_tanh);
- attention scores scaled by `query_pre_attn_scalar ** -0.5`;
- two rope tables: the layers `layer_types` marks "sliding_attention" use `rope_parameters["sliding_attention"]`
  (the old `rope_local_base_freq`), the full ones `rope_parameters["full_attention"]` (`rope_theta` and
  `rope_scaling`); by default five sliding layers, then a full one (`sliding_window_pattern` 6);
- logits soft-capped, `cap * tanh(logits / cap)`, where `final_logit_softcapping` is set.
The checkpoint's names are the decoder's, plus `pre_feedforward_layernorm` and `post_feedforward_layernorm`.
Config values this does not implement are refused at load naming the field (`check_config`).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.model.layers import GatedMLP, RopeParams, rope_params_from_config

ARCHITECTURE = "Gemma3ForCausalLM"
LAYER_KINDS = ("sliding_attention", "full_attention")


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w) in float32, cast to x's dtype at the end (transformers' Gemma3RMSNorm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [..., hidden] -> normed; with residual: (normed(x + residual), x + residual)."""
        if residual is not None:
            x = x + residual
            residual = x
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = (normed * (1.0 + self.weight.float())).to(x.dtype)
        return normed if residual is None else (normed, residual)


class GeluTanhMLP(GatedMLP):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up fused as in GatedMLP."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # [T, I] each
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


def check_config(config) -> None:
    """ValueError naming the first field whose value this decoder does not implement."""
    activation = getattr(config, "hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation={activation!r} is not supported for {ARCHITECTURE} (gelu_pytorch_tanh)")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError(f"attn_logit_softcapping={config.attn_logit_softcapping!r} is not supported "
                         "(the attention backends have no score soft-capping); null is")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True is not supported (causal attention only)")
    unknown = sorted(set(layer_kinds(config)) - set(LAYER_KINDS))
    if unknown:
        raise ValueError(f"layer_types: unsupported kinds {unknown}; supported: {', '.join(LAYER_KINDS)}")


def default_layer_types(config) -> list[str]:
    """transformers' layer_types when the config has none: every `sliding_window_pattern`-th layer is full."""
    pattern = getattr(config, "sliding_window_pattern", None) or 6
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(config.num_hidden_layers)]


def layer_kinds(config) -> list[str]:
    """Each layer's kind, which picks its rope table (and its window: model/sliding_window.py)."""
    return list(getattr(config, "layer_types", None) or default_layer_types(config))


def rope_params_by_kind(config) -> dict[str, RopeParams]:
    """{layer kind: its rope settings}, from transformers 5's `rope_parameters` keyed by layer kind."""
    by_kind = getattr(config, "rope_parameters", None) or {}
    if set(by_kind) != set(LAYER_KINDS):
        raise ValueError(f"rope_parameters: expected one entry per layer kind ({', '.join(LAYER_KINDS)}); "
                         f"got {sorted(by_kind)}")
    return {kind: rope_params_from_config(SimpleNamespace(rope_parameters=params, rope_scaling=None,
                                                          max_position_embeddings=config.max_position_embeddings))
            for kind, params in by_kind.items()}


def scale_embeddings(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x [T, hidden] * scale, the scale first rounded to x's dtype as transformers does (bf16: sqrt(3840) = 62.0,
    not 61.97); a Python number, so that a CUDA graph captures it as a constant."""
    return x * float(torch.tensor(scale).to(x.dtype))


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap): logits squashed into (-cap, cap)."""
    return torch.tanh(logits / cap) * cap


def parts_fields(config) -> dict:
    """DecoderParts fields that differ for Gemma 3 (checked first: ValueError on what is not implemented)."""
    check_config(config)
    return dict(has_qk_norm=True, norm=GemmaRMSNorm, dense_mlp=GeluTanhMLP, has_sandwich_norms=True,
                embed_scale=config.hidden_size ** 0.5,
                logit_softcap=getattr(config, "final_logit_softcapping", None))
