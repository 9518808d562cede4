"""The linear layer every model layer uses: F.linear, except float32 on CPU, which goes through oneDNN or, for
weights packed at load, our AVX2 kernel.

- oneDNN's matmul (`torch.ops.mkldnn._linear_pointwise`) beats MKL's sgemm on the shapes of small models on the
  EPYC machines; it builds one primitive per row count, so rows are padded up to a few buckets (`bucket_rows`).
  Weights under 2^17 elements keep F.linear (oneDNN's call costs more than it saves there).
- Weights are laid out once at load in oneDNN's blocked format (`pack_linears`); a tied lm_head keeps a packed
  copy beside the embedding (`CausalLM.pack_tied_lm_head`).
- Without AVX-512 weights are packed for our AVX2 kernel instead (csrc/linear_avx2.cpp: 16-column panels
  streamed with prefetches), whose outputs do not depend on the batch; LLMSERVE_CPU_LINEAR forces either path
  (docs/cpu.md). The two layouts tell themselves apart by rank: ours is [P, K, 16], oneDNN's [N, K].
- Only plain inference on float32 2-D inputs takes these paths; other dtypes keep F.linear.
- On CUDA a few 16-bit rows may take a Triton GEMV instead of cuBLAS (LLMSERVE_CUDA_GEMV_ROWS, model/fused_cuda.py;
  off until measured on a device).

The measurements behind each choice: docs/benchmarks.md ("Which int8 GEMM", "Packed oneDNN weights", "Our own
AVX2 GEMM for float32 linears", "oneDNN row buckets").
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.model import cpu_isa, cpu_kernels, fused_cuda


@functools.cache
def _has_onednn() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


MIN_ONEDNN_WEIGHT = 1 << 17  # elements: smaller weights are faster through F.linear (above)


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` goes through oneDNN."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.dim() == 2
            and weight.device.type == "cpu" and weight.numel() >= MIN_ONEDNN_WEIGHT
            and not (torch.is_grad_enabled() and weight.requires_grad) and _has_onednn())


PACK_ROWS_HINT = 16  # the row count oneDNN lays a packed weight out for (decode batches; any count runs on it)


@functools.cache
def _has_packing() -> bool:
    return _has_onednn() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def can_pack(weight: torch.Tensor) -> bool:
    """Whether a Linear with this weight is packed at load (`Linear.pack`), for our kernel or oneDNN."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.numel() >= MIN_ONEDNN_WEIGHT and not weight.requires_grad
            and (cpu_kernels.packs_linears() or _has_packing()))


def packed(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] weight that `can_pack` accepts, laid out for our AVX2 kernel where it is chosen
    ([P, in, 16] panels: `cpu_kernels.packs_linears`), else for oneDNN (a new tensor either way)."""
    if cpu_kernels.packs_linears():
        return cpu_kernels.pack_linear_weight(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] float32 -> [..., out] through a weight from `packed`."""
    flat = (x if x.dim() == 2 else x.reshape(-1, x.shape[-1])).contiguous()  # [T, in]
    if packed_weight.dim() == 3:  # our kernel's panels [P, in, 16]
        out = cpu_kernels.packed_linear(flat, packed_weight, out_features, bias)
    else:
        out = _onednn_linear(flat, packed_weight, bias)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out_features)


EXACT_ROWS = 32  # row counts up to this one run as they are (decode batches of a few rows)


