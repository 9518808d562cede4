"""Speculative decoding on the runner's side, under one owner: which rows speculate, their drafts, and
the verification of the drafts the scheduler placed after their real tokens.

The model runner holds one `Speculator` (when speculation is configured) and calls it twice a step:
`verify` on the target's logits of a step that carries drafts (the emitted tokens and, per row, how
many drafts were accepted: the scheduler rolls `num_computed_tokens` back over the others, once), and
`propose` once the step's tokens are known (the next step's drafts, for the rows the rule picks:
spec.policy). Around a step it also times it (`begin_step` / `end_step`), so that the rule knows what
drafting and verifying cost. The scheduler only places drafts under its token budget and its
`--speculative-max-batch` cap.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmserve.sample.sampler import Sampler
from llmserve.spec.policy import SpeculationRule, StepCost
from llmserve.spec.proposer import Proposer, ProposerRow
from llmserve.spec.verify import Verified, verify


@dataclass
class _Step:
    """The step being timed."""

    num_rows: int
    num_spec_rows: int  # rows that verify drafts
    is_decode: bool  # no prompt tokens: a step the rule's costs describe
    started: float


class Speculator:
    def __init__(self, proposer: Proposer, rule: SpeculationRule,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.proposer = proposer
        self.rule = rule
        self.clock = clock
        self.step: _Step | None = None
        self.propose_s = 0.0  # the last proposing, paid for the drafts the next step verifies
        self.has_long_catch_up = False  # the last proposing caught the draft up on more than a step accepts
        self.num_proposed = 0  # rows it gave drafts

    def verify(self, sampler: Sampler, logits: torch.Tensor, rows: list[ProposerRow],
               drafts: list[list[int]], vocab_size: int) -> Verified:
        """logits [N, V] at the expanded positions of `rows` (k_r + 1 each; k_r = len(drafts[r]))."""
        verified = verify(sampler, logits, rows, drafts, [row.draft_probs for row in rows], vocab_size)
        for row, row_drafts, num_accepted in zip(rows, drafts, verified.num_accepted):
            if row_drafts:
                self.rule.observe_row(row.req_id, num_accepted)
        return verified

    def propose(self, rows: list[ProposerRow], num_rows: int, may_speculate: bool) -> list[list[int]]:
        """Per row (each sampled this step, of `num_rows`): its drafts for the next step, [] where it
        does not speculate; a draft model's q stays on the row for `verify`."""
        start = self.clock()
        for row in rows:
            row.draft_probs = None
        proposals: list[list[int]] = [[] for _ in rows]
        candidates = [i for i, row in enumerate(rows) if may_speculate and row.params.speculative]
        chosen = self.rule.choose([rows[i].req_id for i in candidates], num_rows) if candidates else []
        wanted = [i for i, is_chosen in zip(candidates, chosen) if is_chosen]
        self.has_long_catch_up = False
        if wanted:
            drafts, probs = self.proposer.propose([rows[i] for i in wanted])
            self.has_long_catch_up = self.proposer.max_catch_up > self.rule.num_speculative_tokens + 1
            for i, row_drafts, row_probs in zip(wanted, drafts, probs):
                proposals[i] = row_drafts
                rows[i].draft_probs = row_probs
        self.num_proposed = sum(bool(p) for p in proposals)
        self.propose_s = self.clock() - start
        return proposals

    def begin_step(self, num_rows: int, num_spec_rows: int, is_decode: bool) -> None:
        """A step that may speculate is launched (such steps run one at a time)."""
        self.step = _Step(num_rows, num_spec_rows, is_decode, self.clock())

    def end_step(self) -> None:
        """Its tokens are known (before proposing the next drafts): the rule learns its cost, with the
        proposing of the drafts it verified. A decode step that verified none after drafts were
        proposed (the scheduler dropped them) says nothing clear and is skipped."""
        step, self.step = self.step, None
        if step is None or not step.is_decode or (step.num_spec_rows == 0 and self.num_proposed):
            return
        seconds = self.clock() - step.started + self.propose_s
        self.rule.observe_step(StepCost(step.num_rows, step.num_spec_rows, seconds, self.propose_s,
                                        self.has_long_catch_up))

    def forget(self, req_ids) -> None:
        self.rule.forget(req_ids)
        self.proposer.forget(req_ids)
