"""Quantized layers of a tensor-parallel rank (model/parallel.py's split).

A column-parallel slice is a smaller linear layer: it is quantized as one (each output channel's scale over its
whole row). A row-parallel slice holds every output channel over the rank's share of the inputs: its
quantized layer's scales are per channel over that share, each rank quantizes its share of a token's
activations with its own scale, and the partial outputs are summed by the all-reduce, with the bias added on
rank 0 only, as `RowParallelLinear` does. The lm_head of a rank stays in float: its logits are gathered from the
ranks' vocabulary rows (`CausalLM._head_logits`), and the int8 head of a single rank (quant/__init__.py) is
not split yet.

An FP8 checkpoint's weight comes with block scales (128 x 128 blocks, or one a tensor) that a rank's slice of
heads or features does not cut along: a rank reads the weight and its scales whole, dequantizes them, and
keeps its slice of the float weight (`rank_slices`); with --quantization fp8 it is then requantized per
channel of the slice, as one rank requantizes the whole weight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from llmserve.model.parallel import RowParallelLinear, TensorParallel


class RowParallelQuantized(nn.Module):
    """A quantized row-parallel slice: x [T, in / N] -> its partial [T, out], summed over the ranks."""

    def __init__(self, layer: nn.Module, tp: TensorParallel):
        super().__init__()
        self.layer = layer  # Int8Linear | Fp8Linear over the rank's inputs; its bias on rank 0 only
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in / N] -> [T, out]: this rank's share of the sum, before the all-reduce (a LoRA adds its own
        share to it first, as to a float RowParallelLinear's: model/lora_layers.py)."""
        return self.layer(x)


def rank_bias(linear: nn.Linear) -> torch.Tensor | None:
    """The bias a rank's quantized slice adds: a row-parallel one's on rank 0 only (the all-reduce would add
    it once a rank), a column-parallel or whole layer's always."""
    if isinstance(linear, RowParallelLinear) and linear.tp.rank != 0:
        return None
    return linear.bias


def wrapped(linear: nn.Linear, quantized: nn.Module) -> nn.Module:
    """The quantized layer in `linear`'s place: with the all-reduce where `linear` is row-parallel."""
    return RowParallelQuantized(quantized, linear.tp) if isinstance(linear, RowParallelLinear) else quantized


def rank_slices(weights: Iterable[tuple[str, torch.Tensor]],
                slice_of: Callable[[str], tuple[int, int, int] | None]) -> Iterator[tuple[str, torch.Tensor]]:
    """Whole (dequantized) checkpoint tensors -> the rank's slices: slice_of(name) -> (dim, start, length), None
    for a tensor the rank holds whole (model/parallel.py's shard_of)."""
    for name, tensor in weights:
        spec = slice_of(name)
        yield name, tensor if spec is None else tensor.narrow(spec[0], spec[1], spec[2])
