"""Batched logit processors and the draw: penalties, top-k / top-p / min-p filters, exponential race.

Functions work in place on float32 logits [B, V] where they can. Branches are decided by host
values carried in SamplingMetadata, so nothing syncs with the device, except the CPU-only top-p
path (where a sync is free).
"""

from __future__ import annotations

import numpy as np
import torch

from llmserve.model import cpu_kernels
from llmserve.sample.metadata import PenaltyMetadata

_NEG_INF = float("-inf")
_TINY = torch.finfo(torch.float32).tiny


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] int64: each row's first maximum (torch.argmax's tie rule). On the CPU numpy's
    argmax, faster than torch's for a few hundred rows, with no OpenMP threads to wake (docs/benchmarks.md,
    "Figures behind choices in the code")."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        return torch.from_numpy(logits.numpy().argmax(axis=-1).astype(np.int64, copy=False))
    return logits.argmax(dim=-1)


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest logits and their ids, descending ([B, k] each): on CPU one pass over each row in C++
    (model/csrc/sampling_ops.cpp; ties by the lower id), elsewhere torch.topk."""
    if cpu_kernels.samples_on_cpu(logits):
        return cpu_kernels.top_k_rows(logits, k)
    return logits.topk(k, dim=-1)


def apply_sparse_bias(logits: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """logits[row, token] += value for each (row, token) in indices [2, N]; values [N]."""
    logits.index_put_((indices[0], indices[1]), values, accumulate=True)


def apply_penalties(logits: torch.Tensor, penalties: PenaltyMetadata) -> None:
    """Repetition (HF: prompt + output), then frequency and presence (OpenAI: output only). On CPU one C++
    op (model/csrc/sampling_ops.cpp) with the same arithmetic: the torch version is a dozen ops."""
    if cpu_kernels.samples_on_cpu(logits) and penalties.output_token_ids.stride(-1) == 1:
        cpu_kernels.apply_penalties_(logits, penalties.row_indices, penalties.repetition_penalties,
                                     penalties.frequency_penalties, penalties.presence_penalties,
                                     penalties.output_token_ids, penalties.prompt_token_ids,
                                     penalties.has_output_penalties)
        return
    apply_penalties_torch(logits, penalties)


def apply_penalties_torch(logits: torch.Tensor, penalties: PenaltyMetadata) -> None:
    """apply_penalties in torch ops (any device). Works on the tokens each row has seen ([P, L] gathers and one
    scatter), not on [P, V]: a row's repeats of one id read and write the same value, so duplicates in the
    scatter agree."""
    num_tokens = logits.shape[1]
    seen = penalties.output_token_ids
    if penalties.prompt_token_ids is not None:
        seen = torch.cat([penalties.prompt_token_ids, seen], dim=1)  # [P, L]
    ids, has_seen = _pad_with_own_ids(seen, num_tokens)  # [P, L], [P, 1]
    rows = penalties.row_indices.unsqueeze(1)  # [P, 1]
    seen_logits = logits[rows, ids]  # [P, L]
    penalized = seen_logits
    if penalties.prompt_token_ids is not None:
        scale = penalties.repetition_penalties.unsqueeze(1)  # [P, 1]
        # Divide positive logits, multiply negative ones: both make a seen token less likely.
        penalized = torch.where(penalized > 0, penalized / scale, penalized * scale)
    if penalties.has_output_penalties:
        counts = token_counts(penalties.output_token_ids, num_tokens).gather(1, ids)  # [P, L]
        penalized = (penalized - penalties.frequency_penalties.unsqueeze(1) * counts
                     - penalties.presence_penalties.unsqueeze(1) * (counts > 0))
    logits[rows, ids] = torch.where(has_seen, penalized, seen_logits)


def _pad_with_own_ids(padded_token_ids: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[P, L] ids padded with pad_id -> the same with each pad replaced by the row's first id (a repeat,
    harmless to a scatter of per-id values), or by 0 in a row with no ids; and [P, 1] has-any-id."""
    is_real = padded_token_ids != pad_id  # [P, L]
    has_any = is_real.any(dim=1, keepdim=True)  # [P, 1]
    first = padded_token_ids.gather(1, is_real.to(torch.uint8).argmax(dim=1, keepdim=True))  # [P, 1]
    first = torch.where(has_any, first, 0)
    return torch.where(is_real, padded_token_ids, first), has_any


