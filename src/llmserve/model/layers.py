"""Building blocks of decoder-only transformers, on flattened tokens (no batch dim).

RMSNorm (optionally fused with the residual add), rotary embedding driven by explicit positions
[T] (default, linear, Llama-3, YaRN and Phi-3's LongRoPE frequency scaling; partial rotary for Phi-3),
and the SiLU-and-mul MLP with a fused gate/up projection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.model import cpu_kernels
from llmserve.model.fused_cuda import cuda_fused, cuda_rotary, gated_down
from llmserve.model.parallel import TensorParallel, column_linear, row_linear


class RMSNorm(nn.Module):
    """HF-compatible RMSNorm: normalise in float32, scale by the weight in the input dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [..., hidden] -> normed; with residual: (normed(x + residual), x + residual).

        float32 or bfloat16 on CPU, 2-D and contiguous: one fused op (cpu_kernels); with a residual it works in place
        (x's memory then holds the normed rows and residual's the sum, which it returns)."""
        if x.dim() == 2 and x.is_contiguous() and self.weight.dtype == x.dtype and cpu_kernels.can_fuse(x):
            if residual is None:
                return cpu_kernels.rms_norm(x, self.weight, self.eps)
            if residual.is_contiguous():
                cpu_kernels.add_rms_norm_(x, residual, self.weight, self.eps)
                return x, residual
        fused = cuda_fused(x)
        if fused is not None and (residual is None or (residual.shape == x.shape and residual.stride(1) == 1)):
            if residual is None:
                return fused.rms_norm(x, self.weight, self.eps)
            return fused.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            residual = x
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        normed = self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(x.dtype)
        return normed if residual is None else (normed, residual)


@dataclass(frozen=True)
class RopeParams:
    """Rotary settings read from an HF config; rope_type is 'default', 'linear', 'llama3', 'yarn' or 'longrope'."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0  # yarn: the ramp between extrapolated and interpolated frequencies
    beta_slow: float = 1.0
    is_truncated: bool = True  # yarn: the ramp's ends rounded to whole dimensions
    attention_scaling: float = 1.0  # yarn's mscale, longrope's attention factor: cos and sin are multiplied by it
    ext_factors: tuple[float, ...] = ()  # longrope: the short or the long factors, one per rotary pair
    partial_rotary_factor: float = 1.0  # the share of head_dim that turns (Phi-3 only); the rest passes through


_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_PARTIAL_ROTARY_ARCHS = ("Phi3ForCausalLM",)  # the modelings that read partial_rotary_factor


