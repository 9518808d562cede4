"""The checkpoint names of an MoE layer's expert tensors, and where each goes in the stacked parameters.

Checkpoints store the experts one tensor per expert (what save_pretrained writes: `experts.3.gate_proj.weight`,
Mixtral's `block_sparse_moe.experts.3.w1.weight`) or stacked (`experts.gate_up_proj` [E, 2I, H]); the model
holds them stacked (model/moe.py's `Experts`). `map_expert_name` says where a tensor goes, as a shard
"e{expert}:{gate|up|down}" of the stacked parameter.
"""

from __future__ import annotations

import torch

# The per-expert checkpoint names: (module, part) -> part of the stacked tensor; Mixtral's w1/w3/w2 are
# gate/up/down
_EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def map_expert_name(hf_name: str) -> tuple[str, str | None] | None:
    """A per-expert checkpoint tensor -> (our stacked parameter, shard "e{expert}:{gate|up|down}"); a whole
    stacked tensor -> (its name, None); Mixtral's `block_sparse_moe.` read as `mlp.`; None: not an MoE name."""
    name = hf_name.replace(".block_sparse_moe.", ".mlp.")
    parts = name.split(".")
    if "experts" not in parts:
        return (name, None) if name != hf_name else None
    at = parts.index("experts")
    if len(parts) == at + 2:  # mlp.experts.gate_up_proj / mlp.experts.down_proj, stacked already
        return name, None
    if len(parts) != at + 4 or not parts[at + 1].isdigit() or parts[at + 2] not in _EXPERT_PARTS:
        return name, None  # no place in the model: the loader names it
    part = _EXPERT_PARTS[parts[at + 2]]
    stacked = "down_proj" if part == "down" else "gate_up_proj"
    return ".".join(parts[:at + 1] + [stacked]), f"e{parts[at + 1]}:{part}"


def expert_shard_view(param: torch.Tensor, shard: str) -> torch.Tensor:
    """The slice of a stacked parameter that shard "e{expert}:{gate|up|down}" fills."""
    expert, part = shard[1:].split(":")
    rows = param[int(expert)]
    if part == "down":
        return rows
    half = rows.shape[0] // 2
    return rows[:half] if part == "gate" else rows[half:]


def expert_shards(param_name: str, num_experts: int) -> list[str] | None:
    """The shards that together fill a stacked expert parameter; None for any other parameter."""
    if param_name.endswith("experts.gate_up_proj"):
        return [f"e{e}:{part}" for e in range(num_experts) for part in ("gate", "up")]
    if param_name.endswith("experts.down_proj"):
        return [f"e{e}:down" for e in range(num_experts)]
    return None
