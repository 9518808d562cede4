"""Verifying a step's draft tokens: the target's logits at k + 1 positions per row -> emitted tokens.

Each row with drafts d[0..k) is expanded into k + 1 sampling positions; position j samples as the
request would at output index n + j with d[:j] already appended (penalties, min_tokens and the
per-position seed all see that prefix). Rows without drafts are one position, as without speculation.
"""

from __future__ import annotations

import torch

from llmserve.engine.messages import Logprobs
from llmserve.sample.metadata import PositionRow, build_sampling_metadata
from llmserve.sample.rejection import accept_point_drafts, emit_from_rejection, rejection_sample
from llmserve.sample.sampler import Sampler, gather_logprobs
from llmserve.worker.input_batch import CachedRequestState
from llmserve.worker.seeds import position_seed


def expand_rows(states: list[CachedRequestState], drafts: list[list[int]],
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


def verify(sampler: Sampler, logits: torch.Tensor, states: list[CachedRequestState], drafts: list[list[int]],
           draft_probs: list[torch.Tensor | None], vocab_size: int) -> tuple[list[list[int]], list | None]:
    """logits [N, V] at the expanded positions; draft_probs per row: q [k, V] of a draft model's
    random drafts, or None (point-mass drafts: n-gram, greedy). Returns per row the emitted tokens
    and, where asked, their Logprobs."""
    rows = expand_rows(states, drafts, logits.device)
    meta = build_sampling_metadata(rows, vocab_size, logits.device)
    raw_logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None  # [N, V]
    has_q = not meta.all_greedy and any(q is not None for q in draft_probs)
    out = sampler(logits, meta, keep_probs=has_q)
    target_tokens = out.sampled_token_ids.tolist()  # [N]
    if not has_q:
        emitted = accept_point_drafts(target_tokens, drafts)
    else:
        emitted = _rejection(sampler, out.probs, target_tokens, rows, drafts, draft_probs)
    if raw_logprobs is None:
        return emitted, None
    return emitted, _logprobs(raw_logprobs, meta.max_num_logprobs, states, drafts, emitted)


def _rejection(sampler: Sampler, target_probs: torch.Tensor, target_tokens: list[int], rows: list[PositionRow],
               drafts: list[list[int]], draft_probs: list[torch.Tensor | None]) -> list[list[int]]:
    """Rows with q: the paper's rule; the others (greedy rows, point drafts): the target's token."""
    num_positions, vocab_size = target_probs.shape
    q = torch.zeros_like(target_probs)  # [N, V]
    draft_ids = torch.zeros(num_positions, dtype=torch.int64)  # [N]
    uses_q = torch.zeros(num_positions, dtype=torch.bool)  # [N]
    start = 0
    for row_drafts, row_q in zip(drafts, draft_probs):
        k = len(row_drafts)
        draft_ids[start:start + k] = torch.tensor(row_drafts, dtype=torch.int64)
        if row_q is not None and rows[start].params.temperature != 0.0:
            q[start:start + k] = row_q[:k]
            uses_q[start:start + k] = True
        start += k + 1
    uniforms, log_u = _draws(sampler, rows, num_positions, vocab_size, target_probs.device)
    is_accepted, fallback = rejection_sample(target_probs, q, draft_ids.to(q.device), uniforms, log_u)
    target = torch.tensor(target_tokens, dtype=torch.int64, device=q.device)
    uses_q = uses_q.to(q.device)
    is_accepted = torch.where(uses_q, is_accepted, draft_ids.to(q.device) == target)
    fallback = torch.where(uses_q, fallback, target)
    return emit_from_rejection(is_accepted.tolist(), fallback.tolist(), target_tokens, drafts)


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


def _logprobs(raw_logprobs: torch.Tensor, num_logprobs: int, states: list[CachedRequestState],
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
