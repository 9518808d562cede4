"""The oracle draft of `llmserve bench spec` (`oracle=A`): a draft of known cost and known acceptance.

It runs a real draft model for its cost, then proposes the target's greedy continuation of the
request, each token kept with probability A and replaced by a wrong one otherwise: with greedy
verification every proposed token is accepted with probability A (Leviathan's α).

"The target's greedy continuation" must be the speculative engine's own: in bf16 a plain engine's
continuation departs from it after the first rounding difference (k + 1 tokens a forward sum in another
order), and an oracle that kept proposing the plain engine's tokens would be rejected from there on.
So the reference follows the speculative engine's accepted prefix: when a request's output departs
from its reference, or runs past it, the reference is continued from that output by a plain greedy
engine (`continue_greedy`), for a window of tokens. The seconds this takes are counted in
`rebase_s`, for the benchmark to leave out of its timings.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

ContinueGreedy = Callable[[list[int], int], list[int]]  # (context, num_tokens) -> greedy continuation


class OracleDraft:
    def __init__(self, inner, reference: dict[tuple[int, ...], list[int]], agreement: float, vocab_size: int,
                 seed: int, continue_greedy: ContinueGreedy | None = None, max_output: int = 1 << 30,
                 window: int = 32) -> None:
        """reference: prompt -> a greedy continuation (the plain engine's), extended in place here."""
        self.inner = inner
        self.vocab_size = vocab_size
        self.reference = reference
        self.agreement = agreement
        self.rng = random.Random(seed)
        self.continue_greedy = continue_greedy
        self.max_output = max_output
        self.window = window
        self.num_rebases = 0
        self.rebase_s = 0.0

    @property
    def max_catch_up(self) -> int:
        return self.inner.max_catch_up

    @property
    def needs_target_features(self) -> bool:
        return self.inner.needs_target_features

    def take_features(self, rows, starts, counts, features) -> None:
        self.inner.take_features(rows, starts, counts, features)  # an EAGLE head's, for its cost

    def drop_features(self, rows) -> None:
        self.inner.drop_features(rows)

    def check_integrity(self, req_ids: set[str]) -> None:
        self.inner.check_integrity(req_ids)

    def can_propose_early(self, rows, num_block_columns: int) -> bool:
        return self.inner.can_propose_early(rows, num_block_columns)

    def propose_early(self, rows, step) -> None:
        self.inner.propose_early(rows, step)

    def propose(self, rows):
        drafts, _ = self.inner.propose(rows)  # the draft model's cost
        out = []
        for row, row_drafts in zip(rows, drafts):
            truth = self._truth(row.prompt_token_ids, row.output_token_ids, len(row_drafts))
            out.append([t if self.rng.random() < self.agreement else (t + 1) % self.vocab_size for t in truth])
        return out, [None] * len(rows)

    def forget(self, req_ids) -> None:
        self.inner.forget(req_ids)

    def _truth(self, prompt: list[int], output: list[int], num: int) -> list[int]:
        """The target's next `num` greedy tokens after `output`, as the reference has them."""
        key = tuple(prompt)
        ref = self.reference.get(key, [])
        start = len(output)
        num = min(num, self.max_output - start)
        is_stale = ref[:start] != output or len(ref) < start + num
        if self.continue_greedy is not None and num > 0 and is_stale:
            num_more = min(max(num, self.window), self.max_output - start)
            ref = self.reference[key] = output + self._continue(prompt + output, num_more)
        return ref[start:start + num]

    def _continue(self, context: list[int], num: int) -> list[int]:
        began = time.perf_counter()
        tokens = self.continue_greedy(context, num)
        self.num_rebases += 1
        self.rebase_s += time.perf_counter() - began
        return tokens
