"""Float32 experts on CPU laid out for the dense layers' kernels: each expert's gate/up and down matrices become
a packed `Linear` (model/linear.py: our AVX2/AVX-512 panels, or oneDNN's blocked layout, whichever the dense
layers take), in place of slices of the stacked tensors, which F.linear hands to MKL at a few rows an expert.

`PackedExperts` takes the place of a block's stacked `Experts` once the model is loaded; moe.fused_moe calls
expert e's layers as it calls quantized experts' (model/quant/experts.py). Each layer holds its expert's bias
(gpt-oss); on a tensor-parallel rank other than 0 the down bias is left out, as the block's `rank_biases` says.
Why: docs/benchmarks.md, "MoE on CPU".
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.model.linear import Linear, can_pack
from llmserve.model.moe import ExpertLayers, Experts, SparseMoeBlock, expert_row


class PackedExperts(ExpertLayers):
    """E experts, each a packed float32 gate_up [2I, H] and down [H, I] `Linear` (with its bias, if any)."""


def can_pack_experts(block: SparseMoeBlock) -> bool:
    """Whether the block's experts are stacked float32 CPU tensors that the dense layers' packing takes."""
    experts = block.experts
    return isinstance(experts, Experts) and can_pack(experts.gate_up_proj[0])


def pack_experts(block: SparseMoeBlock) -> PackedExperts:
    """The block's stacked experts -> one packed `Linear` per expert and matrix (the stacked tensors are freed
    once the block drops them: each layer keeps only its packed copy)."""
    gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()  # [E, 2I, H], [E, H, I]
    gate_up_bias, down_bias = block.rank_biases() or (None, None)
    experts = range(len(gate_up))
    return PackedExperts(nn.ModuleList(_packed_layer(gate_up[e], expert_row(gate_up_bias, e)) for e in experts),
                         nn.ModuleList(_packed_layer(down[e], expert_row(down_bias, e)) for e in experts))


def _packed_layer(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """weight [out, in], bias [out] or None -> a `Linear` holding them, packed where `can_pack` allows."""
    with torch.device("meta"):
        layer = Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    layer.pack()
    return layer


def pack_model_experts(model: nn.Module) -> int:
    """Pack the stacked float32 experts of every MoE block of a loaded CPU model in place (`can_pack_experts`);
    returns how many blocks."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock) and can_pack_experts(m)]
    for block in blocks:
        block.experts = pack_experts(block)
    return len(blocks)
