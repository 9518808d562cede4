"""Draft checkpoints derived from a target, for speculative decoding tests and benchmarks.

Random weights make a separately made small model useless as a draft (its predictions are unrelated
to the target's). A draft derived from the target keeps the target's first layers (self-speculation by
layer skipping: cheaper) and adds relative Gaussian noise to every weight (controls the acceptance
rate); the tokenizer files are copied, so target and draft share the vocabulary.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def derive_draft(target_dir: str, out_dir: str, num_layers: int | None = None, noise: float = 0.0,
                 seed: int = 0) -> str:
    """Write a draft of `target_dir` into `out_dir`: its first `num_layers` layers (all if None), each
    weight plus noise * std(weight) * N(0, 1). Returns out_dir."""
    from safetensors.torch import load_file, save_file

    with open(os.path.join(target_dir, "config.json")) as f:
        config = json.load(f)
    total = config["num_hidden_layers"]
    num_layers = total if num_layers is None else num_layers
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be in 1..{total}, got {num_layers}")
    if noise < 0:
        raise ValueError(f"noise must be >= 0, got {noise}")
    os.makedirs(out_dir, exist_ok=True)
    _copy_side_files(target_dir, out_dir)
    config["num_hidden_layers"] = num_layers
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:num_layers]
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, tensor in _load_all(target_dir, load_file).items():
        match = _LAYER.match(name)
        if match and int(match.group(1)) >= num_layers:
            continue
        tensors[name] = _perturb(tensor, noise, gen)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _copy_side_files(target_dir: str, out_dir: str) -> None:
    for name in os.listdir(target_dir):
        path = os.path.join(target_dir, name)
        if os.path.isfile(path) and name != "config.json" and name not in _WEIGHT_FILES \
                and not name.endswith(".safetensors"):
            shutil.copy(path, os.path.join(out_dir, name))


def _load_all(target_dir: str, load_file) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(target_dir)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(target_dir, name)))
    return tensors


def _perturb(tensor: torch.Tensor, noise: float, gen: torch.Generator) -> torch.Tensor:
    if noise == 0.0 or not tensor.is_floating_point():
        return tensor
    weight = tensor.float()
    scale = weight.std() if weight.numel() > 1 else weight.abs().mean()
    noisy = weight + noise * scale * torch.randn(weight.shape, generator=gen)
    return noisy.to(tensor.dtype).contiguous()
