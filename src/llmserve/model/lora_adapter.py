"""PEFT LoRA adapters read from disk (adapter_config.json + adapter_model.safetensors) and checked against
the base model: which projections they touch, their rank, and the scale folded into B.

An adapter adds (alpha / r) * B @ A (rsLoRA: alpha / sqrt(r)) to a projection's weight; A is [r, in],
B [out, r]. Modules are the base model's unfused names (q_proj ... down_proj); model/lora_layers.py places
them in our fused qkv_proj and gate_up_proj. Anything an adapter carries that we would not apply (biases,
DoRA, modules_to_save, embeddings, per-module rank patterns) is refused, naming it.

`check_adapter` needs no torch (the safetensors header is JSON): the HTTP front checks an adapter with it
before any request can name it; `read_adapter` (the worker) checks the same and reads the tensors.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_REFUSED_WHEN_SET = ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform", "use_dora",
                     "fan_in_fan_out", "layer_replication", "trainable_token_indices", "lora_bias", "use_qalora",
                     "alora_invocation_tokens", "target_parameters")


@dataclass(frozen=True)
class BaseShapes:
    """What an adapter must match: the decoder's layer count and each module's (in, out) features."""

    num_layers: int
    features: dict[str, tuple[int, int]]  # module name -> (in, out)


def base_shapes(config) -> BaseShapes:
    """The base model's projection shapes from its HF config, an object or config.json's dict (one rank: no
    tensor parallelism)."""
    get = config.get if isinstance(config, dict) else lambda name: getattr(config, name, None)
    hidden, inter, num_heads = get("hidden_size"), get("intermediate_size"), get("num_attention_heads")
    head_dim = get("head_dim") or hidden // num_heads
    q_size, kv_size = num_heads * head_dim, (get("num_key_value_heads") or num_heads) * head_dim
    features = {"q_proj": (hidden, q_size), "k_proj": (hidden, kv_size), "v_proj": (hidden, kv_size),
                "o_proj": (q_size, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
                "down_proj": (inter, hidden)}
    return BaseShapes(get("num_hidden_layers"), features)


@dataclass(frozen=True)
class LoRAWeights:
    """One adapter on the host: per (layer, module) A [r, in] and B [out, r] with its scale folded in."""

    rank: int
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


class AdapterError(ValueError):
    """An adapter that cannot be served (the message names the adapter and the problem)."""


def read_adapter_config(path: str, max_rank: int) -> dict:
    """adapter_config.json, checked: a LoRA of rank 1..max_rank over supported modules, nothing refused set."""
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise AdapterError(f"LoRA adapter {path!r}: no {CONFIG_FILE} (a PEFT adapter directory is expected)")
    with open(config_path) as f:
        config = json.load(f)
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"LoRA adapter {path!r}: peft_type {config['peft_type']!r} is not LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise AdapterError(f"LoRA adapter {path!r}: rank r={rank!r} is over --max-lora-rank {max_rank}"
                           if isinstance(rank, int) and rank > max_rank else
                           f"LoRA adapter {path!r}: rank r={rank!r} must be an integer >= 1")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"LoRA adapter {path!r}: bias={config['bias']!r} is not supported (only 'none')")
    for key in _REFUSED_WHEN_SET:
        if config.get(key):
            raise AdapterError(f"LoRA adapter {path!r}: {key}={config[key]!r} is not supported")
    _check_targets(path, config.get("target_modules"))
    return config


def _check_targets(path: str, targets) -> None:
    names = [targets] if isinstance(targets, str) else list(targets or [])
    unknown = [name for name in names if name not in SUPPORTED_MODULES]
    if not names or unknown:
        raise AdapterError(f"LoRA adapter {path!r}: target_modules {unknown or names!r} not supported; "
                           f"supported: {', '.join(SUPPORTED_MODULES)} (listed by name)")


def adapter_scale(config: dict) -> float:
    """alpha / r, or alpha / sqrt(r) with use_rslora (PEFT's scaling; alpha defaults to 8 as PEFT's)."""
    rank, alpha = config["r"], config.get("lora_alpha", 8)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def tensor_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """adapter_model.safetensors' tensor names and shapes, from its JSON header (no tensor is read)."""
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        raise AdapterError(f"LoRA adapter {path!r}: no {WEIGHTS_FILE}")
    try:
        with open(weights_path, "rb") as f:
            (header_size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_size))
    except (OSError, ValueError, struct.error) as e:
        raise AdapterError(f"LoRA adapter {path!r}: cannot read {WEIGHTS_FILE}: {e}") from None
    return {key: tuple(entry["shape"]) for key, entry in header.items() if key != "__metadata__"}


