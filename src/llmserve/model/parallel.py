"""Tensor parallelism inside the model: each of N ranks holds a slice of every layer.

Megatron's split, as vLLM and nano-vllm do it:
  - column-parallel (qkv_proj, gate_up_proj): each rank computes its slice of the output features; no
    communication (a column slice of a linear layer is a smaller linear layer).
  - row-parallel (o_proj, down_proj): each rank multiplies its slice of the input features; an all-reduce
    sums the partial outputs; the bias is added once (rank 0).
  - vocab-parallel embedding: each rank looks up the ids in its vocabulary range (zeros elsewhere); an
    all-reduce sums them. The LM head computes its vocabulary range's logits; an all-gather joins them.
  - Mixture-of-Experts layers: the router whole on every rank, every expert's gate/up split as a column-
    parallel layer and its down as a row-parallel one (model/moe.py; gpt-oss's down bias added on rank 0);
    one all-reduce of the block's output. With expert parallelism each rank holds whole experts instead
    (model/moe_parallel.py), and the same all-reduce sums their outputs; DeepSeek's shared experts stay split
    by features (a column/row pair inside the block) under both. gpt-oss's attention sinks go with their query
    heads.
So a decoder layer costs two all-reduces of [T, hidden], and a step one all-gather of the logits.

Heads are split by KV group, so that a rank's query heads read only its own KV heads: with G query heads
per KV head, rank r gets a contiguous run of whole groups (uneven when the KV heads do not divide by N:
9 heads in 3 groups over 2 ranks are 6 + 3). With fewer KV heads than ranks each KV head is replicated on
N / Hkv ranks, which share its group's query heads. The intermediate size splits as evenly as it can.

`shard_of` names the slice of an HF checkpoint tensor that a rank loads (loader.iter_safetensors reads
only that slice from the file).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llmserve.model import deepseek
from llmserve.model.linear import Linear
from llmserve.model.moe import expert_intermediate_size, num_experts_of
from llmserve.model.moe_parallel import ExpertRange, expert_range, expert_slice_of, is_held


@dataclass
class TensorParallel:
    """This process's place in the tensor-parallel group, and the collectives the layers call."""

    rank: int
    size: int
    group: Any = None  # the torch.distributed process group (None: the default one)
    is_expert_parallel: bool = False  # MoE layers: whole experts a rank (--enable-expert-parallel)
    all2all_backend: str = "allgather_reducescatter"  # expert parallelism's dispatch (model/moe_dispatch.py)
    comm_seconds: float = field(default=0.0, compare=False)  # host time in collectives (benchmarks)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self.comm_seconds += time.perf_counter() - start
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., size * n], rank order."""
        start = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        self.comm_seconds += time.perf_counter() - start
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        start = time.perf_counter()
        dist.broadcast(x, src=src, group=self.group)
        self.comm_seconds += time.perf_counter() - start
        return x


def split_evenly(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part `index` of `total` items in `parts` contiguous parts differing by at most 1."""
    base, extra = divmod(total, parts)
    return index * base + min(index, extra), base + (index < extra)


@dataclass(frozen=True)
class ShardLayout:
    """What one rank holds of a model: heads, intermediate features and vocabulary rows (start, count)."""

    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]  # rows of the padded table [size * vocab_per_rank]; count = vocab_per_rank
    vocab_size: int  # the real vocabulary (rows past it are padding)
    head_dim: int
    expert_intermediate: tuple[int, int] = (0, 0)  # of every expert (Mixture-of-Experts models)
    experts: ExpertRange | None = None  # expert parallelism: the whole experts held (their features all)
    shared_intermediate: tuple[int, int] = (0, 0)  # of the shared experts' MLP (DeepSeek)
    mla_head_dims: tuple[int, int, int] | None = None  # MLA: rows a head of q_(b_)proj, of kv_b_proj; o_proj's inputs


