"""Mixture-of-Experts feed-forward: a router picks top-k experts per token, each expert is a gated MLP.

`SparseMoeBlock` holds the router (`gate.weight` [E, H]) and the experts stacked as two tensors,
`experts.gate_up_proj` [E, 2I, H] (gate rows first, then up) and `experts.down_proj` [E, H, I]: the names and
layout of transformers' in-memory modules. Checkpoints that store one tensor per expert (what save_pretrained
writes: `experts.3.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.3.w1.weight`) are stacked at load
(model/moe_names.py says where each goes).

The forward (`fused_moe`) sorts the token-expert pairs by expert once, runs one gate/up and one down GEMM per
expert that received tokens, and sums each token's k outputs weighted by its routing weights: no Python loop
over tokens, at most E GEMM pairs per layer. Experts that can run a layer in one op take it instead
(`ExpertLayers.runs_in_one_op`: float32 experts packed on CPU, model/moe_cpu.py), with the same sums.

Routing is batch-invariant: a token's experts and weights depend only on its own hidden state (`route`).

gpt-oss's experts (model/gpt_oss.py reads its config and checkpoint) add a bias to the router and to both
expert GEMMs and use a clamped SwiGLU (`ClampedSwiglu`); the rest of the block is the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.model import cpu_kernels
from llmserve.model.fused_cuda import cuda_fused
from llmserve.model.moe_grouped import can_group, grouped_moe
from llmserve.model.moe_dispatch import dispatch_combine
from llmserve.model.moe_load import ExpertLoad
from llmserve.model.moe_parallel import local_expert_ids

ExpertWeights = torch.Tensor | nn.ModuleList  # stacked [E, out, in], or one quantized layer per expert

if TYPE_CHECKING:
    from llmserve.model.parallel import TensorParallel  # parallel.py imports this module

_MOE_ARCHS = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM")
# Fields of an HF config that change the math unless absent or one of the values given here (other MoE
# families' routing: sigmoid scores, scaled weights, shared experts, grouped top-k)
_SUPPORTED_VALUES = {"hidden_act": ("silu",), "scoring_func": ("softmax",), "routed_scaling_factor": (1.0, None),
                     "n_shared_experts": (0, None), "shared_expert_intermediate_size": (0, None),
                     "n_group": (1, None), "topk_group": (1, None)}


@dataclass(frozen=True)
class ClampedSwiglu:
    """gpt-oss's expert activation on gate_up [n, 2I] (gate, then up) -> [n, I]:
    gate clamped above at `limit`, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float
    limit: float

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # [n, I] each
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