def bucket_rows(num_rows: int) -> int:
    """The row count oneDNN runs for num_rows: itself up to 32, then the next multiple of 8 up to 256
    and of a power of two at most num_rows / 16 beyond (16 buckets an octave: under 1/16 of padding)."""
    if num_rows <= EXACT_ROWS:
        return num_rows
    step = max(8, 1 << ((num_rows - 1).bit_length() - 5))
    return -(-num_rows // step) * step


def uses_bf16_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` goes through our AVX512-BF16 GEMV: bfloat16 decode rows (at most 8) on a CPU
    with bf16 dot products, the weight as loaded (no packing: larger batches keep oneDNN on the same tensor);
    LLMSERVE_CPU_LINEAR=onednn keeps oneDNN for every row count."""
    return x.dtype == torch.bfloat16 and _is_gemv_rows(x, weight) and gemv_takes(weight)


def gemv_takes(weight: torch.Tensor) -> bool:
    """The weight's half of `uses_bf16_gemv` (what a `Linear` decides once at load: the CPU, the build and
    LLMSERVE_CPU_LINEAR, whose reads cost a decode step of one row ~0.5 ms when made per call)."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.is_contiguous()
            and cpu_kernels.has_bf16_gemv() and cpu_isa.has_fast_bf16() and cpu_isa.linear_path() != "onednn")


def _is_gemv_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x [M <= 8, in] contiguous on CPU, outside autograd (the rows' half of `uses_bf16_gemv`, but x's dtype)."""
    return (x.dim() == 2 and x.shape[0] <= cpu_kernels.bf16_gemv_max_rows() and x.device.type == "cpu"
            and x.is_contiguous() and not (torch.is_grad_enabled() and weight.requires_grad))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in], weight [out, in], bias [out] or None -> [T, out], like F.linear."""
    if x.is_cuda:
        gemv = fused_cuda.cuda_gemv(x, weight)
        return F.linear(x, weight, bias) if gemv is None else gemv.gemv(x, weight, bias)
    if uses_bf16_gemv(x, weight):
        return cpu_kernels.bf16_gemv(x, weight, bias)
    if not uses_onednn(x, weight):
        return F.linear(x, weight, bias)
    return _onednn_linear(x, weight, bias)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] float32, weight [out, in] plain or packed -> [T, out] through oneDNN, rows bucketed."""
    num_rows = x.shape[0]
    num_padded = bucket_rows(num_rows)
    if num_padded == num_rows:  # decode batches (<= EXACT_ROWS) and bucket sizes: one call, no views
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    padded = x.new_empty(num_padded, x.shape[1])  # [Tb, in], zero rows after x's (F.pad would fill it all first)
    padded[:num_rows].copy_(x)
    padded[num_rows:].zero_()
    return torch.ops.mkldnn._linear_pointwise(padded, weight, bias, "none", [], "")[:num_rows]  # [T, out]


class Linear(nn.Linear):
    """nn.Linear through `linear` (quantization still finds it as an nn.Linear and swaps it); on CPU in
    float32 its weight may be packed once loaded, and a bfloat16 one be marked for the GEMV (`pack`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("packed_weight", None, persistent=False)  # weight laid out by `packed`
        self.is_gemv_weight = False  # bfloat16 decode rows go straight to the GEMV (`gemv_takes`, set by `pack`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] -> [..., out] with the given bias (a row-parallel rank adds it on one rank only)."""
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, self.out_features, bias)
        if self.is_gemv_weight and x.dtype == torch.bfloat16 and _is_gemv_rows(x, self.weight):
            return cpu_kernels.bf16_gemv(x, self.weight, bias)
        return linear(x, self.weight, bias)

    def pack(self) -> bool:
        """Lay the loaded weight out once for our kernel or oneDNN and drop the plain copy (`can_pack`); or, for
        a weight the bfloat16 GEMV takes, choose it for decode rows from now on (returns False: nothing packed)."""
        if not can_pack(self.weight):
            self.is_gemv_weight = self.weight is not None and gemv_takes(self.weight)
            return False
        self.packed_weight = packed(self.weight)
        del self.weight  # only the packed copy is kept: the layer's memory does not double
        self.weight = None
        return True


def pack_linears(model: nn.Module, pack_head: bool = True) -> int:
    """Pack every float32 CPU `Linear` of a loaded model (`packed`), and a tied lm_head (the model's
    `pack_tied_lm_head`), and mark the bfloat16 ones the GEMV takes; pack_head=False leaves the lm_head (tied or
    not) plain. Returns how many weights were packed."""
    head = getattr(model, "lm_head", None)
    layers = [m for m in model.modules() if isinstance(m, Linear) and (pack_head or m is not head)]
    num_packed = sum(module.pack() for module in layers)
    pack_tied = getattr(model, "pack_tied_lm_head", None)
    return num_packed + bool(pack_head and pack_tied is not None and pack_tied())
