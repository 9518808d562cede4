"""Quantized linear layers: weights stored quantized with one scale per output channel, activations
quantized per token at run time (W8A8 dynamic), the GEMM in the low-precision type.

Int8Linear: int8 weights and activations, `torch._int_mm` (int32 accumulation, exact), then
x_scale[t] * w_scale[n], chosen over fbgemm's quantized linear_dynamic and `torch._weight_int8pack_mm` by
measurement (docs/benchmarks.md, "Which int8 GEMM"): fbgemm quantizes activations per tensor (a token's output
then depends on the rest of the batch) and torch deprecates the quantized tensors it needs; per-token scales
with an exact integer GEMM keep every token's output independent of its batch. On CUDA `_int_mm` wants more than 16 rows: smaller batches are zero-padded (untested on
a GPU yet). On CPUs where oneDNN has no VNNI, `_int_mm` is not exact (its AVX2 s8 GEMM saturates int16
pair sums), so there the layer keeps its weight in our kernel's panels and runs `cpu_kernels.int8_linear`
(the same quantization, exact sums: csrc/int8_linear_avx2.cpp).

Fp8Linear: float8_e4m3fn weights and activations through `torch._scaled_mm` with row-wise scales
(Hopper; CPU runs the same op in torch 2.13, as the reference path the tests use; older torch the same sums
in float32). On CUDA the activation's quantization is one Triton launch, and decode tokens take fp8_triton's decode kernel, whose
row sums do not depend on the batch (model/quant/token_kinds.py; docs/benchmarks.md has torch's path at batch 1).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.model import cpu_kernels
from llmserve.model.quant.token_kinds import ALL_PROMPT, StepKinds

INT8_MAX = 127.0
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_MIN_SCALE = 1e-12
_CUDA_INT_MM_MIN_ROWS = 17


@functools.cache
def _cpu_has_rowwise_scaled_mm() -> bool:
    """Whether this torch's CPU `_scaled_mm` takes per-row scales (2.13 does; older ones only per-tensor)."""
    a = torch.ones(2, 16).to(FP8_DTYPE)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(2, 1), scale_b=torch.ones(1, 2), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


