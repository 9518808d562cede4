"""Batched sampling inputs, built once per step from the model runner's per-request rows.

Every optional tensor is None when no row of the batch needs it, so the common paths (all greedy,
or plain temperature / top-p sampling) skip the work entirely. Everything the sampler needs to
branch on (flags, max_top_k, max_num_logprobs) is a host value: the sampler never syncs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from llmserve.sampling_params import SamplingParams


class SamplingRow(Protocol):
    """What the model runner keeps per request (read only here)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # from params.seed, on the logits' device; None if unseeded
    stop_token_ids_for_min_tokens: list[int]  # eos + stop ids, masked while output < min_tokens

    @property
    def num_output_tokens(self) -> int:
        """Output tokens so far (async scheduling: with the ones still on the device)."""


@dataclass
class PositionRow:
    """A SamplingRow built for one sampling position (speculative decoding: a request at output index
    n + j, with j draft tokens already appended)."""

    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    stop_token_ids_for_min_tokens: list[int] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


@dataclass
class PenaltyMetadata:
    """Penalties of the rows that use any (P of the B rows); token ids padded with vocab_size."""

    row_indices: torch.Tensor  # [P] int64, rows of the batch
    repetition_penalties: torch.Tensor  # [P] float32, 1.0 = off
    frequency_penalties: torch.Tensor  # [P] float32, 0.0 = off
    presence_penalties: torch.Tensor  # [P] float32, 0.0 = off
    output_token_ids: torch.Tensor  # [P, max_output_len] int64
    prompt_token_ids: torch.Tensor | None  # [P, max_prompt_len] int64; None when no repetition penalty
    has_output_penalties: bool  # any frequency or presence penalty (they need output token counts)


@dataclass
class SamplingMetadata:
    vocab_size: int  # V: logits have this many columns; token ids are padded with it
    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor | None = None  # [B] float32, 1.0 in greedy rows; None when all greedy
    is_greedy: torch.Tensor | None = None  # [B] bool; None unless greedy and random rows are mixed
    top_k: torch.Tensor | None = None  # [B] int64, vocab_size where off; None when no row uses it
    max_top_k: int = 0  # largest top_k among the rows using it
    is_top_k_everywhere: bool = False  # every random row has a top_k: sampling can work on max_top_k candidates
    top_p: torch.Tensor | None = None  # [B] float32, 1.0 where off
    min_p: torch.Tensor | None = None  # [B] float32, 0.0 where off
    # Additive sparse updates: logit_bias entries, and -inf on eos/stop ids while output < min_tokens.
    sparse_bias_indices: torch.Tensor | None = None  # [2, N] int64 (row, token)
    sparse_bias_values: torch.Tensor | None = None  # [N] float32
    penalties: PenaltyMetadata | None = None
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # random seeded rows
    max_num_logprobs: int | None = None  # largest `logprobs` asked for; None when no row asks

    @property
    def no_top_k(self) -> bool:
        return self.top_k is None

    @property
    def no_top_p(self) -> bool:
        return self.top_p is None

    @property
    def no_min_p(self) -> bool:
        return self.min_p is None

    @property
    def no_penalties(self) -> bool:
        return self.penalties is None


def build_sampling_metadata(
    rows: list[SamplingRow], vocab_size: int, device: torch.device | str, with_penalties: bool = True
) -> SamplingMetadata:
    """Batch the rows' sampling parameters into tensors on `device` (no work for unused features).
    `with_penalties=False` leaves `penalties` to the caller (the runner keeps their tokens on the device)."""
    assert rows, "no rows to sample"
    device = torch.device(device)
    params = [row.params for row in rows]
    is_greedy = [p.temperature == 0.0 for p in params]
    num_greedy = sum(is_greedy)
    meta = SamplingMetadata(vocab_size, all_greedy=num_greedy == len(rows), all_random=num_greedy == 0)
    if not meta.all_greedy:
        _fill_random_params(meta, params, is_greedy, vocab_size, device)
        meta.generators = {i: row.generator for i, row in enumerate(rows)
                           if row.generator is not None and not is_greedy[i]}
    _fill_sparse_bias(meta, rows, vocab_size, device)
    if with_penalties:
        meta.penalties = _build_penalties(rows, vocab_size, device)
    num_logprobs = [p.logprobs for p in params if p.logprobs is not None]
    meta.max_num_logprobs = max(num_logprobs) if num_logprobs else None
    return meta