@dataclass(frozen=True)
class MoeSpec:
    """The Mixture-of-Experts settings of a config; which layers are sparse is `is_sparse_layer`."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    is_renormalized: bool  # top-k weights divided by their sum (= softmax over the top-k logits)
    sparse_step: int = 1  # every sparse_step-th layer is sparse (Qwen3-MoE's decoder_sparse_step)
    dense_layers: tuple[int, ...] = ()  # layers that stay a dense MLP (Qwen3-MoE's mlp_only_layers)
    has_bias: bool = False  # the router and both expert GEMMs add a bias (gpt-oss)
    activation: ClampedSwiglu | None = None  # None: silu(gate) * up
    # DeepSeek's routing (model/deepseek.py reads it from the config; `route_grouped`)
    scoring: str = "softmax"  # or "sigmoid": each expert's score on its own
    has_correction_bias: bool = False  # the router's e_score_correction_bias: added for the choice, not the weight
    num_groups: int = 1  # experts in num_groups groups; only the best num_topk_groups groups' experts compete
    num_topk_groups: int = 1
    group_score: str = "max"  # a group's score: its best expert's ("max") or its best two's sum ("top2_sum")
    routed_scaling_factor: float = 1.0  # the routed experts' weights times this
    shared_intermediate_size: int = 0  # > 0: a dense gated MLP every token goes through (shared experts)
    is_router_float32: bool = False  # the router's weight and correction bias stay float32 in a bf16 model

    @property
    def is_grouped(self) -> bool:
        """Whether routing takes `route_grouped` (DeepSeek's), not the plain softmax top-k."""
        return (self.scoring != "softmax" or self.num_groups > 1 or self.has_correction_bias
                or self.routed_scaling_factor != 1.0)

    def is_sparse_layer(self, index: int) -> bool:
        return index not in self.dense_layers and (index + 1) % self.sparse_step == 0


def num_experts_of(config) -> int:
    """The number of routed experts of an HF config (0 for a dense one)."""
    return getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0


def expert_intermediate_size(config) -> int:
    """One expert's intermediate size: Qwen3-MoE's moe_intermediate_size, Mixtral's intermediate_size."""
    return getattr(config, "moe_intermediate_size", None) or config.intermediate_size


def _check_supported_fields(config) -> None:
    for field, supported in _SUPPORTED_VALUES.items():
        value = getattr(config, field, supported[0])
        if value not in supported:
            raise ValueError(f"MoE config field {field}={value!r} is not supported (supported: {supported[0]!r})")


def moe_spec_from_config(config, architecture: str) -> MoeSpec | None:
    """The MoE settings of a Qwen3-MoE, Mixtral or gpt-oss config, None for a dense architecture.

    ValueError naming the field when the config asks for routing or experts this layer does not implement."""
    if architecture not in _MOE_ARCHS:
        return None
    _check_supported_fields(config)
    num_experts, top_k = num_experts_of(config), config.num_experts_per_tok
    if not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in 1..{num_experts} (the number of experts)")
    if architecture == "MixtralForCausalLM":
        return MoeSpec(num_experts, top_k, expert_intermediate_size(config), is_renormalized=True)
    if architecture == "GptOssForCausalLM":  # softmax over the top-k logits = renormalised top-k weights
        swiglu = ClampedSwiglu(float(getattr(config, "swiglu_alpha", 1.702)),
                               float(getattr(config, "swiglu_limit", 7.0)))
        return MoeSpec(num_experts, top_k, config.intermediate_size, is_renormalized=True, has_bias=True,
                       activation=swiglu)
    if config.decoder_sparse_step < 1:
        raise ValueError(f"decoder_sparse_step={config.decoder_sparse_step} must be at least 1")
    return MoeSpec(num_experts, top_k, expert_intermediate_size(config), bool(config.norm_topk_prob),
                   config.decoder_sparse_step, tuple(config.mlp_only_layers or ()))


def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], weight [E, H], bias [E] or None -> logits [T, E] float32, accumulated in float64.

    A float32 GEMM's row results change with the number of rows on CPU (MKL picks its blocking by shape), so
    a token's logits, and at a near-tie its experts, would depend on the batch. The float64 sums differ by far
    less than float32's rounding step, so the rounded logits are those the token gets alone."""
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double()).float()


def route(logits: torch.Tensor, top_k: int, is_renormalized: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32 -> (weights [T, k] float32, expert ids [T, k] int64), per row.

    Softmax over all experts, then the k largest; equal logits go to the lower expert id (a stable sort:
    torch.topk breaks ties arbitrarily). Renormalised weights sum to 1 over the k."""
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]  # [T, k]
    weights = torch.softmax(logits, dim=-1).gather(1, ids)  # [T, k]
    if is_renormalized:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_grouped(logits: torch.Tensor, spec: MoeSpec,
                  correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routing, per row: logits [T, E] float32 -> (weights [T, k] float32, expert ids [T, k] int64).

    Scores are softmax(logits) (V2) or sigmoid(logits) (V3); the choice adds the correction bias [E] (V3);
    with groups only the experts of the num_topk_groups best groups compete (the others' choice is masked);
    the k best are taken (ties to the lower id), weighted by their score (not the biased one), renormalised
    when the spec says, times routed_scaling_factor (transformers' DeepseekV2/V3TopkRouter)."""
    scores = torch.sigmoid(logits) if spec.scoring == "sigmoid" else torch.softmax(logits, dim=-1)  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if spec.num_groups > 1:
        choice = _best_groups_only(choice, spec)
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :spec.top_k]  # [T, k]
    weights = scores.gather(1, ids)
    if spec.is_renormalized:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * spec.routed_scaling_factor, ids


