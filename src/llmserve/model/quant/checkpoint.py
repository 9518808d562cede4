"""Checkpoints already quantized to FP8, as Hugging Face and llm-compressor write them.

Two formats are read (config.json's `quantization_config`):
- transformers' fine-grained FP8 (`quant_method: fp8`, DeepSeek-V3 style): each Linear `weight` is
  float8_e4m3fn [N, K] with `weight_scale_inv` float32 [ceil(N/bn), ceil(K/bk)] for blocks
  `weight_block_size` [bn, bk] (w = fp8 * scale_inv); without a block size, one scale per tensor.
- compressed-tensors (`quant_method: compressed-tensors`, `format: float-quantized`): `weight`
  float8_e4m3fn with `weight_scale` [N, 1] (strategy channel) or [1] (tensor); a static `input_scale`
  is ignored (activations are quantized per token at run time).

Loading dequantizes each weight as it streams in (model/loader.py); `--quantization fp8` then
requantizes per output channel, which gives back the checkpoint's FP8 values exactly when its scales
were per channel (block scales become per-channel ones: a small extra rounding). `write_fp8_checkpoint`
turns a float checkpoint into either format (`llmserve make-model --quantization fp8|fp8-channel`).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Iterator

import torch

from llmserve.model.quant.linear import FP8_DTYPE, quantize_fp8

SUPPORTED = ("fp8 (transformers FineGrainedFP8: weight_scale_inv, block or tensor scales)",
             "compressed-tensors (float8 weights, per-channel or per-tensor weight_scale)")
FORMATS = ("fp8", "fp8-channel")  # what write_fp8_checkpoint writes: fine-grained blocks | compressed-tensors
BLOCK = (128, 128)
_IGNORED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale")


def _unsupported(detail: str) -> ValueError:
    return ValueError(f"{detail}; llmserve loads these quantized checkpoints: {'; '.join(SUPPORTED)}")


def _check_compressed_tensors(qc: dict) -> None:
    if qc.get("format") not in ("float-quantized", "naive-quantized"):
        raise _unsupported(f"compressed-tensors format {qc.get('format')!r} is not supported")
    for name, group in (qc.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise _unsupported(f"compressed-tensors group {name!r} quantizes weights to "
                               f"{weights.get('type')}{weights.get('num_bits')}, not float8")
        if weights.get("strategy") not in ("channel", "tensor"):
            raise _unsupported(f"compressed-tensors weight strategy {weights.get('strategy')!r} is not supported")


def checkpoint_method(hf_config) -> str | None:
    """'fp8' for a supported FP8 checkpoint, None for an unquantized one (or gpt-oss's MXFP4, which loads as
    float weights); ValueError for any other."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise _unsupported(f"fp8 activation_scheme {qc.get('activation_scheme')!r} (only dynamic)")
        return "fp8"
    if method == "compressed-tensors":
        _check_compressed_tensors(qc)
        return "fp8"
    if method == "mxfp4":  # gpt-oss's experts, dequantized as they stream in (quant/mxfp4.py): float weights
        return None
    raise _unsupported(f"quantization_config.quant_method {method!r} is not supported")


def weight_block_size(hf_config) -> tuple[int, int]:
    """The [bn, bk] of a fine-grained FP8 checkpoint's block scales (transformers' default 128x128)."""
    qc = getattr(hf_config, "quantization_config", None) or {}
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    return tuple(qc.get("weight_block_size") or BLOCK)


def block_dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """float8 [N, K] times its scales -> float32 [N, K]. scale: one per tensor ([] or [1]), per output
    channel ([N, 1]) or per block [ceil(N / bn), ceil(K / bk)]."""
    w, scale = weight.float(), scale.float()
    if scale.numel() == 1:
        return w * scale.reshape(())
    if scale.dim() == 2 and scale.shape == (w.shape[0], 1):
        return w * scale
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return w * full[: w.shape[0], : w.shape[1]]


