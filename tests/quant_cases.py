"""Shared by the quantization tests: a random checkpoint whose logits are peaked."""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file, save_file

from llmserve.model.maker import Shape, write_checkpoint

# Peaked logits: the lm_head's rows scaled by 3 * lognormal(0, 1), so that the top token usually leads the
# second by several logit standard deviations (plain random weights leave near-ties everywhere). The
# decoder layers at std 0.02, transformers' default initializer_range: at 0.05 the random network amplifies
# FP8's rounding (top-1 agreement 0.932 there, 0.965 at 0.02; int8 0.968 and 0.985).
PEAKED = Shape(128, 2, 4, 2, 256, 512, 2048, init_std=0.02)


def write_peaked(path: str) -> str:
    """PEAKED's checkpoint with the lm_head rescaled (seeded: the same files every time)."""
    write_checkpoint("llama", PEAKED, path, seed=5)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    row_scale = torch.exp(torch.randn(PEAKED.vocab_size, 1, generator=torch.Generator().manual_seed(0)))
    tensors["lm_head.weight"] *= 3 * row_scale
    save_file(tensors, file, metadata={"format": "pt"})
    return path
