"""Speculative decoding on the runner's side, under one owner: which rows speculate, their drafts, and
the verification of the drafts the scheduler placed after their real tokens.

The model runner holds one `Speculator` (when speculation is configured) and calls it twice a step:
`verify` on the target's logits of a step that carries drafts (the emitted tokens and, per row, how
many drafts were accepted: the scheduler rolls `num_computed_tokens` back over the others, once), and
`propose` once the step's tokens are known (the next step's drafts). The scheduler only places drafts
under its token budget and its `--speculative-max-batch` cap.
"""

from __future__ import annotations

import torch

from llmserve.sample.sampler import Sampler
from llmserve.spec.proposer import Proposer
from llmserve.spec.verify import Verified, verify
from llmserve.worker.input_batch import CachedRequestState


class Speculator:
    def __init__(self, proposer: Proposer) -> None:
        self.proposer = proposer

    def verify(self, sampler: Sampler, logits: torch.Tensor, rows: list[CachedRequestState],
               drafts: list[list[int]], vocab_size: int) -> Verified:
        """logits [N, V] at the expanded positions of `rows` (k_r + 1 each; k_r = len(drafts[r]))."""
        return verify(sampler, logits, rows, drafts, [row.draft_probs for row in rows], vocab_size)

    def propose(self, rows: list[CachedRequestState], may_speculate: bool) -> list[list[int]]:
        """Per row (each sampled this step): its drafts for the next step, [] where it does not
        speculate; a draft model's q stays on the row for `verify`."""
        for row in rows:
            row.draft_probs = None
        proposals: list[list[int]] = [[] for _ in rows]
        wanted = [i for i, row in enumerate(rows) if may_speculate and row.params.speculative]
        if not wanted:
            return proposals
        drafts, probs = self.proposer.propose([rows[i] for i in wanted])
        for i, row_drafts, row_probs in zip(wanted, drafts, probs):
            proposals[i] = row_drafts
            rows[i].draft_probs = row_probs
        return proposals
