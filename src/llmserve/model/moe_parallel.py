"""How a Mixture-of-Experts layer splits over tensor-parallel ranks: by features or by whole experts.

- Tensor parallelism (the default): every rank holds every expert, each expert's intermediate features split
  as a column- (gate/up) and row-parallel (down) pair; every rank computes every (token, expert) pair on its
  features, and the block's all-reduce sums the partial outputs.
- Expert parallelism (`--enable-expert-parallel`, vLLM's flag): rank r holds whole experts, a contiguous run
  of them (`expert_range`: E / N each, the first E mod N ranks one more); it reads only those experts'
  tensors from the checkpoint, computes only the (token, expert) pairs routed to them, and the same
  all-reduce sums the ranks' partial outputs (each token's k weighted expert outputs live on up to k ranks).
  Every rank holds the router and routes every token alike, so the pairs a rank skips are exactly those
  another rank computes. This is all-gather + reduce-scatter done as one all-reduce of [T, hidden]: the
  tokens are already on every rank (attention stays tensor-parallel), so nothing is sent to the experts
  (`--all2all-backend allgather_reducescatter`); `all2allv` sends each rank's share of the routed rows to
  their experts' ranks and back instead (model/moe_dispatch.py).

The helpers here name the slice of each checkpoint tensor a rank reads and turn global expert ids into the
rank's own (`local_expert_ids`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from llmserve.model.moe_names import map_expert_name

ExpertRange = tuple[int, int]  # (first expert, number of experts) a rank holds


def expert_range(num_experts: int, size: int, rank: int) -> ExpertRange:
    """The whole experts rank `rank` of `size` holds: contiguous runs differing by at most one expert.

    ValueError naming the flag when some rank would hold none."""
    if num_experts < size:
        raise ValueError(f"--enable-expert-parallel: {num_experts} experts cannot go to {size} ranks "
                         "(each rank needs at least one expert): lower --tensor-parallel-size")
    base, extra = divmod(num_experts, size)
    return rank * base + min(rank, extra), base + (rank < extra)


def expert_index(hf_name: str) -> int | None:
    """The expert of a per-expert checkpoint tensor (`...experts.3.gate_proj.weight` -> 3); None for others."""
    target = map_expert_name(hf_name)
    if target is None or target[1] is None:
        return None
    return int(target[1][1:].split(":")[0])


def is_held(hf_name: str, experts: ExpertRange) -> bool:
    """Whether a rank holding `experts` reads this checkpoint tensor (a per-expert one of another rank's: no)."""
    index = expert_index(hf_name)
    return index is None or experts[0] <= index < experts[0] + experts[1]


def expert_slice_of(hf_name: str, intermediate: tuple[int, int],
                    experts: ExpertRange | None) -> tuple[int, int, int] | None:
    """(dim, start, length) of an expert checkpoint tensor that a rank reads; None: all of it.

    Split by features (experts None): features [start, start + count) of a per-expert tensor; a stacked one
    is read whole (`shard_stacked` cuts it). Split by experts: a held per-expert tensor whole, rows
    [first, first + count) of a stacked one (every stacked expert tensor is [E, ...])."""
    target = map_expert_name(hf_name)
    if target is None:
        return None
    if experts is not None:
        return (0, *experts) if target[1] is None else None
    if target[1] is None:
        return None
    return (1 if target[1].endswith(":down") else 0), *intermediate


def to_local_experts(weights: Iterable[tuple[str, torch.Tensor]],
                     experts: ExpertRange) -> Iterator[tuple[str, torch.Tensor]]:
    """A rank's checkpoint tensors with per-expert names renumbered to its own experts (global e -> e - first);
    another rank's per-expert tensors are dropped (the loader does not read them: `is_held`)."""
    first, count = experts
    for name, tensor in weights:
        index = expert_index(name)
        if index is None:
            yield name, tensor
        elif first <= index < first + count:
            parts = name.split(".")
            at = parts.index("experts") + 1
            yield ".".join(parts[:at] + [str(index - first)] + parts[at + 1:]), tensor


def local_expert_ids(ids: torch.Tensor, experts: ExpertRange) -> torch.Tensor:
    """Routed expert ids [T, k] -> the rank's own ids [T, k]: id - first for its experts, `count` (one past
    its last) for the pairs other ranks compute, which sort last and are skipped (moe.fused_moe)."""
    first, count = experts
    local = ids - first
    return local.masked_fill((local < 0) | (local >= count), count)


def is_stacked_expert(name: str) -> bool:
    """A stacked expert tensor that tensor parallelism splits (down_proj's bias [E, H] is not split)."""
    return name.endswith(("experts.gate_up_proj", "experts.down_proj", "experts.gate_up_proj_bias"))


def shard_stacked(name: str, tensor: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """A rank's share of a whole stacked expert tensor: features [start, start + count) of the gate and of
    the up half of gate_up_proj [E, 2I, H] (and of its bias [E, 2I]), of down_proj's inputs [E, H, I]."""
    if name.endswith("experts.down_proj"):
        return tensor[:, :, start:start + count]
    gate, up = tensor.chunk(2, dim=1)
    if start == 0 and count == gate.shape[1]:  # every feature (expert parallelism)
        return tensor
    return torch.cat([gate[:, start:start + count], up[:, start:start + count]], dim=1)