def token_counts(padded_token_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[P, L] int64 ids padded with num_tokens -> [P, num_tokens] float32 occurrence counts."""
    num_rows = padded_token_ids.shape[0]
    counts = torch.zeros(num_rows, num_tokens + 1, dtype=torch.float32, device=padded_token_ids.device)
    ones = torch.ones_like(padded_token_ids, dtype=torch.float32)
    counts.scatter_add_(1, padded_token_ids, ones)
    return counts[:, :num_tokens]


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask to -inf the tokens outside each row's top-k, then outside its top-p nucleus.

    top_k [B] int64 (vocab_size where off), top_p [B] float32 (1.0 where off). Returns the
    filtered logits (the input modified in place, except on the sorted path).
    """
    if top_p is None:
        if top_k is not None:
            apply_top_k_only(logits, top_k, max_top_k)
        return logits
    if logits.device.type != "cpu":
        return apply_top_k_top_p_sorted(logits, top_k, top_p)
    # CPU sorts of a vocabulary-wide row are slow: top-k with topk, then top-p sorting only the
    # candidates. Their count is a host sync, free on CPU.
    if top_k is not None:
        apply_top_k_only(logits, top_k, max_top_k)
    apply_top_p_on_candidates(logits, top_p)
    return logits


def apply_top_k_top_p_sorted(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """Both filters with one full sort and no host sync (the GPU path)."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [B, V] each
    if top_k is not None:
        positions = torch.arange(logits.shape[1], device=logits.device)  # [V]
        sorted_logits.masked_fill_(positions.unsqueeze(0) >= top_k.unsqueeze(1), _NEG_INF)
    apply_top_p_sorted(sorted_logits, top_p)
    return logits.scatter_(1, sorted_ids, sorted_logits)


def apply_top_p_sorted(sorted_logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """Top-p on logits already sorted descending [B, N]: mask what lies outside each row's nucleus."""
    probs = sorted_logits.softmax(dim=-1)  # [B, N]
    sorted_logits.masked_fill_(_is_outside_nucleus(probs, top_p), _NEG_INF)


def apply_top_p_on_candidates(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """Top-p sorting only the tokens that can be in a nucleus (a host sync: for CPU).

    Tokens below (1 - top_p) / V hold less than 1 - top_p together, so the tokens above them hold
    more than top_p and each of them ranks below that mass: outside the nucleus.
    """
    num_tokens = logits.shape[1]
    probs = logits.softmax(dim=-1)  # [B, V]
    is_on = (top_p < 1.0).unsqueeze(1)  # [B, 1]
    min_probs = torch.where(is_on, (1.0 - top_p.unsqueeze(1)) / num_tokens, 0.0)  # [B, 1]
    is_dropped = probs < min_probs  # [B, V]; nothing in rows without top-p
    num_candidates = num_tokens - torch.count_nonzero(is_dropped, dim=-1)  # [B]
    num_candidates = int(num_candidates.masked_fill_(~is_on.squeeze(1), 0).max())
    top_probs, top_ids = probs.topk(num_candidates, dim=-1)  # [B, num_candidates], descending
    is_dropped.scatter_(1, top_ids, _is_outside_nucleus(top_probs, top_p))
    logits.masked_fill_(is_dropped, _NEG_INF)


def _is_outside_nucleus(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """sorted_probs [B, N] descending -> [B, N] bool: the tokens ranked above hold >= top_p.

    The best token is always kept; rows with top_p >= 1 keep everything (despite rounding).
    """
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs  # [B, N]
    threshold = top_p.masked_fill(top_p >= 1.0, float("inf")).unsqueeze(1)  # [B, 1]
    return mass_above >= threshold


def apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> None:
    """Top-k without a full sort: one topk(max_top_k), then a per-row threshold. Ties at the
    threshold are all kept."""
    top_values = logits.topk(max_top_k, dim=-1).values  # [B, max_top_k], descending
    is_off = top_k > max_top_k  # [B]: rows without top-k carry vocab_size
    threshold = _kth_value(top_values, top_k).masked_fill_(is_off.unsqueeze(1), _NEG_INF)  # [B, 1]
    logits.masked_fill_(logits < threshold, _NEG_INF)


def _kth_value(sorted_values: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """sorted_values [B, K] descending -> [B, 1]: each row's top_k-th value (the last one when top_k > K)."""
    return sorted_values.gather(1, (top_k.clamp(max=sorted_values.shape[1]) - 1).unsqueeze(1))


def apply_top_k_sorted(sorted_logits: torch.Tensor, top_k: torch.Tensor) -> None:
    """Top-k on logits already sorted descending [B, K] (K >= every row's top_k, or vocab_size where off):
    mask what ranks below each row's k-th value (ties with it are kept, as in apply_top_k_only)."""
    sorted_logits.masked_fill_(sorted_logits < _kth_value(sorted_logits, top_k), _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Mask tokens whose probability is below min_p [B] times the row's top probability."""
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [B, 1]
    logits.masked_fill_(probs < threshold, _NEG_INF)


def exponential_race(
    probs: torch.Tensor, generators: dict[int, torch.Generator], generator: torch.Generator | None
) -> torch.Tensor:
    """Sample one token per row: argmax(probs / E) with E ~ Exponential(1) i.i.d. per token.

    Seeded rows draw their noise from their own generator (reproducible whatever the batch);
    the other rows share one batched draw from `generator` (None: torch's default). probs [B, V]
    is overwritten. Returns [B] int64.
    """
    # E = -log(U), U ~ Uniform[tiny, 1); keep log(U) < 0: argmax probs/E == argmin probs/log(U).
    # (Faster than exponential_() on CPU. U >= tiny keeps log(U) finite and nonzero, so every
    # token with probs > 0 scores strictly below the filtered ones, which score -0.0.)
    log_u = uniform_noise(probs.shape, probs.device, generators, generator).log_()  # [B, V]
    return probs.div_(log_u).argmin(dim=-1)


def exponential_race_on_candidates(probs: torch.Tensor, cand_ids: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """exponential_race when only the candidates cand_ids [B, K] can win (probs [B, K]), with their noise [B, K]
    (`candidate_noise`; overwritten)."""
    return cand_ids.gather(1, probs.div_(noise.log_()).argmin(dim=-1, keepdim=True)).squeeze(1)


def candidate_noise(cand_ids: torch.Tensor, vocab_size: int, generators: dict[int, torch.Generator],
                    generator: torch.Generator | None) -> torch.Tensor:
    """U ~ Uniform[tiny, 1) [B, K] for the candidates cand_ids [B, K]. Unseeded rows draw noise for their K
    candidates alone; a seeded row draws its whole [V] row, as on the full path, and reads it at its candidates,
    so its tokens do not depend on which path its batch took."""
    noise = torch.empty(cand_ids.shape, dtype=torch.float32, device=cand_ids.device)  # [B, K]
    if len(generators) < noise.shape[0]:
        noise.uniform_(_TINY, 1.0, generator=generator)
    for row, row_generator in generators.items():
        row_noise = torch.empty(vocab_size, dtype=torch.float32, device=cand_ids.device)  # [V]
        noise[row] = row_noise.uniform_(_TINY, 1.0, generator=row_generator)[cand_ids[row]]
    return noise


def uniform_noise(shape: tuple[int, int], device: torch.device, generators: dict[int, torch.Generator],
                   generator: torch.Generator | None) -> torch.Tensor:
    """U ~ Uniform[tiny, 1) [B, V]: seeded rows from their own generator, the others from one batched draw."""
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    if len(generators) < shape[0]:
        noise.uniform_(_TINY, 1.0, generator=generator)
    _fill_seeded_rows(noise, generators)
    return noise


def seeded_noise(shape: tuple[int, int], device: torch.device,
                 generators: dict[int, torch.Generator]) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """U ~ Uniform[tiny, 1) [B, V] for the seeded rows alone (as `uniform_noise` draws them; the other rows unset),
    and which rows those are [B] bool; (None, None) when no row is seeded."""
    if not generators:
        return None, None
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    _fill_seeded_rows(noise, generators)
    is_seeded = torch.zeros(shape[0], dtype=torch.bool, device=device)
    is_seeded[list(generators)] = True
    return noise, is_seeded


def _fill_seeded_rows(noise: torch.Tensor, generators: dict[int, torch.Generator]) -> None:
    for row, row_generator in generators.items():
        noise[row].uniform_(_TINY, 1.0, generator=row_generator)
