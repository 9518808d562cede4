"""Quantized experts of a Mixture-of-Experts layer: each expert's gate/up and down matrices as a quantized
linear layer of the dense layers' kind (model/quant/linear.py: weights per output channel, so one scale per
expert and channel; activations per token at run time).

`QuantizedExperts` takes the place of the block's stacked `Experts`; the block's loop over the experts that
received tokens (moe.fused_moe) calls expert e's layers in place of slicing the stacked tensors. Each layer
holds its expert's bias (gpt-oss). The grouped-GEMM path (CUDA graphs) runs stacked float tensors only, so a
quantized MoE model runs the loop.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.model.moe import ExpertLayers, Experts, SparseMoeBlock, expert_row


class QuantizedExperts(ExpertLayers):
    """E experts, each a quantized gate_up [2I, H] and down [H, I] layer (with its bias, if any)."""


def quantize_experts(experts: Experts, layer_type: type[nn.Module],
                     biases: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> QuantizedExperts:
    """A block's stacked float experts -> one `layer_type` (Int8Linear | Fp8Linear) per expert and matrix; biases:
    the block's `rank_biases` (a tensor-parallel rank after the first leaves the down bias to rank 0)."""
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()  # [E, 2I, H], [E, H, I]
    gate_up_bias, down_bias = (None, None) if biases is None else biases
    gate_up_bias = None if gate_up_bias is None else gate_up_bias.detach()
    down_bias = None if down_bias is None else down_bias.detach()
    return QuantizedExperts(
        nn.ModuleList(layer_type.from_float(gate_up[e], expert_row(gate_up_bias, e)) for e in range(gate_up.shape[0])),
        nn.ModuleList(layer_type.from_float(down[e], expert_row(down_bias, e)) for e in range(down.shape[0])))


def quantize_model_experts(model: nn.Module, layer_type: type[nn.Module]) -> int:
    """Quantize the stacked experts of every MoE block of a model in place; returns how many blocks."""
    blocks = [module for module in model.modules() if isinstance(module, SparseMoeBlock)
              and isinstance(module.experts, Experts)]
    for block in blocks:
        block.experts = quantize_experts(block.experts, layer_type, block.rank_biases())
    return len(blocks)