def _best_groups_only(choice: torch.Tensor, spec: MoeSpec) -> torch.Tensor:
    """choice [T, E] -> the same with the experts outside each row's num_topk_groups best groups masked
    (-inf for sigmoid scores, V3; 0 for softmax ones, V2, as transformers fills them)."""
    grouped = choice.view(choice.shape[0], spec.num_groups, -1)  # [T, G, E/G]
    if spec.group_score == "top2_sum":
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    else:
        group_scores = grouped.amax(dim=-1)
    best = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :spec.num_topk_groups]
    is_kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # [T, G]
    fill = float("-inf") if spec.scoring == "sigmoid" else 0.0
    return grouped.masked_fill(~is_kept[:, :, None], fill).view_as(choice)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [n, 2I] -> silu(gate) * up [n, I]."""
    if gate_up.is_contiguous() and cpu_kernels.can_fuse(gate_up):
        return cpu_kernels.silu_mul(gate_up)
    if (fused := cuda_fused(gate_up)) is not None:
        return fused.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def expert_counts(ids: torch.Tensor, num_experts: int) -> list[int]:
    """ids [T, k] -> tokens routed to each expert (a host list: one sync per layer)."""
    return torch.bincount(ids.reshape(-1), minlength=num_experts).tolist()


def sort_pairs(ids: torch.Tensor, num_experts: int) -> tuple[list[int], torch.Tensor]:
    """ids [T, k] -> (pairs each of this rank's experts got, order [P]: the (token, k) pairs grouped by expert,
    stable, so token order within an expert). Pairs of other ranks' experts (ids >= num_experts) sort last and
    are left out."""
    counts = expert_counts(ids, num_experts)[:num_experts]
    return counts, torch.sort(ids.reshape(-1), stable=True).indices[:sum(counts)]


def fused_moe(x: torch.Tensor, gate_up: ExpertWeights, down: ExpertWeights, weights: torch.Tensor,
              ids: torch.Tensor, biases: tuple[torch.Tensor, torch.Tensor | None] | None = None,
              activation: ClampedSwiglu | None = None) -> torch.Tensor:
    """x [T, H], gate_up [E, 2I, H], down [E, H, I] (or a quantized layer per expert: model/quant/experts.py),
    routing weights/ids [T, k] -> [T, H]; biases: gate_up's [E, 2I] and down's [E, H] (weighted with the
    expert's output); activation: silu(gate) * up when None. An id of E or more is a pair another rank
    computes (expert parallelism: model/moe_parallel.py): skipped.

    The T*k token-expert pairs are sorted by expert once (stable: within an expert, token order); each expert
    with tokens runs its GEMM pair over its contiguous rows; each token's k outputs are summed in k order."""
    counts, order = sort_pairs(ids, len(gate_up))
    rows = x.index_select(0, order // ids.shape[1])  # [P, H] the token of each sorted pair
    outs = torch.empty_like(rows)  # [P, H]
    gate_up_bias, down_bias = (None, None) if biases is None else biases
    activation = activation or _silu_mul
    start = 0
    for expert, count in enumerate(counts):
        if count:
            gated = _expert_linear(gate_up, expert, rows[start:start + count], gate_up_bias)  # [n, 2I]
            outs[start:start + count] = _expert_linear(down, expert, activation(gated), down_bias)  # [n, H]
            start += count
    return _combine(outs, order, weights)


def _combine(outs: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """outs [P, H] of the pairs in `order` (indices into the T*k (token, k) pairs; P < T*k where other ranks hold
    the rest) -> each token's k outputs weighted by weights [T, k] and summed in k order -> [T, H].

    Put back in (token, k) order by index_copy_ (unique indices): on CPU index_add_ adds one row at a time and
    an indexed assignment is as slow (docs/benchmarks.md, "MoE on CPU")."""
    num_tokens, top_k = weights.shape
    is_whole = len(order) == weights.numel()
    by_pair = (outs.new_empty if is_whole else outs.new_zeros)(num_tokens * top_k, outs.shape[1])  # [T*k, H]
    by_pair.index_copy_(0, order, outs)
    weighted = by_pair.view(num_tokens, top_k, -1) * weights.unsqueeze(2).to(outs.dtype)  # [T, k, H]
    return weighted.sum(dim=1)


def _expert_linear(weight: ExpertWeights, expert: int, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows [n, in] through one expert's matrix -> [n, out]: a slice of a stacked float tensor, or the
    expert's quantized layer (which holds its own bias)."""
    if isinstance(weight, torch.Tensor):
        return F.linear(rows, weight[expert], expert_row(bias, expert))
    return weight[expert](rows)


def expert_row(bias: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    """One expert's row of stacked biases [E, out] (None without biases)."""
    return None if bias is None else bias[expert]


class Router(nn.Module):
    """The linear layer scoring each token against each expert (HF's `mlp.gate`; gpt-oss's has a bias,
    DeepSeek-V3's an `e_score_correction_bias` for the choice only)."""

    def __init__(self, hidden_size: int, num_experts: int, has_bias: bool = False, has_correction_bias: bool = False,
                 is_float32: bool = False):
        super().__init__()
        self.is_float32 = is_float32  # the loader keeps its tensors float32 (transformers' DeepSeek does)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))  # [E, H]
        self.bias = nn.Parameter(torch.empty(num_experts)) if has_bias else None  # [E]
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts)) if has_correction_bias else None  # [E]


class Experts(nn.Module):
    """E gated MLPs stacked: gate_up_proj [E, 2I, H] (gate rows, then up), down_proj [E, H, I]; with
    has_bias their biases gate_up_proj_bias [E, 2I] and down_proj_bias [E, H]."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, has_bias: bool = False):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size)) if has_bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size)) if has_bias else None

    def biases(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.down_proj_bias is None else (self.gate_up_proj_bias, self.down_proj_bias)


class ExpertLayers(nn.Module):
    """E experts, each its own gate_up [2I, H] and down [H, I] layer holding its bias, in place of the stacked
    `Experts` (packed float32 layers on CPU: model/moe_cpu.py; quantized ones: model/quant/experts.py);
    fused_moe calls expert e's layers."""

    def __init__(self, gate_up_proj: nn.ModuleList, down_proj: nn.ModuleList):
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj

    def biases(self) -> None:
        """None: each expert's layers add their own bias."""
        return None

    def runs_in_one_op(self, x: torch.Tensor, activation: ClampedSwiglu | None) -> bool:
        """Whether `run_in_one_op` takes x with this activation (packed float32 experts on CPU do:
        model/moe_cpu.py); otherwise fused_moe calls each expert's layers."""
        return False

    def run_in_one_op(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], routing weights/ids [T, k] -> [T, H], as fused_moe computes it, in one op a layer."""
        raise NotImplementedError


class SparseMoeBlock(nn.Module):
    """Router -> top-k -> experts -> weighted sum (+ the shared experts' MLP where the spec has one);
    x [T, H] -> [T, H].

    With tensor parallelism every rank holds the whole router and routes alike; an all-reduce (`tp`) sums
    the ranks' partial outputs. Each rank holds `intermediate_size` (its share) of every expert's features
    (and `shared_intermediate_size` of the shared experts'), or with expert parallelism `held_experts` (first,
    count): whole experts, of which it computes the pairs routed to them (model/moe_parallel.py)."""

    def __init__(self, hidden_size: int, spec: MoeSpec, tp: TensorParallel | None = None,
                 intermediate_size: int | None = None, held_experts: tuple[int, int] | None = None,
                 shared_intermediate_size: int | None = None):
        super().__init__()
        self.spec = spec
        self.tp = tp
        self.held_experts = held_experts
        self.gate = Router(hidden_size, spec.num_experts, spec.has_bias, spec.has_correction_bias,
                           spec.is_router_float32)
        num_held = spec.num_experts if held_experts is None else held_experts[1]
        self.experts = Experts(hidden_size, intermediate_size or spec.intermediate_size, num_held, spec.has_bias)
        self.shared_experts = _shared_experts(hidden_size, shared_intermediate_size or spec.shared_intermediate_size)
        self.load = ExpertLoad(spec.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = router_logits(x, self.gate.weight, self.gate.bias)  # [T, E]
        if self.spec.is_grouped:
            weights, ids = route_grouped(logits, self.spec, self.gate.e_score_correction_bias)  # [T, k] each
        else:
            weights, ids = route(logits, self.spec.top_k, self.spec.is_renormalized)
        self.load.record(ids)
        if self.is_all_to_all:
            out = dispatch_combine(x, weights, ids, self.held_experts, self.spec.num_experts, self.tp.rank,
                                   self.tp.size, self._each_row_out, _combine, self.tp.group)
        else:
            ids = ids if self.held_experts is None else local_expert_ids(ids, self.held_experts)
            out = self._experts_out(x, weights, ids)
        if self.shared_experts is not None:
            out += self.shared_experts(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    @property
    def is_all_to_all(self) -> bool:
        """Expert parallelism with all-to-all dispatch (--all2all-backend all2allv: model/moe_dispatch.py)."""
        return self.held_experts is not None and self.tp is not None and self.tp.all2all_backend == "all2allv"

    def _each_row_out(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """rows [R, H], local expert ids [R] -> each row through its one expert [R, H], unweighted."""
        ones = torch.ones(len(rows), 1, dtype=torch.float32, device=rows.device)
        return self._experts_out(rows, ones, local_ids[:, None])

    def _experts_out(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], routing weights/ids [T, k] (ids local to this rank) -> the experts' weighted sum [T, H]."""
        experts = self.experts
        if self.runs_grouped_gemm(x):  # no host sync: CUDA graphs capture it
            return grouped_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids,
                               self.spec.activation or _silu_mul, self.rank_biases())
        if isinstance(experts, ExpertLayers) and experts.runs_in_one_op(x, self.spec.activation):
            return experts.run_in_one_op(x, weights, ids)
        return fused_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids, self.rank_biases(),
                         self.spec.activation)

    def runs_grouped_gemm(self, x: torch.Tensor) -> bool:
        """The experts run as grouped GEMMs without a host sync (model/moe_grouped.py) for inputs like x."""
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        return isinstance(gate_up, torch.Tensor) and can_group(x, gate_up, down)

    def rank_biases(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The experts' biases; on a tensor-parallel rank other than 0 without the down bias, which the
        all-reduce would otherwise add once per rank (as a row-parallel layer's). With expert parallelism
        each expert's down bias is on its one rank only."""
        biases = self.experts.biases()
        if biases is None or self.tp is None or self.tp.rank == 0 or self.held_experts is not None:
            return biases
        return biases[0], None


def _shared_experts(hidden_size: int, intermediate_size: int) -> nn.Module | None:
    """DeepSeek's shared experts: one dense gated MLP (None when the spec has none)."""
    if not intermediate_size:
        return None
    from llmserve.model.layers import GatedMLP  # layers -> parallel -> this module: imported when used

    return GatedMLP(hidden_size, intermediate_size)