def _fill_random_params(
    meta: SamplingMetadata, params: list[SamplingParams], is_greedy: list[bool], vocab_size: int,
    device: torch.device,
) -> None:
    """Temperature and the top-k / top-p / min-p filters; greedy rows get neutral values."""
    temperature = [1.0 if greedy else p.temperature for p, greedy in zip(params, is_greedy)]
    meta.temperature = to_device(temperature, torch.float32, device)
    if not meta.all_random:
        meta.is_greedy = to_device(is_greedy, torch.bool, device)
    random_params = [p for p, greedy in zip(params, is_greedy) if not greedy]
    top_k = [_effective_top_k(p, greedy, vocab_size) for p, greedy in zip(params, is_greedy)]
    if any(k < vocab_size for k in top_k):
        meta.top_k = to_device(top_k, torch.int64, device)
        meta.max_top_k = max(k for k in top_k if k < vocab_size)
        meta.is_top_k_everywhere = all(k < vocab_size for k, g in zip(top_k, is_greedy) if not g)
    if any(p.top_p < 1.0 for p in random_params):
        meta.top_p = to_device([1.0 if g else p.top_p for p, g in zip(params, is_greedy)], torch.float32, device)
    if any(p.min_p > 0.0 for p in random_params):
        meta.min_p = to_device([0.0 if g else p.min_p for p, g in zip(params, is_greedy)], torch.float32, device)


def _effective_top_k(params: SamplingParams, is_greedy: bool, vocab_size: int) -> int:
    """top_k as a count of kept tokens: vocab_size when off (0, -1, >= vocab, or a greedy row)."""
    if is_greedy or params.top_k <= 0:
        return vocab_size
    return min(params.top_k, vocab_size)


def _fill_sparse_bias(
    meta: SamplingMetadata, rows: list[SamplingRow], vocab_size: int, device: torch.device
) -> None:
    """Collect logit_bias entries and min_tokens masks as one sparse additive update."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for i, row in enumerate(rows):
        params = row.params
        if params.logit_bias:
            row_ids.extend([i] * len(params.logit_bias))
            token_ids.extend(params.logit_bias.keys())
            values.extend(params.logit_bias.values())
        if params.min_tokens and row.num_output_tokens < params.min_tokens:
            masked = row.stop_token_ids_for_min_tokens
            row_ids.extend([i] * len(masked))
            token_ids.extend(masked)
            values.extend([float("-inf")] * len(masked))
    if not row_ids:
        return
    assert max(token_ids) < vocab_size, "token ids must be checked by SamplingParams.validate_for_vocab"
    meta.sparse_bias_indices = to_device([row_ids, token_ids], torch.int64, device)
    meta.sparse_bias_values = to_device(values, torch.float32, device)


def _uses_penalties(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0)


def _build_penalties(rows: list[SamplingRow], vocab_size: int, device: torch.device) -> PenaltyMetadata | None:
    indices = [i for i, row in enumerate(rows) if _uses_penalties(row.params)]
    if not indices:
        return None
    params = [rows[i].params for i in indices]
    repetition = [p.repetition_penalty for p in params]
    prompt_ids = None
    if any(r != 1.0 for r in repetition):
        prompts = [rows[i].prompt_token_ids if p.repetition_penalty != 1.0 else []
                   for i, p in zip(indices, params)]
        prompt_ids = _padded(prompts, vocab_size, device)
    return PenaltyMetadata(
        row_indices=to_device(indices, torch.int64, device),
        repetition_penalties=to_device(repetition, torch.float32, device),
        frequency_penalties=to_device([p.frequency_penalty for p in params], torch.float32, device),
        presence_penalties=to_device([p.presence_penalty for p in params], torch.float32, device),
        output_token_ids=_padded([rows[i].output_token_ids for i in indices], vocab_size, device),
        prompt_token_ids=prompt_ids,
        has_output_penalties=any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params),
    )


def _padded(token_lists: list[list[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), max_len] int64, right-padded with pad_id (at least one column)."""
    max_len = max(1, max(len(ids) for ids in token_lists))
    padded = [ids + [pad_id] * (max_len - len(ids)) for ids in token_lists]
    return to_device(padded, torch.int64, device)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host list -> tensor on device; pinned + non_blocking on CUDA so the host never waits (numpy arrays:
    model.paged_indices.on_device)."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    is_cuda = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=is_cuda).to(device, non_blocking=is_cuda)
