"""Verification of draft tokens (speculative decoding), exact for the target's distribution.

Layout: row r verifies k_r drafts with k_r + 1 target positions, flattened into N = sum(k_r + 1)
"expanded" positions; position j of a row holds the target's distribution after the row's real tokens
and drafts[:j]; the last one gives the bonus token when every draft is accepted.

Two rules (Leviathan et al. 2023; Chen et al. 2023):
- drafts with a distribution q (a draft model): accept draft d at position j with probability
  min(1, p_j(d) / q_j(d)); at the first rejection emit a sample of max(0, p_j - q_j), normalised.
- point-mass drafts (n-gram lookup, and every greedy row): q = 1 on d, so the rule is "accept with
  probability p_j(d), else sample p_j without d". spec/verify.py realises it with the sample the
  target would draw anyway at each position: keep d where that sample equals it. Same law, and a
  seeded request's tokens equal what it produces without speculation.

Both rules end the same way: an accept mask over the expanded positions -> `accepted_lengths` per row
-> `emit_accepted` (the accepted drafts, then one token of the target's).
"""

from __future__ import annotations

import torch


def accepted_lengths(is_accepted: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """is_accepted [N] bool over the expanded positions (k_r + 1 per row; the bonus positions are
    ignored), num_drafts [R] int64 -> [R] int64: per row the number of leading accepted drafts."""
    num_positions = num_drafts + 1  # [R]
    starts = torch.cumsum(num_positions, 0) - num_positions  # [R]
    max_drafts = int(num_drafts.max()) if num_drafts.numel() else 0
    if max_drafts == 0:
        return torch.zeros_like(num_drafts)
    offsets = torch.arange(max_drafts, device=num_drafts.device)  # [K]
    index = (starts.unsqueeze(1) + offsets).clamp_(max=is_accepted.numel() - 1)  # [R, K]
    is_draft = offsets < num_drafts.unsqueeze(1)  # [R, K]
    return (is_accepted[index] & is_draft).long().cumprod(dim=1).sum(dim=1)


def emit_accepted(drafts: list[list[int]], num_accepted: list[int], last: list[int]) -> list[list[int]]:
    """Per row: its `num_accepted` leading drafts, then `last` at the position after them (the token
    drawn at the first rejection, or the bonus token when every draft was accepted); last [N] expanded."""
    out, start = [], 0
    for row_drafts, num in zip(drafts, num_accepted):
        out.append(row_drafts[:num] + [last[start + num]])
        start += len(row_drafts) + 1
    return out


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                     uniforms: torch.Tensor, log_u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The paper's test at each expanded position, vectorised.

    target_probs [N, V] p_j, draft_probs [N, V] q_j, draft_token_ids [N] int64 (any id at bonus
    positions), uniforms [N] in [0, 1), log_u [N, V] log of uniforms in (0, 1) for the residual draws.
    Returns (is_accepted [N] bool, fallback [N] int64): fallback is the residual sample at draft
    positions; callers take p_j's own sample at bonus positions.
    """
    ids = draft_token_ids.unsqueeze(1)  # [N, 1]
    p_draft = target_probs.gather(1, ids).squeeze(1)  # [N]
    q_draft = draft_probs.gather(1, ids).squeeze(1)  # [N]
    is_accepted = uniforms * q_draft < p_draft  # u < min(1, p/q); q(d) > 0 as d was drawn from q
    residual = (target_probs - draft_probs).clamp_min_(0.0)  # [N, V]
    is_empty = residual.sum(dim=1, keepdim=True) <= 0  # p == q: nothing to reject towards
    residual = torch.where(is_empty, target_probs, residual)
    fallback = residual.div_(log_u).argmin(dim=1)  # exponential race: argmax r / E, E = -log U
    return is_accepted, fallback
