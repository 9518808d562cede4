"""Building blocks of decoder-only transformers, on flattened tokens (no batch dim).

RMSNorm (optionally fused with the residual add), rotary embedding driven by explicit positions
[T] (default, linear, Llama-3 and YaRN frequency scaling), and the SiLU-and-mul MLP with a fused
gate/up projection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.model import cpu_kernels
from llmserve.model.parallel import TensorParallel, column_linear, row_linear


class RMSNorm(nn.Module):
    """HF-compatible RMSNorm: normalise in float32, scale by the weight in the input dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [..., hidden] -> normed; with residual: (normed(x + residual), x + residual).

        float32 on CPU, 2-D and contiguous: one fused op (cpu_kernels); with a residual it works in place
        (x's memory then holds the normed rows and residual's the sum, which it returns)."""
        if x.dim() == 2 and x.is_contiguous() and cpu_kernels.can_fuse(x):
            if residual is None:
                return cpu_kernels.rms_norm(x, self.weight, self.eps)
            if residual.is_contiguous():
                cpu_kernels.add_rms_norm_(x, residual, self.weight, self.eps)
                return x, residual
        if residual is not None:
            x = x + residual
            residual = x
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        normed = self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(x.dtype)
        return normed if residual is None else (normed, residual)


@dataclass(frozen=True)
class RopeParams:
    """Rotary settings read from an HF config; rope_type is 'default', 'linear', 'llama3' or 'yarn'."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0  # yarn: the ramp between extrapolated and interpolated frequencies
    beta_slow: float = 1.0
    is_truncated: bool = True  # yarn: the ramp's ends rounded to whole dimensions
    attention_scaling: float = 1.0  # yarn's mscale: cos and sin are multiplied by it


_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_params_from_config(config) -> RopeParams:
    """Handles transformers 5 `rope_parameters` and the older `rope_theta` + `rope_scaling`."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None) or {}
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(_SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return RopeParams(theta=float(theta))
    if rope_type == "yarn":
        return _yarn_params(config, merged, float(theta))
    keys = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    extra = {k: merged[k] for k in keys if rope_type == "llama3" and k in merged}
    return RopeParams(theta=float(theta), rope_type=rope_type, factor=float(merged["factor"]), **extra)


def _yarn_params(config, merged: dict, theta: float) -> RopeParams:
    """YaRN's fields as transformers' `_compute_yarn_parameters` reads them (factor from the context ratio
    when null; the attention factor from factor, mscale and mscale_all_dim when not given)."""
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"rope partial_rotary_factor={merged['partial_rotary_factor']!r} is not supported (1.0)")
    original = merged["original_max_position_embeddings"]
    factor = merged.get("factor") or config.max_position_embeddings / original
    scaling = merged.get("attention_factor")
    if scaling is None:
        mscale, mscale_all_dim = merged.get("mscale"), merged.get("mscale_all_dim")
        scaling = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim \
            else _yarn_mscale(factor)
    return RopeParams(theta=theta, rope_type="yarn", factor=float(factor), original_max_position_embeddings=original,
                      beta_fast=merged.get("beta_fast") or 32.0, beta_slow=merged.get("beta_slow") or 1.0,
                      is_truncated=bool(merged.get("truncate", True)), attention_scaling=float(scaling))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(pos_freqs: torch.Tensor, head_dim: int, p: RopeParams) -> torch.Tensor:
    """pos_freqs [D/2] (theta ** (2i / D)) -> YaRN's inverse frequencies: the dimensions that turn more than
    beta_fast times over the original context keep their frequency, those under beta_slow turns are divided by
    factor, a linear ramp blends the ones between (transformers' `_compute_yarn_parameters`, same float ops)."""
    def correction_dim(num_rotations: float) -> float:
        return head_dim * math.log(p.original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (
            2 * math.log(p.theta))

    low, high = correction_dim(p.beta_fast), correction_dim(p.beta_slow)
    if p.is_truncated:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high  # no division by zero
    dims = torch.arange(head_dim // 2, dtype=torch.float32, device="cpu")  # [D/2]
    extrapolated = 1 - ((dims - low) / (high - low)).clamp(0, 1)  # [D/2] the share of the original frequency
    return 1.0 / (p.factor * pos_freqs) * (1 - extrapolated) + 1.0 / pos_freqs * extrapolated


def _llama3_scale(inv_freq: torch.Tensor, p: RopeParams) -> torch.Tensor:
    """Llama 3.1 frequency scaling: slow down low frequencies, keep high ones, blend in between."""
    low_freq_wavelen = p.original_max_position_embeddings / p.low_freq_factor
    high_freq_wavelen = p.original_max_position_embeddings / p.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / p.factor, inv_freq)
    smooth = (p.original_max_position_embeddings / wavelen - p.low_freq_factor) / (
        p.high_freq_factor - p.low_freq_factor)
    smoothed = (1 - smooth) * scaled / p.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_inv_freq(head_dim: int, p: RopeParams) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, computed exactly like transformers does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    if p.rope_type == "yarn":
        return _yarn_inv_freq(p.theta ** exponents, head_dim, p)
    inv_freq = 1.0 / (p.theta ** exponents)
    if p.rope_type == "linear":
        return inv_freq / p.factor
    if p.rope_type == "llama3":
        return _llama3_scale(inv_freq, p)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding; cos/sin are computed once per forward."""

    def __init__(self, head_dim: int, params: RopeParams):
        super().__init__()
        self.head_dim = head_dim
        self.params = params
        self._inv_freq_cpu = rope_inv_freq(head_dim, params)  # plain attribute: survives meta init
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, sin [T, 1, head_dim // 2] in dtype."""
        inv_freq = self._inv_freq_by_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq_cpu.to(positions.device)
            self._inv_freq_by_device[positions.device] = inv_freq
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2] float32
        cos, sin = freqs.cos(), freqs.sin()
        if self.params.attention_scaling != 1.0:  # yarn's mscale, in float32 as transformers applies it
            cos, sin = cos * self.params.attention_scaling, sin * self.params.attention_scaling
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/sin [T, 1, D/2] -> rotated x [T, heads, D]; float32 on CPU in place (cpu_kernels)."""
    if x.stride(-1) == 1 and cpu_kernels.can_fuse(x):
        cpu_kernels.rotary_(x, cos, sin)
        return x
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one projection."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, tp: TensorParallel | None = None):
        """With tensor parallelism `intermediate_size` is this rank's share (down_proj all-reduces)."""
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = column_linear(hidden_size, 2 * intermediate_size, bias, tp)
        self.down_proj = row_linear(intermediate_size, hidden_size, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        if gate_up.dim() == 2 and gate_up.is_contiguous() and cpu_kernels.can_fuse(gate_up):
            return self.down_proj(cpu_kernels.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)
