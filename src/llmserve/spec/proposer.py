"""The proposer interface: the model runner asks for the next step's drafts after sampling."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from llmserve.sampling_params import SamplingParams


class ProposerRow(Protocol):
    """What a proposer reads (and the draft model updates) of the runner's per-request state
    (worker.input_batch.CachedRequestState), and what verification reads of it."""

    req_id: str
    params: SamplingParams
    token_ids: np.ndarray  # [L] prompt + output so far (a view: read it, do not keep it)
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # a new list per read
    stop_token_ids_for_min_tokens: list[int]
    block_ids: list[int]
    num_draft_computed: int
    is_plain_greedy: bool  # greedy with nothing else applied: its drafts are the draft model's argmax
    draft_probs: torch.Tensor | None  # [k, V] q of the drafts proposed last step (draft model), for verify


class Proposer(Protocol):
    max_catch_up: int  # the most real tokens a row's draft model caught up on in the last proposal (n-gram: 0)
    needs_target_features: bool  # EAGLE heads read the target's hidden states: `take_features` after each forward

    def propose(self, rows: list[ProposerRow]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Per row: draft tokens (at most k, possibly none) and their distribution q [k, V] when they
        were sampled from one (None: point-mass drafts, verified by agreement with the target)."""
        ...

    def can_propose_early(self, rows: list[ProposerRow], num_block_columns: int) -> bool:
        """Whether `propose_early` can queue these rows' next proposal on the device behind their
        verification (each row k drafts; the step's block table has `num_block_columns` columns)."""
        ...

    def propose_early(self, rows: list[ProposerRow], step) -> None:
        """Queue it (spec.draft_chain.VerifiedStep `step`); the next `propose` of the same rows returns it."""
        ...

    def take_features(self, rows: list[ProposerRow], starts: np.ndarray, counts: np.ndarray,
                      features: torch.Tensor) -> None:
        """A target forward's features [T, F] of its rows, row i's counts[i] tokens from position starts[i] (only
        where needs_target_features)."""
        ...

    def drop_features(self, rows: list[ProposerRow]) -> None:
        """These rows' step handed no features over: drop what is kept of theirs (only where needs_target_features)."""
        ...

    def forget(self, req_ids) -> None:
        """The requests finished or were preempted: drop what is kept for them."""
        ...