def check_adapter(path: str, shapes: BaseShapes | None, max_rank: int) -> dict:
    """The adapter's config, once its config and its tensors' names and shapes fit the base (`shapes`; None:
    unknown, only the config and names are checked); AdapterError names what does not."""
    config = read_adapter_config(path, max_rank)
    halves: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    for key, shape in tensor_shapes(path).items():
        layer, module, half = _parse_key(path, key, shapes)
        halves.setdefault((layer, module), {})[half] = shape
    if not halves:
        raise AdapterError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} holds no LoRA weights")
    for where, pair in halves.items():
        _check_pair(path, where, pair, config["r"], shapes)
    return config


def read_adapter(path: str, shapes: BaseShapes, max_rank: int, dtype: torch.dtype | None = None) -> LoRAWeights:
    """The adapter at `path` as LoRAWeights (B scaled), in `dtype` (default float32), once `check_adapter`
    passes."""
    import torch
    from safetensors.torch import load_file

    config = check_adapter(path, shapes, max_rank)
    dtype = dtype or torch.float32
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(os.path.join(path, WEIGHTS_FILE)).items():
        layer, module, half = _parse_key(path, key, shapes)
        halves.setdefault((layer, module), {})[half] = tensor
    scale = adapter_scale(config)
    modules = {where: (pair["A"].to(dtype).contiguous(), (pair["B"].float() * scale).to(dtype).contiguous())
               for where, pair in halves.items()}
    return LoRAWeights(config["r"], modules)


def _parse_key(path: str, key: str, shapes: BaseShapes | None) -> tuple[int, str, str]:
    match = _KEY.match(key)
    if match is None:
        raise AdapterError(f"LoRA adapter {path!r}: tensor {key!r} is not a LoRA A/B weight of a decoder "
                           f"projection ({', '.join(SUPPORTED_MODULES)})")
    layer, module, half = int(match[1]), match[2], match[3]
    if module not in SUPPORTED_MODULES:
        raise AdapterError(f"LoRA adapter {path!r}: tensor {key!r} targets module {module!r}, not supported")
    if shapes is not None and layer >= shapes.num_layers:
        raise AdapterError(f"LoRA adapter {path!r}: tensor {key!r} is for layer {layer}; the base model has "
                           f"{shapes.num_layers}")
    return layer, module, half


def _check_pair(path: str, where: tuple[int, str], pair: dict[str, tuple[int, ...]], rank: int,
                shapes: BaseShapes | None) -> None:
    layer, module = where
    if set(pair) != {"A", "B"}:
        raise AdapterError(f"LoRA adapter {path!r}: layer {layer} {module} has lora_{''.join(pair)} but not both "
                           "lora_A and lora_B")
    a, b = pair["A"], pair["B"]
    in_features, out_features = shapes.features[module] if shapes is not None else (a[-1], b[0])
    if tuple(a) != (rank, in_features) or tuple(b) != (out_features, rank):
        raise AdapterError(f"LoRA adapter {path!r}: layer {layer} {module} has lora_A {tuple(a)} and lora_B "
                           f"{tuple(b)}; the base model (rank {rank}) needs {(rank, in_features)} and "
                           f"{(out_features, rank)}")
