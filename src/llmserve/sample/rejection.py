"""Verification of draft tokens (speculative decoding), exact for the target's distribution.

Layout: row r verifies k_r drafts with k_r + 1 target positions, flattened into N = sum(k_r + 1)
"expanded" positions; position j of a row holds the target's distribution after the row's real tokens
and drafts[:j]; the last one gives the bonus token when every draft is accepted.

Two rules (Leviathan et al. 2023; Chen et al. 2023):
- drafts with a distribution q (a draft model): accept draft d at position j with probability
  min(1, p_j(d) / q_j(d)); at the first rejection emit a sample of max(0, p_j - q_j), normalised.
- point-mass drafts (n-gram lookup, and every greedy row): q = 1 on d, so the rule is "accept with
  probability p_j(d), else sample p_j without d". `accept_point_drafts` realises it with the sample
  the target would draw anyway at each position: keep d where that sample equals it. Same law, and a
  seeded request's tokens equal what it produces without speculation.
"""

from __future__ import annotations

import torch


def accept_point_drafts(target_tokens: list[int], drafts: list[list[int]]) -> list[list[int]]:
    """target_tokens [N]: the target's own sample (or argmax) at each expanded position.
    Returns per row the emitted tokens: the drafts that agree with it, up to the first that does not,
    then the target's token there (the bonus token when all agree)."""
    out, start = [], 0
    for row_drafts in drafts:
        row = target_tokens[start:start + len(row_drafts) + 1]
        num_accepted = 0
        while num_accepted < len(row_drafts) and row_drafts[num_accepted] == row[num_accepted]:
            num_accepted += 1
        out.append(row[:num_accepted + 1])
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


def emit_from_rejection(is_accepted: list[bool], fallback: list[int], bonus: list[int],
                        drafts: list[list[int]]) -> list[list[int]]:
    """Per row: the accepted leading drafts, then the residual sample at the first rejection, or the
    bonus token (the target's sample at the last position) when every draft is accepted."""
    out, start = [], 0
    for row_drafts in drafts:
        k = len(row_drafts)
        num_accepted = 0
        while num_accepted < k and is_accepted[start + num_accepted]:
            num_accepted += 1
        last = bonus[start + k] if num_accepted == k else fallback[start + num_accepted]
        out.append(row_drafts[:num_accepted] + [last])
        start += k + 1
    return out
