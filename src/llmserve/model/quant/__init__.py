"""Weight quantization of a loaded model.

`quantize_model(model, method)` swaps every nn.Linear of the decoder layers (fused qkv, o, fused
gate/up, down) and the lm_head for a quantized layer (model/quant/linear.py), and each MoE layer's experts
for one such layer per expert and matrix (model/quant/experts.py; the router stays in float); a tied
lm_head gets a quantized copy of the embedding table, the lookup keeps the float one. On a tensor-parallel rank
each slice is quantized, a row-parallel one keeping its all-reduce, and the lm_head stays float
(model/quant/parallel.py). `checkpoint.py` reads (and writes) checkpoints already quantized to FP8.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from llmserve.model import cpu_kernels
from llmserve.model.quant.checkpoint import checkpoint_method, dequantize_weights
from llmserve.model.quant.experts import quantize_model_experts
from llmserve.model.quant.linear import FP8_DTYPE, Fp8Linear, Int8Linear
from llmserve.model.quant.parallel import rank_bias, wrapped
from llmserve.model.quant.token_kinds import StepKinds

__all__ = ["METHODS", "checkpoint_method", "check_supported", "dequantize_weights", "kv_cache_torch_dtype",
           "quantize_model", "quantized_linear"]

METHODS = ("int8", "fp8")
_LAYERS = {"int8": Int8Linear, "fp8": Fp8Linear}
_QUANTIZED_LM_HEAD = ("int8",)
logger = logging.getLogger(__name__)


def quantized_linear(linear_weight: torch.Tensor, bias: torch.Tensor | None, method: str) -> nn.Module:
    if method not in _LAYERS:
        raise ValueError(f"unknown quantization {method!r}; supported: {', '.join(METHODS)}")
    return _LAYERS[method].from_float(linear_weight.detach(), None if bias is None else bias.detach())


def quantize_model(model: nn.Module, method: str) -> nn.Module:
    """Replace the model's nn.Linear modules (in place) by `method`'s quantized layers; returns model.

    fp8 leaves the lm_head in the model's dtype, as FP8 checkpoints do (e4m3's 3 mantissa bits move
    logits by a few percent: top-1 flips where the top two are close); int8 quantizes it too: on CPU
    a small model's lm_head is its largest GEMM (smollm2-135m: 28M of 135M weights). An fp8 model gets
    `step_kinds`, which its layers read to route decode and prompt tokens (token_kinds.py)."""
    is_split = getattr(model, "tp", None) is not None  # a tensor-parallel rank: its lm_head stays float
    has_quantized_head = method in _QUANTIZED_LM_HEAD and not is_split
    targets = [(name, mod) for name, mod in model.named_modules()
               if isinstance(mod, nn.Linear) and (name != "lm_head" or has_quantized_head)]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, wrapped(linear, quantized_linear(linear.weight, rank_bias(linear), method)))
    if method == "fp8":  # its layers route decode and prompt tokens by what the runner says of a step
        model.step_kinds = StepKinds()
        for layer in model.modules():
            if isinstance(layer, Fp8Linear):
                layer.step_kinds = model.step_kinds
    # after the step kinds: an expert's rows are its routed pairs, not the step's tokens in order, so its fp8
    # layers take every row as a prompt row
    quantize_model_experts(model, _LAYERS[method])
    is_tied = getattr(model, "lm_head", "absent") is None and getattr(model, "has_lm_head", True)
    if has_quantized_head and is_tied:  # logits through a quantized copy of the table
        model.lm_head = quantized_linear(model.model.embed_tokens.weight, None, method)
    if any(getattr(m, "panels", None) is not None for m in model.modules() if isinstance(m, Int8Linear)):
        logger.info("int8: oneDNN has no VNNI on this CPU, and its int8 GEMM is inexact without it: the int8 "
                    "layers run llmserve's exact AVX2 kernel (csrc/int8_linear_avx2.cpp)")
    return model


def check_supported(quantization: str | None, kv_cache_dtype: str, device: torch.device,
                    dtype: torch.dtype, head_dim: int | None = None) -> None:
    """Start-up check of --quantization / --kv-cache-dtype against the device, dtype and (when given) the
    model's head_dim: a combination that would not run fails here, naming the flag (ValueError)."""
    if quantization == "fp8" and device.type == "cuda":
        _check_fp8_on_cuda(device, dtype)
    _check_kv_cache_dtype(kv_cache_dtype, device, dtype)
    if kv_cache_dtype == "int8":
        _check_int8_kv_cache(device, dtype, head_dim)


def _check_fp8_on_cuda(device: torch.device, dtype: torch.dtype) -> None:
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(f"--quantization fp8: needs a GPU of compute capability >= 8.9 (Ada, Hopper); "
                         f"this one is {major}.{minor}: use --quantization int8")
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"--quantization fp8: on CUDA the model dtype must be bfloat16 or float16 "
                         f"(row-wise scaled FP8 GEMMs write 16-bit outputs), got {dtype}")


def _check_kv_cache_dtype(kv_cache_dtype: str, device: torch.device, dtype: torch.dtype) -> None:
    is_cuda = device.type == "cuda"
    if kv_cache_dtype == "fp8" and is_cuda and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError("--kv-cache-dtype fp8: needs a GPU of compute capability >= 8.9 (Ada, Hopper)")
    if kv_cache_dtype == "fp16" and (is_cuda or dtype != torch.float32):
        name = str(dtype).removeprefix("torch.")
        raise ValueError(f"--kv-cache-dtype fp16: supported for float32 models on CPU only (the CPU attention "
                         f"kernel reads it); this engine runs {name} on {device.type}: use auto"
                         + (" or fp8" if is_cuda else ""))


def _check_int8_kv_cache(device: torch.device, dtype: torch.dtype, head_dim: int | None) -> None:
    """--kv-cache-dtype int8 runs where the CPU kernels' attention reads it: float32 on CPU, AVX2 build."""
    runs = f"{str(dtype).removeprefix('torch.')} on {device.type}"
    if device.type == "cuda":
        reason, instead = runs, "auto or fp8"
    elif dtype != torch.float32:
        reason, instead = runs, "auto"
    elif not cpu_kernels.has_avx2_kernels():
        reason, instead = runs + " without them", "auto or fp16"
    else:
        if head_dim is not None and head_dim % 8:
            raise ValueError(f"--kv-cache-dtype int8: the CPU kernel reads it for head_dim a multiple of 8; this "
                             f"model's is {head_dim}: use auto or fp16")
        return
    raise ValueError(f"--kv-cache-dtype int8: supported for float32 models on CPU with llmserve's AVX2 kernels "
                     f"built (only their attention reads it); this engine runs {reason}: use {instead}")


def kv_cache_torch_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's storage dtype for --kv-cache-dtype (auto: the model's dtype)."""
    return {"fp8": FP8_DTYPE, "fp16": torch.float16, "int8": torch.int8}.get(kv_cache_dtype, dtype)
