"""The experts of an MoE layer without a host sync, for CUDA graphs: every expert's GEMM in one grouped GEMM
(`torch._grouped_mm`) whose group offsets stay on the device.

`moe.fused_moe` reads how many tokens each expert got on the host (one sync per layer) to run one GEMM pair per
expert; a graph cannot hold that. Here the token-expert pairs are sorted by expert, the offsets are a cumulative
count made with a scatter (torch.bincount would read its maximum on the host), and each of the two GEMMs is one
grouped GEMM over the sorted rows. Each token's k outputs are put back in (token, k) order and summed in that
order, so a row's result does not depend on atomics. On CUDA this takes bfloat16 on Hopper (compute capability
9.0) with 16-byte-aligned rows (`can_group`); elsewhere the engine keeps `fused_moe`. It runs on CPU too (tests).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def can_group(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes these shapes on x's device: bfloat16 on a CUDA device of compute
    capability 9.0 or more, every GEMM dimension a multiple of 8 (16 bytes)."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")):
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    return all(size % 8 == 0 for size in (gate_up.shape[1], gate_up.shape[2], down.shape[1], down.shape[2]))


def grouped_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor],
                biases: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """x [T, H], gate_up [E, 2I, H], down [E, H, I], routing weights/ids [T, k], activation [n, 2I] -> [n, I],
    biases: gate_up's [E, 2I] and down's [E, H] or None -> [T, H], with no host sync. An id of E is a pair
    another rank computes (expert parallelism: model/moe_parallel.py): its rows sort last, past the grouped
    GEMMs' last group, and count zero."""
    num_tokens, top_k = ids.shape
    num_experts = gate_up.shape[0]
    flat = ids.reshape(-1)  # [T*k] the expert of each pair, in (token, k) order
    order = torch.sort(flat, stable=True).indices  # [T*k] pairs grouped by expert
    expert_of_row = flat[order].clamp(max=num_experts - 1)  # [T*k] (rows past the last group: any expert)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # [E + 1]
    offsets = counts[:num_experts].cumsum(0, dtype=torch.int32)  # [E] each group's end row
    rows = x.index_select(0, order // top_k)  # [T*k, H]
    gated = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offsets)  # [T*k, 2I]
    if biases is not None:
        gated = gated + biases[0].index_select(0, expert_of_row)
    outs = torch._grouped_mm(activation(gated), down.transpose(1, 2), offs=offsets)  # [T*k, H]
    if biases is not None and biases[1] is not None:
        outs = outs + biases[1].index_select(0, expert_of_row)
    by_pair = torch.empty_like(outs)
    by_pair[order] = outs  # back to (token, k) order: unique indices, no atomics
    weighted = by_pair.view(num_tokens, top_k, -1) * weights.unsqueeze(2).to(outs.dtype)  # [T, k, H]
    is_here = (ids < num_experts).unsqueeze(2)  # [T, k, 1]; the other rows hold whatever the GEMMs left
    return torch.where(is_here, weighted, 0).sum(dim=1)
