"""Float32 experts on CPU laid out for the dense layers' kernels: each expert's gate/up and down matrices become
a packed `Linear` (model/linear.py: our AVX2/AVX-512 panels, or oneDNN's blocked layout, whichever the dense
layers take), in place of slices of the stacked tensors, which F.linear hands to MKL at a few rows an expert.

`PackedExperts` takes the place of a block's stacked `Experts` once the model is loaded; moe.fused_moe calls
expert e's layers as it calls quantized experts' (model/quant/experts.py). Each layer holds its expert's bias
(gpt-oss); on a tensor-parallel rank other than 0 the down bias is left out, as the block's `rank_biases` says.
Why: docs/benchmarks.md, "MoE on CPU".

Where the layers are our kernels' panels (not oneDNN's layout) the experts' panels are stacked once, each layer
keeping a view, and a layer's experts run in one C++ op (csrc/moe_experts.cpp, `run_in_one_op`): the same sums
in the same order as the per-expert calls, without a Python loop over experts; gpt-oss's clamped activation
keeps the loop. Why: docs/benchmarks.md, "MoE experts in one op a layer".
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.model import cpu_kernels
from llmserve.model.linear import Linear, can_pack
from llmserve.model.moe import ClampedSwiglu, ExpertLayers, Experts, SparseMoeBlock, expert_row, sort_pairs


class PackedExperts(ExpertLayers):
    """E experts, each a packed float32 gate_up [2I, H] and down [H, I] `Linear` (with its bias, if any); their
    panels stacked where `stack_panels` can (`gate_up_panels` [E, 2I/16, H, 16], `down_panels` [E, H/16, I, 16],
    None otherwise)."""

    def __init__(self, gate_up_proj: nn.ModuleList, down_proj: nn.ModuleList):
        super().__init__(gate_up_proj, down_proj)
        self.register_buffer("gate_up_panels", stack_panels(gate_up_proj), persistent=False)
        self.register_buffer("down_panels", stack_panels(down_proj), persistent=False)
        self.register_buffer("gate_up_bias", _stack_biases(gate_up_proj), persistent=False)  # [E, 2I] or None
        self.register_buffer("down_bias", _stack_biases(down_proj), persistent=False)  # [E, H] or None

    def runs_in_one_op(self, x: torch.Tensor, activation: ClampedSwiglu | None) -> bool:
        """Stacked panels, float32 x on CPU outside autograd, silu(gate) * up, I a multiple of 16."""
        return (self.gate_up_panels is not None and self.down_panels is not None and activation is None
                and self.down_panels.shape[2] % 16 == 0 and x.device.type == "cpu" and x.dtype == torch.float32
                and not torch.is_grad_enabled())

    def run_in_one_op(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], routing weights/ids [T, k] -> [T, H]: every expert in one op (csrc/moe_experts.cpp), then
        each token's k weighted outputs summed in k order, as fused_moe does."""
        num_tokens, top_k = ids.shape
        counts, order = sort_pairs(ids, len(self.gate_up_proj))
        rows = x.index_select(0, order // top_k)  # [P, H]
        is_whole = len(order) == ids.numel()  # else other ranks' pairs stay zero
        weighted = (x.new_empty if is_whole else x.new_zeros)(num_tokens * top_k, x.shape[1])  # [T*k, H]
        cpu_kernels.moe_experts(weighted, rows.contiguous(), torch.tensor(counts, dtype=torch.int64), order,
                                weights.reshape(-1).float().contiguous(), self.gate_up_panels, self.down_panels,
                                (self.gate_up_bias, self.down_bias))
        return weighted.view(num_tokens, top_k, -1).sum(dim=1)


def stack_panels(layers: nn.ModuleList) -> torch.Tensor | None:
    """The layers' panels ([P, K, 16] each) stacked [E, P, K, 16], each layer's `packed_weight` then a view of its
    slice (no second copy); None where a layer is not packed for our kernel (oneDNN's layout, or not packed)."""
    panels = [layer.packed_weight for layer in layers]
    if any(p is None or p.dim() != 3 for p in panels) or not cpu_kernels.has_avx2_kernels():
        return None
    stacked = torch.stack(panels)
    for layer, view in zip(layers, stacked):
        layer.packed_weight = view
    return stacked


def _stack_biases(layers: nn.ModuleList) -> torch.Tensor | None:
    """The layers' biases [E, out], None when they have none."""
    if layers[0].bias is None:
        return None
    return torch.stack([layer.bias.detach() for layer in layers]).contiguous()


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
