"""Verifying a step's draft tokens: the target's logits at k + 1 positions per row -> emitted tokens.

Each row with drafts d[0..k) is expanded into k + 1 sampling positions; position j samples as the
request would at output index n + j with d[:j] already appended (penalties, min_tokens and the
per-position seed all see that prefix). Rows without drafts are one position, as without speculation.
When every row is plain greedy, the sampler would take the argmax at each position: that is taken
directly, with no per-position sampling rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.messages import Logprobs
from llmserve.sample import ops
from llmserve.sample.metadata import PositionRow, build_sampling_metadata
from llmserve.sample.rejection import accepted_lengths, emit_accepted, rejection_sample
from llmserve.sample.sampler import Sampler, gather_logprobs
from llmserve.sample.seeds import position_seed
from llmserve.spec.proposer import ProposerRow


def expand_rows(states: list[ProposerRow], drafts: list[list[int]],
                device: torch.device) -> list[PositionRow]:
    rows = []
    for state, row_drafts in zip(states, drafts):
        for j in range(len(row_drafts) + 1):
            output = state.output_token_ids + row_drafts[:j] if j else state.output_token_ids
            generator = None
            if state.params.seed is not None:
                generator = torch.Generator(device=device)
                generator.manual_seed(position_seed(state.params.seed, len(output)))
            rows.append(PositionRow(state.params, state.prompt_token_ids, output, generator,
                                    state.stop_token_ids_for_min_tokens))
    return rows


@dataclass
class Verified:
    """A step's verification, per row in the order given: the emitted tokens (the accepted drafts, then
    one token of the target's), how many drafts were accepted, and the emitted tokens' Logprobs where
    the row asked for them (None when no row did)."""

    token_ids: list[list[int]]
    num_accepted: list[int]
    logprobs: list | None = None


def verify(sampler: Sampler, logits: torch.Tensor, states: list[ProposerRow], drafts: list[list[int]],
           draft_probs: list[torch.Tensor | None], vocab_size: int) -> Verified:
    """logits [N, V] at the expanded positions; draft_probs per row: q [k, V] of a draft model's
    random drafts, or None (point-mass drafts: n-gram, greedy)."""
    if all(state.is_plain_greedy for state in states):
        return _verify_plain_greedy(logits, drafts)
    rows = expand_rows(states, drafts, logits.device)
    meta = build_sampling_metadata(rows, vocab_size, logits.device)
    raw_logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None  # [N, V]
    has_q = not meta.all_greedy and any(q is not None for q in draft_probs)
    out = sampler(logits, meta, keep_probs=has_q)
    target = out.sampled_token_ids  # [N]
    draft_ids = _flat_drafts(drafts, target.device)  # [N], -1 at the bonus positions
    is_accepted, last = draft_ids == target, target  # the point rule
    if has_q:
        is_accepted, last = _rejection(sampler, out.probs, target, rows, drafts, draft_probs, draft_ids)
    num_drafts = torch.tensor([len(d) for d in drafts], dtype=torch.int64, device=target.device)  # [R]
    num_accepted = accepted_lengths(is_accepted, num_drafts).tolist()
    emitted = emit_accepted(drafts, num_accepted, last.tolist())
    if raw_logprobs is None:
        return Verified(emitted, num_accepted)
    return Verified(emitted, num_accepted, _logprobs(raw_logprobs, meta.max_num_logprobs, states, drafts, emitted))


def _verify_plain_greedy(logits: torch.Tensor, drafts: list[list[int]]) -> Verified:
    """Every row plain greedy (what the sampler would do is the argmax): the argmax at each position
    [N], one copy to the host, and each row's drafts accepted while they equal it."""
    return verify_greedy_ids(ops.argmax_rows(logits).tolist(), drafts)


def verify_greedy_ids(target: list[int], drafts: list[list[int]]) -> Verified:
    """Greedy verification from the target's argmax at each expanded position ([N], on the host)."""
    emitted, num_accepted, start = [], [], 0
    for row_drafts in drafts:
        num = 0
        while num < len(row_drafts) and row_drafts[num] == target[start + num]:
            num += 1
        num_accepted.append(num)
        emitted.append(row_drafts[:num] + [target[start + num]])
        start += len(row_drafts) + 1
    return Verified(emitted, num_accepted)


def _flat_drafts(drafts: list[list[int]], device: torch.device) -> torch.Tensor:
    return torch.tensor([t for row in drafts for t in row + [-1]], dtype=torch.int64, device=device)


def _rejection(sampler: Sampler, target_probs: torch.Tensor, target: torch.Tensor, rows: list[PositionRow],
               drafts: list[list[int]], draft_probs: list[torch.Tensor | None],
               draft_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with q: the paper's rule; the others (greedy rows, point drafts): the point rule.
    Returns is_accepted [N] and the token emitted at each position if it is the first rejected one
    (the bonus token at bonus positions), both [N]."""
    num_positions, vocab_size = target_probs.shape
    q = torch.zeros_like(target_probs)  # [N, V]
    uses_q = torch.zeros(num_positions, dtype=torch.bool)  # [N]
    start = 0
    for row_drafts, row_q in zip(drafts, draft_probs):
        k = len(row_drafts)
        if row_q is not None and rows[start].params.temperature != 0.0:
            q[start:start + k] = row_q[:k]
            uses_q[start:start + k] = True
        start += k + 1
    uniforms, log_u = _draws(sampler, rows, num_positions, vocab_size, target_probs.device)
    is_accepted, fallback = rejection_sample(target_probs, q, draft_ids.clamp(min=0), uniforms, log_u)
    uses_q = uses_q.to(q.device)
    return torch.where(uses_q, is_accepted, draft_ids == target), torch.where(uses_q, fallback, target)


def _draws(sampler: Sampler, rows: list[PositionRow], num_positions: int, vocab_size: int,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """uniforms [N] and log-uniforms [N, V]; seeded positions draw from their own generator."""
    uniforms = torch.rand(num_positions, generator=sampler.generator, device=device)
    log_u = torch.empty(num_positions, vocab_size, device=device).uniform_(1e-20, 1.0, generator=sampler.generator)
    for i, row in enumerate(rows):
        if row.generator is not None:
            uniforms[i] = torch.rand(1, generator=row.generator, device=device)[0]
            log_u[i].uniform_(1e-20, 1.0, generator=row.generator)
    return uniforms, log_u.log_()


def _logprobs(raw_logprobs: torch.Tensor, num_logprobs: int, states: list[ProposerRow],
              drafts: list[list[int]], emitted: list[list[int]]) -> list:
    """Logprobs of each emitted token at its position, per row (None for rows that did not ask)."""
    positions, tokens, start = [], [], 0
    for row_drafts, row_emitted in zip(drafts, emitted):
        positions.extend(range(start, start + len(row_emitted)))
        tokens.extend(row_emitted)
        start += len(row_drafts) + 1
    index = torch.tensor(positions, dtype=torch.int64, device=raw_logprobs.device)
    lp = gather_logprobs(raw_logprobs[index], num_logprobs,
                         torch.tensor(tokens, dtype=torch.int64, device=raw_logprobs.device))
    ids, values, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.sampled_ranks.tolist()
    out, i = [], 0
    for state, row_emitted in zip(states, emitted):
        n = len(row_emitted)
        if state.params.logprobs is None:
            out.append(None)
        else:
            k = state.params.logprobs + 1
            out.append([Logprobs(ids[i + j][:k], values[i + j][:k], ranks[i + j]) for j in range(n)])
        i += n
    return out