def head_shard(num_heads: int, num_kv_heads: int, size: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((first query head, count), (first KV head, count)) of `rank`; ValueError when the heads cannot split."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} attention heads are not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        kv_start, num_kv = split_evenly(num_kv_heads, size, rank)
        return (kv_start * group, num_kv * group), (kv_start, num_kv)
    ranks_per_kv = size // num_kv_heads
    if size % num_kv_heads or group % ranks_per_kv:
        raise ValueError(f"--tensor-parallel-size {size} cannot split {num_heads} attention heads over "
                         f"{num_kv_heads} KV heads: with fewer KV heads than ranks, the ranks must be a multiple "
                         f"of the KV heads and each KV head's {group} query heads must divide by "
                         f"{ranks_per_kv}")
    num_q = group // ranks_per_kv
    return (rank * num_q, num_q), (rank // ranks_per_kv, 1)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def shard_layout(config, size: int, rank: int, is_expert_parallel: bool = False) -> ShardLayout:
    """Rank `rank`'s share of an HF config's model over `size` ranks (ValueError when it cannot split)."""
    q_heads, kv_heads = head_shard(config.num_attention_heads, config.num_key_value_heads, size, rank)
    num_experts = num_experts_of(config)
    expert_size = expert_intermediate_size(config) if num_experts and not is_expert_parallel else size
    experts = expert_range(num_experts, size, rank) if is_expert_parallel else None
    expert_share = (0, expert_intermediate_size(config)) if experts else split_evenly(expert_size, size, rank)
    is_mla = getattr(config, "kv_lora_rank", None) is not None
    shared_size = deepseek.shared_intermediate_size(config) if is_mla else 0
    for name, value in (("intermediate size", config.intermediate_size), ("experts' intermediate size", expert_size),
                        ("shared experts' intermediate size", shared_size or size)):
        if value < size:
            raise ValueError(f"--tensor-parallel-size {size} exceeds the {name} {value}")
    per_rank = -(-config.vocab_size // size)
    return ShardLayout(q_heads, kv_heads, split_evenly(config.intermediate_size, size, rank),
                       (rank * per_rank, per_rank), config.vocab_size, head_dim_of(config), expert_share, experts,
                       split_evenly(shared_size, size, rank), deepseek.mla_head_dims(config) if is_mla else None)


def check_tensor_parallel(config, size: int, is_expert_parallel: bool = False) -> None:
    """ValueError (with the reason) unless every rank of `size` gets a share of the model."""
    architecture = (getattr(config, "architectures", None) or [""])[0]
    if architecture in deepseek.ARCHITECTURES:
        deepseek.check_config(config, architecture)
    if is_expert_parallel and not num_experts_of(config):
        raise ValueError(f"--enable-expert-parallel: {architecture or 'this model'} is not a Mixture-of-Experts "
                         "model (it has no experts to place on ranks)")
    for rank in range(size):
        shard_layout(config, size, rank, is_expert_parallel)


def is_read(hf_name: str, layout: ShardLayout) -> bool:
    """Whether the rank reads checkpoint tensor `hf_name` at all (expert parallelism: not other ranks' experts)."""
    return layout.experts is None or is_held(hf_name, layout.experts)


def shard_of(hf_name: str, layout: ShardLayout) -> tuple[int, int, int] | None:
    """(dim, start, length) of the slice of checkpoint tensor `hf_name` that the rank loads; None: all of it."""
    parts = hf_name.split(".")
    if len(parts) < 2:
        return None
    if "experts" in parts:
        return expert_slice_of(hf_name, layout.expert_intermediate, layout.experts)
    module, kind, d = parts[-2], parts[-1], layout.head_dim
    if "shared_experts" in parts:
        return _mlp_shard(module, kind, layout.shared_intermediate)
    if layout.mla_head_dims is not None and module in _MLA_HEAD_ROWS:
        return _mla_shard(module, kind, layout)
    (q0, nq), (kv0, nkv), (i0, ni) = layout.q_heads, layout.kv_heads, layout.intermediate
    if kind == "sinks":  # one per query head (gpt-oss)
        return 0, q0, nq
    if module == "q_proj":
        return 0, q0 * d, nq * d
    if module in ("k_proj", "v_proj"):
        return 0, kv0 * d, nkv * d
    if module == "o_proj" and kind == "weight":
        return 1, q0 * d, nq * d
    if module in ("gate_proj", "up_proj"):
        return 0, i0, ni
    if module == "down_proj" and kind == "weight":
        return 1, i0, ni
    if module in ("embed_tokens", "lm_head"):
        v0, nv = layout.vocab
        return 0, min(v0, layout.vocab_size), max(0, min(nv, layout.vocab_size - v0))
    return None


def _mlp_shard(module: str, kind: str, features: tuple[int, int]) -> tuple[int, int, int] | None:
    """A gated MLP's gate/up rows or down inputs [start, start + count) of its intermediate features."""
    if module in ("gate_proj", "up_proj"):
        return 0, *features
    if module == "down_proj" and kind == "weight":
        return 1, *features
    return None


_MLA_HEAD_ROWS = {"q_proj": 0, "q_b_proj": 0, "kv_b_proj": 1, "o_proj": 2}  # -> index in mla_head_dims


def _mla_shard(module: str, kind: str, layout: ShardLayout) -> tuple[int, int, int] | None:
    """Latent attention's per-head tensors: the rank's heads' rows of q_proj / q_b_proj and kv_b_proj, its
    heads' inputs of o_proj (whose bias rank 0 adds whole)."""
    q0, nq = layout.q_heads
    per_head = layout.mla_head_dims[_MLA_HEAD_ROWS[module]]
    if module == "o_proj":
        return (1, q0 * per_head, nq * per_head) if kind == "weight" else None
    return 0, q0 * per_head, nq * per_head


class ColumnParallelLinear(Linear):
    """This rank's slice of a linear layer's output features (the loader fills it with those rows)."""


class RowParallelLinear(Linear):
    """This rank's slice of a linear layer's input features: partial outputs summed by an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in / N] -> [T, out], the same on every rank."""
        return self.tp.all_reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in / N] -> [T, out]: this rank's share of the sum, before the all-reduce (a LoRA adds its
        own share of the sum to it first)."""
        return self.matmul(x, self.bias if self.tp.rank == 0 else None)


class VocabParallelEmbedding(nn.Module):
    """The rows [start, start + n) of the embedding table; ids outside them look up zeros."""

    def __init__(self, layout: ShardLayout, hidden_size: int, tp: TensorParallel):
        super().__init__()
        self.start, num_rows = layout.vocab
        self.weight = nn.Parameter(torch.empty(num_rows, hidden_size))
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]."""
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0))


def column_linear(in_features: int, out_features: int, bias: bool, tp: TensorParallel | None) -> nn.Linear:
    """`out_features` are this rank's (already divided); a plain Linear without tensor parallelism."""
    return Linear(in_features, out_features, bias=bias) if tp is None else \
        ColumnParallelLinear(in_features, out_features, bias=bias)


def row_linear(in_features: int, out_features: int, bias: bool, tp: TensorParallel | None) -> nn.Linear:
    """`in_features` are this rank's (already divided); a plain Linear without tensor parallelism."""
    return Linear(in_features, out_features, bias=bias) if tp is None else \
        RowParallelLinear(in_features, out_features, bias, tp)
