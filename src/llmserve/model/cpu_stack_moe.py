"""Mixture-of-Experts layers inside the C++ decoder stack (model/cpu_decode_stack.py, csrc/moe_layer.cpp).

Where every layer of an MoE model is a block the C++ layer takes, each block's router, routing, experts and combine
go into the stack (`add_moe_layers`) and a decode step is one C++ call, as a dense model's. It takes float32 blocks
of softmax top-k routing (Qwen3-MoE, with or without norm_topk_prob; Mixtral) whose experts run in one op
(model/moe_cpu.py: our kernels' panels stacked, each expert's width a multiple of 16), on one rank, without biases,
clamped activations (gpt-oss) or shared experts (DeepSeek). A model with any other layer (a dense MLP in
mlp_only_layers or between sparse steps, oneDNN-laid-out or quantized experts, a bfloat16 model) keeps its MLPs in
Python between the stack's attention halves; `decline_reason` says why. The layer adds its tokens per expert to the
block's `ExpertLoad` counts, which the engine reads as for the Python blocks.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.model.moe import SparseMoeBlock
from llmserve.model.moe_cpu import PackedExperts


def decline_reason(layers: nn.ModuleList, has_panels: bool) -> str | None:
    """Why the stack (of float32 panels where has_panels) cannot take these layers' MLPs as its MoE layers (the first
    layer it cannot take), or None when it takes them all."""
    if not has_panels:
        return "not a float32 model (the C++ MoE layer runs float32 panels)"
    for index, layer in enumerate(layers):
        if (reason := block_decline_reason(layer.mlp)) is not None:
            return f"layer {index}: {reason}"
    return None


def block_decline_reason(block: nn.Module) -> str | None:
    """Why the C++ MoE layer cannot run this MLP, None when it can."""
    if type(block) is not SparseMoeBlock:
        return f"a {type(block).__name__}, not an MoE block (a dense layer: mlp_only_layers, decoder_sparse_step)"
    spec = block.spec
    if spec.is_grouped or spec.has_bias or spec.activation is not None or block.shared_experts is not None:
        return "routing, biases, activation or shared experts other than softmax top-k, silu(gate) * up"
    if block.tp is not None or block.held_experts is not None:
        return "tensor or expert parallel"
    experts = block.experts
    if type(experts) is not PackedExperts or experts.gate_up_panels is None or experts.down_panels is None:
        return "experts not stacked in our kernels' panels (oneDNN's layout, quantized, or not packed)"
    if experts.down_panels.shape[2] % 16:
        return "an expert's width is not a multiple of 16"
    if block.gate.weight.dtype != torch.float32 or block.gate.bias is not None:
        return "the router is not a float32 linear without bias"
    return None


def add_moe_layers(stack, layers: nn.ModuleList) -> None:
    """Each layer's MoE block into `stack` (torch.classes.llmserve_cpu.DecodeStack built without the MLPs, its
    layers' attention halves added), once `decline_reason` said it takes them all."""
    for index, layer in enumerate(layers):
        block = layer.mlp
        load = block.load.counts_on(torch.device("cpu"))
        stack.add_moe(index, block.gate.weight.detach(), block.experts.gate_up_panels, block.experts.down_panels,
                      block.spec.top_k, block.spec.is_renormalized, load)