def dequantize_weights(weights: Iterable[tuple[str, torch.Tensor]],
                       block: tuple[int, int] = BLOCK) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors of an FP8 checkpoint -> float32 weights under their plain names (block: the
    checkpoint's weight_block_size).

    A weight and its scale may come in either order (and from different shards): each waits for the other.
    """
    pending_weights: dict[str, torch.Tensor] = {}
    pending_scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        for suffix in (".weight_scale_inv", ".weight_scale"):
            if name.endswith(suffix):
                base = name.removesuffix(suffix) + ".weight"
                if base in pending_weights:
                    yield base, block_dequantize(pending_weights.pop(base), tensor, block)
                else:
                    pending_scales[base] = tensor
                break
        else:
            if tensor.dtype != FP8_DTYPE:
                yield name, tensor
                continue
            _check_linear_weight(name, tensor)
            if name in pending_scales:
                yield name, block_dequantize(tensor, pending_scales.pop(name), block)
            else:
                pending_weights[name] = tensor
    if pending_weights:
        raise ValueError(f"FP8 checkpoint: {len(pending_weights)} float8 tensors have no weight_scale(_inv), "
                         f"e.g. {sorted(pending_weights)[:3]}")
    if pending_scales:
        raise ValueError(f"FP8 checkpoint: scales without a weight, e.g. {sorted(pending_scales)[:3]}")


def _check_linear_weight(name: str, tensor: torch.Tensor) -> None:
    """A float8 tensor must be one Linear's [N, K] weight: stacked experts ([E, N, K] under `experts.`, as
    transformers' fused MoE modules save them) have no per-tensor scale layout this reader knows."""
    if tensor.dim() != 2:
        raise _unsupported(f"FP8 checkpoint (quantization_config): tensor {name!r} is float8 with shape "
                           f"{tuple(tensor.shape)}, not a 2-D Linear weight (stacked experts are read unquantized, "
                           "or quantized one tensor per expert: experts.N.gate_proj.weight)")


def _is_linear_weight(name: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and name.endswith("proj.weight") or name == "lm_head.weight"


def _quantize_block(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (float8 [N, K], scale_inv [ceil(N/128), ceil(K/128)]): one scale per 128x128 block."""
    n, k = weight.shape
    bn, bk = BLOCK
    padded = torch.nn.functional.pad(weight.float(), (0, -k % bk, 0, -n % bn))
    blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / torch.finfo(FP8_DTYPE).max).clamp(min=1e-12)  # [nb, kb]
    q = block_dequantize(weight.float(), 1.0 / scale, BLOCK)  # weight / scale, block by block
    return q.clamp(-448, 448).to(FP8_DTYPE), scale


def quantize_tensors(tensors: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    """A float state dict -> the same with every Linear weight in FP8 plus its scale tensor."""
    out = {}
    for name, tensor in tensors.items():
        if not _is_linear_weight(name, tensor):
            out[name] = tensor
        elif fmt == "fp8":
            out[name], out[name + "_scale_inv"] = _quantize_block(tensor)
        else:
            out[name], scale = quantize_fp8(tensor)
            out[name + "_scale"] = scale.reshape(-1, 1)
    return out


def quantization_config(fmt: str) -> dict:
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
    scheme = {"weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                          "dynamic": False},
              "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                    "dynamic": True},
              "targets": ["Linear"]}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": scheme}, "ignore": []}


def write_fp8_checkpoint(path: str, fmt: str) -> None:
    """Quantize a float checkpoint directory in place: its safetensors and config.json."""
    from safetensors.torch import load_file, save_file
    if fmt not in FORMATS:
        raise ValueError(f"unknown FP8 format {fmt!r}; choose one of {', '.join(FORMATS)}")
    weight_map = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        tensors = quantize_tensors(load_file(file), fmt)
        save_file(tensors, file, metadata={"format": "pt"})
        weight_map.update({n: os.path.basename(file) for n in tensors})
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            data = json.load(f)
        data["weight_map"] = weight_map
        with open(index, "w") as f:
            json.dump(data, f, indent=2)
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config(fmt)
    with open(config_file, "w") as f:
        json.dump(config, f, indent=2)