def channel_scales(weight: torch.Tensor, qmax: float) -> torch.Tensor:
    """weight [N, K] -> [N] float32 scales: the largest |w| of each output channel maps to qmax."""
    return (weight.float().abs().amax(dim=1) / qmax).clamp(min=_MIN_SCALE)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (int8 [N, K], scales [N] float32), symmetric per output channel."""
    scale = channel_scales(weight, INT8_MAX)
    q = torch.round(weight.float() / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (float8_e4m3fn [N, K], scales [N] float32), per output channel."""
    scale = channel_scales(weight, FP8_MAX)
    return (weight.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def _per_token(x: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (x / scale, scale [T, 1] float32)."""
    x = x.float()
    scale = (x.abs().amax(dim=1, keepdim=True) / qmax).clamp(min=_MIN_SCALE)
    return x / scale, scale


class Int8Linear(nn.Module):
    """y = x W^T + b with W int8 per output channel and x int8 per token (dynamic)."""

    def __init__(self, weight_t: torch.Tensor | None, scale: torch.Tensor, bias: torch.Tensor | None,
                 panels: torch.Tensor | None = None, in_features: int = 0):
        """Either weight_t [K, N] int8 (torch._int_mm's right operand) or panels (cpu_kernels.pack_int8_weight
        of the [N, K] weight; in_features names K)."""
        super().__init__()
        assert (weight_t is None) != (panels is None), "one weight layout"
        self.register_buffer("weight_t", weight_t)  # [K, N] int8 (layout: from_float), or None
        self.register_buffer("panels", panels)  # [ceil(N / 16), ceil(K / 2), 32] int8, or None
        self.register_buffer("scale", scale)  # [N] float32
        self.register_buffer("bias", bias)
        self.out_features = scale.numel()
        self.in_features = weight_t.shape[0] if weight_t is not None else in_features

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
        q, scale = quantize_int8(weight)  # q [N, K]
        if not q.is_cuda and cpu_kernels.packs_int8():  # no VNNI: our exact kernel (_int_mm's is not)
            return cls(None, scale, None if bias is None else bias.float().contiguous(),
                       panels=cpu_kernels.pack_int8_weight(q), in_features=q.shape[1])
        # _int_mm's right operand [K, N]: column-major on CUDA, the layout of cuBLASLt's int8 GEMM (a
        # row-major one failed there with CUBLAS_STATUS_NOT_SUPPORTED), row-major on CPU (measured faster)
        return cls(q.t() if q.is_cuda else q.t().contiguous(), scale, bias)

    def quantized_weight(self) -> torch.Tensor:
        """[N, K] int8."""
        if self.panels is not None:
            return cpu_kernels.unpack_int8_weight(self.panels, self.out_features, self.in_features)
        return self.weight_t.t()

    def dequantized_weight(self) -> torch.Tensor:
        """[N, K] float32: the weight this layer multiplies by."""
        return self.quantized_weight().float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.panels is not None:
            y = cpu_kernels.int8_linear(x2.float().contiguous(), self.panels, self.scale, self.out_features, self.bias)
            return y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        xs, x_scale = _per_token(x2, INT8_MAX)
        xq = torch.round(xs).to(torch.int8)  # |xs| <= 127 by construction
        rows = xq.shape[0]
        if xq.is_cuda and rows < _CUDA_INT_MM_MIN_ROWS:
            xq = F.pad(xq, (0, 0, 0, _CUDA_INT_MM_MIN_ROWS - rows))
        acc = torch._int_mm(xq, self.weight_t)[:rows]  # [T, N] int32
        y = acc.float() * x_scale * self.scale
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


class Fp8Linear(nn.Module):
    """y = x W^T + b with W float8_e4m3fn per output channel and x float8 per token (dynamic)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight", weight)  # [N, K] float8_e4m3fn; weight.t() is column-major for _scaled_mm
        self.register_buffer("scale", scale.float().reshape(1, -1))  # [1, N] float32
        self.register_buffer("bias", bias)
        self.out_features, self.in_features = weight.shape
        self.step_kinds: StepKinds | None = None  # the model's, shared by its FP8 layers (quantize_model)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Fp8Linear:
        q, scale = quantize_fp8(weight)
        return cls(q, scale, bias)

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.float() * self.scale.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        y = self._matmul_cuda(x2) if x2.is_cuda else self.matmul_torch(x2)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def matmul_torch(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> [T, N] through torch's ops: per-token quantization, then `_scaled_mm`."""
        xs, x_scale = _per_token(x, FP8_MAX)
        xq = xs.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        if not x.is_cuda and not _cpu_has_rowwise_scaled_mm():  # torch before 2.13: the same sums in float32
            return (xq.float() @ self.weight.float().t()) * x_scale * self.scale
        out_dtype = x.dtype if x.is_cuda else torch.float32  # row-wise _scaled_mm on CUDA: bf16 out
        return torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=self.scale, bias=None,
                                out_dtype=out_dtype)

    def _matmul_cuda(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> [T, N] through the Triton kernels of fp8_triton: decode tokens through its decode
        kernel, prompt tokens through its quantization kernel and `_scaled_mm` (token_kinds.py says which)."""
        from llmserve.model.quant import fp8_triton

        kinds = ALL_PROMPT if self.step_kinds is None else self.step_kinds.current
        if kinds.is_all_decode:
            return fp8_triton.fp8_decode_matmul(x, self.weight, self.scale.reshape(-1))
        if not kinds.is_mixed:
            return self._prompt_matmul(x)
        out = torch.empty((x.shape[0], self.out_features), dtype=x.dtype, device=x.device)  # [T, N]
        if kinds.num_leading_decode:  # decode tokens [0, D), prompt tokens [D, T): each writes its rows
            num = kinds.num_leading_decode
            fp8_triton.fp8_decode_matmul(x[:num], self.weight, self.scale.reshape(-1), out=out[:num])
            self._prompt_matmul(x[num:], out=out[num:])
            return out
        out[kinds.decode_index] = fp8_triton.fp8_decode_matmul(x[kinds.decode_index], self.weight,
                                                               self.scale.reshape(-1))
        out[kinds.prompt_index] = self._prompt_matmul(x[kinds.prompt_index])
        return out

    def _prompt_matmul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] -> [T, N] (into `out` [T, N] when given: a slice of the step's output)."""
        from llmserve.model.quant import fp8_triton

        xq, x_scale = fp8_triton.quantize_rows(x)
        return torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=self.scale, bias=None,
                                out_dtype=x.dtype, out=out)
