"""Expert parallelism's all-to-all dispatch (`--all2all-backend all2allv`): each (token, k) row goes to the
rank holding its expert, and its output comes back.

The default (`allgather_reducescatter`, vLLM's default name) needs no dispatch: attention is tensor-parallel,
so every rank already holds every token; a rank computes the pairs routed to its experts for all T tokens and
the block's all-reduce sums the ranks' shares (model/moe_parallel.py). With `all2allv` each rank owns a
contiguous 1/N of the step's tokens (`split_evenly`) and:

1. sorts its tokens' T/N * k pairs by the rank holding their expert; the ranks exchange the counts, then
   the rows and their expert ids (`torch.distributed.all_to_all_single` with split sizes: gloo has it on
   CPU, NCCL on CUDA);
2. each rank runs its experts over the rows it received (unweighted), and sends each output back to the rank
   the row came from (the same splits, reversed);
3. the owner weights each token's k outputs and sums them in k order, as one rank does (`moe._combine`),
   into its rows of a zero [T, H]; the block's all-reduce (which also sums the shared experts' shares) then
   gives every rank every token: a row is non-zero on one rank only, so the sum adds exact zeros.

Every (token, expert) pair is computed once, on its expert's rank, over the rows that rank received in
source-rank order, which is token order; so an expert sees the rows one rank would give it, in that order.
Costs four all-to-alls more than the default per MoE layer and step (counts, rows, their ids, outputs) and a
host sync for the counts (no CUDA graphs). Where attention is tensor-parallel the all-reduce stays, so this
moves more bytes, not fewer; it is the dispatch that data-parallel attention (each rank its own tokens; not
built) would need.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from llmserve.model.moe_parallel import ExpertRange, expert_range

# x [R, H], local expert ids [R] -> each row through its expert [R, H], unweighted
RunExperts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def token_slice(num_tokens: int, size: int, rank: int) -> tuple[int, int]:
    """(first, count) of the step's tokens rank `rank` owns: contiguous runs differing by at most one (a rank
    may own none when there are fewer tokens than ranks)."""
    base, extra = divmod(num_tokens, size)
    return rank * base + min(rank, extra), base + (rank < extra)


def owner_ranks(ids: torch.Tensor, num_experts: int, size: int) -> torch.Tensor:
    """Global expert ids [P] -> the rank holding each (expert_range's contiguous runs) [P]."""
    starts = torch.tensor([expert_range(num_experts, size, r)[0] for r in range(size)], device=ids.device)
    return torch.searchsorted(starts, ids, right=True) - 1


def _all_to_all(rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    """rows [sum(send_counts), ...] in destination order -> [sum(recv_counts), ...] in source order."""
    out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv_counts, send_counts, group=group)
    return out


def exchange_counts(send_counts: torch.Tensor, group) -> list[int]:
    """Rows this rank sends to each rank [N] -> rows it receives from each rank (one small all-to-all)."""
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts, group=group)
    return recv.tolist()


def dispatch_combine(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, held: ExpertRange,
                     num_experts: int, rank: int, size: int, run_experts: RunExperts,
                     combine: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                     group=None) -> torch.Tensor:
    """x [T, H], routing weights / global expert ids [T, k] (the same on every rank) -> [T, H]: this rank's
    tokens' routed output in their rows, zeros elsewhere (the caller's all-reduce joins the ranks' rows).

    combine(outs [P, H], order [P], weights [t, k]) -> [t, H] sums each token's k outputs in k order."""
    first, num_tokens = token_slice(x.shape[0], size, rank)
    top_k = ids.shape[1]
    mine = ids[first:first + num_tokens].reshape(-1)  # [P] this rank's pairs, (token, k) order
    owners = owner_ranks(mine, num_experts, size)  # [P]
    order = torch.sort(owners, stable=True).indices  # [P] grouped by destination, (token, k) order within
    send_counts = torch.bincount(owners, minlength=size)
    send = send_counts.tolist()
    recv = exchange_counts(send_counts, group)
    rows = _all_to_all(x[first:first + num_tokens].index_select(0, order // top_k), send, recv, group)  # [R, H]
    row_ids = _all_to_all(mine.index_select(0, order), send, recv, group) - held[0]  # [R] local ids
    outs = run_experts(rows, row_ids) if len(rows) else rows  # [R, H]
    back = _all_to_all(outs, recv, send, group)  # [P, H] in `order`
    out = x.new_zeros(x.shape)
    if num_tokens:
        out[first:first + num_tokens] = combine(back, order, weights[first:first + num_tokens])
    return out
