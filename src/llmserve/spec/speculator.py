"""Speculative decoding on the runner's side, under one owner: which rows speculate, their drafts, and
the verification of the drafts the scheduler placed after their real tokens.

The model runner holds one `Speculator` (when speculation is configured) and calls it twice a step:
`verify` on the target's logits of a step that carries drafts (the emitted tokens and, per row, how
many drafts were accepted: the scheduler rolls `num_computed_tokens` back over the others, once), and
`propose` once the step's tokens are known (the next step's drafts, for the rows the rule picks:
spec.policy). Around a step it also times it (`begin_step` / `end_step`), so that the rule knows what
drafting and verifying cost. The scheduler only places drafts under its token budget and its
`--speculative-max-batch` cap.

When every row of a verification step carries k drafts and the rule would have each propose again, a
proposer that can (a draft model with its graphs: spec.draft_chain) queues the next proposal on the
device right behind the verification, before the host waits for the target's tokens: one wait for both,
and no host work between the two on the device's clock. The rule's choice for the next step is then
made at verification (from the acceptance measured up to the step before) and kept for `propose`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from llmserve.sample import ops
from llmserve.sample.sampler import Sampler
from llmserve.spec.draft_chain import VerifiedStep
from llmserve.spec.policy import SpeculationRule, StepCost
from llmserve.spec.proposer import Proposer, ProposerRow
from llmserve.spec.verify import Verified, verify, verify_greedy_ids


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
        self.early_choice: tuple[list[str], list[bool]] | None = None  # the rule's choice made at verification

    def verify(self, sampler: Sampler, logits: torch.Tensor, rows: list[ProposerRow], drafts: list[list[int]],
               vocab_size: int, step: VerifiedStep | None = None, may_speculate: bool = False) -> Verified:
        """logits [N, V] at the expanded positions of `rows` (k_r + 1 each; k_r = len(drafts[r])); `step`: the
        step's tokens, positions and blocks on the device when it holds only these rows (target unset), and
        `may_speculate` whether they may propose after it (as `propose` will be told)."""
        if step is not None and self._can_propose_early(rows, drafts, step, may_speculate):
            target = ops.argmax_rows(logits)  # [N]: what greedy verification takes at each position
            self.proposer.propose_early(rows, replace(step, target=target))
            verified = verify_greedy_ids(target.tolist(), drafts)
        else:
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
        chosen = self._choose([rows[i].req_id for i in candidates], num_rows)
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

    def _can_propose_early(self, rows: list[ProposerRow], drafts: list[list[int]], step: VerifiedStep,
                           may_speculate: bool) -> bool:
        """Every row verifies k drafts, all will propose again (the rule's choice, kept), and the proposer
        can queue it on the device."""
        k = self.rule.num_speculative_tokens
        if not may_speculate or any(len(d) != k for d in drafts):
            return False
        if step.input_ids.shape[0] != len(rows) * (k + 1) or not all(row.params.speculative for row in rows):
            return False
        if not self.proposer.can_propose_early(rows, step.block_table.shape[1]):
            return False  # the rule chooses at `propose`, as without queued proposals
        req_ids = [row.req_id for row in rows]
        self.early_choice = req_ids, self.rule.choose(req_ids, len(rows))
        return all(self.early_choice[1])

    def _choose(self, req_ids: list[str], num_rows: int) -> list[bool]:
        """The rule's choice for these candidates: the one made at verification when it was for them."""
        early, self.early_choice = self.early_choice, None
        if early is not None and early[0] == req_ids:
            return early[1]
        return self.rule.choose(req_ids, num_rows) if req_ids else []

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

    def observe_window(self, num_rows: int, num_forwards: int, seconds: float) -> None:
        """A plain multi-step window ran (worker/decode_window.py): plain decoding's cost a forward there."""
        self.rule.observe_window(num_rows, num_forwards, seconds)

    def wants_features(self, rows: list[ProposerRow]) -> bool:
        """Whether a target forward over these rows hands its features to the proposer (EAGLE: spec/eagle.py). Not
        when the step has more rows than may speculate: those rows' kept features are dropped instead, and their
        heads miss these positions (the head's KV there stays stale: acceptance after a busy spell, never
        correctness). So a large batch builds no features, pays no per-row copies, and no memory holds features
        that no proposal would read."""
        if len(rows) <= self.rule.max_batch:
            return True
        self.proposer.drop_features(rows)
        return False

    def forget(self, req_ids) -> None:
        self.rule.forget(req_ids)
        self.proposer.forget(req_ids)