def rope_params_from_config(config, max_model_len: int | None = None) -> RopeParams:
    """Handles transformers 5 `rope_parameters` and the older `rope_theta` + `rope_scaling`; max_model_len
    (default max_position_embeddings) picks LongRoPE's factors."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None) or {}
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's older name
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(_SUPPORTED_ROPE_TYPES)}")
    partial = _partial_rotary_factor(config, merged)
    if rope_type == "default":
        return RopeParams(theta=float(theta), partial_rotary_factor=partial)
    if rope_type == "longrope":
        return _longrope_params(config, merged, float(theta), partial, max_model_len)
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


def _partial_rotary_factor(config, merged: dict) -> float:
    """rope_parameters' partial_rotary_factor (transformers' Phi3Config puts it there); refused, naming the
    field, for an architecture whose modeling would rotate the whole head, or one that rotates nothing."""
    partial = float(merged.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0)
    arch = (getattr(config, "architectures", None) or [""])[0]
    if partial != 1.0 and (arch not in _PARTIAL_ROTARY_ARCHS or not 0.0 < partial < 1.0):
        raise ValueError(f"rope partial_rotary_factor={partial!r} is not supported for {arch or 'this model'} "
                         f"(1.0; a value in (0, 1) for {', '.join(_PARTIAL_ROTARY_ARCHS)})")
    return partial


def _longrope_params(config, merged: dict, theta: float, partial: float, max_model_len: int | None) -> RopeParams:
    """LongRoPE (Phi-3) as transformers' `_compute_longrope_parameters`: each rotary pair's frequency divided by
    its factor, cos and sin scaled by the attention factor (sqrt(1 + ln(factor) / ln(original)) when not given).

    transformers picks the long factors per forward when the sequence passes original_max_position_embeddings;
    a shared, paged cache needs one choice per model, so (as vLLM) the long factors are used whenever the
    context (max_model_len) may pass it, the short ones otherwise: keys cached early never change."""
    original = getattr(config, "original_max_position_embeddings", None) or merged.get(
        "original_max_position_embeddings") or config.max_position_embeddings  # the top-level field wins
    factor = merged.get("factor") or config.max_position_embeddings / original
    scaling = merged.get("attention_factor")
    if scaling is None:
        scaling = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    context = max_model_len or config.max_position_embeddings
    ext_factors = merged["long_factor"] if context > original else merged["short_factor"]
    return RopeParams(theta=theta, rope_type="longrope", factor=float(factor), original_max_position_embeddings=original,
                      attention_scaling=float(scaling), ext_factors=tuple(float(f) for f in ext_factors),
                      partial_rotary_factor=partial)


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


def _longrope_inv_freq(pos_freqs: torch.Tensor, p: RopeParams) -> torch.Tensor:
    """pos_freqs [R/2] (theta ** (2i / R)) -> 1 / (factor_i * pos_freqs_i); ValueError when the config's factor
    list does not hold one factor per rotary pair."""
    if len(p.ext_factors) != pos_freqs.shape[0]:
        raise ValueError(f"rope short_factor/long_factor have {len(p.ext_factors)} entries; the rotary dimension "
                         f"needs {pos_freqs.shape[0]} (half of head_dim * partial_rotary_factor)")
    return 1.0 / (torch.tensor(p.ext_factors, dtype=torch.float32, device="cpu") * pos_freqs)


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


def rotary_dim(head_dim: int, p: RopeParams) -> int:
    """The features of a head that turn: all, or the first share of them (partial rotary)."""
    return int(head_dim * p.partial_rotary_factor)


def rope_inv_freq(head_dim: int, p: RopeParams) -> torch.Tensor:
    """[rotary_dim // 2] float32 inverse frequencies, computed exactly like transformers does."""
    head_dim = rotary_dim(head_dim, p)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    if p.rope_type == "longrope":
        return _longrope_inv_freq(p.theta ** exponents, p)
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
        """positions [T] int64 -> cos, sin [T, 1, R/2] in dtype (R: rotary_dim, head_dim unless partial)."""
        inv_freq = self._inv_freq_by_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq_cpu.to(positions.device)
            self._inv_freq_by_device[positions.device] = inv_freq
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2] float32
        cos, sin = freqs.cos(), freqs.sin()
        if self.params.attention_scaling != 1.0:  # yarn's mscale (longrope's factor), in float32 as transformers
            cos, sin = cos * self.params.attention_scaling, sin * self.params.attention_scaling
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/sin [T, 1, R/2] -> x [T, heads, D] with its first R features rotated (R < D: partial
    rotary, the rest pass through); in place for float32 and bfloat16 on CPU (cpu_kernels) and on CUDA (Triton)."""
    rot = 2 * cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    if x.stride(-1) == 1 and cos.dtype == x.dtype and cpu_kernels.can_fuse(x):
        cpu_kernels.rotary_(x, cos, sin)
        return x
    if (fused := cuda_rotary(x, cos)) is not None:
        return fused.rotary_(x, cos, sin)
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
        if (fused := cuda_fused(gate_up)) is not None:
            out = gated_down(gate_up, self.down_proj)  # the Triton GEMV's rows: SiLU-and-mul in its loads
            return self.down_proj(fused.silu_mul(gate_up)) if out is None else out
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)
