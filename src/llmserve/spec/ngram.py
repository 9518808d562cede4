"""Prompt-lookup (n-gram) proposer: find the latest earlier occurrence of the sequence's last n tokens
and propose the tokens that followed it. No model, numpy only: a few array ops per row."""

from __future__ import annotations

import numpy as np

from llmserve.spec.proposer import ProposerRow


def propose_ngram(token_ids: np.ndarray, num_tokens: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to `num_tokens` tokens that followed the most recent earlier match of the longest suffix
    (at least `ngram_min`, at most `ngram_max` tokens long) of `token_ids` [L]; [] if none matches."""
    length = len(token_ids)
    if length < ngram_min + 1:
        return []
    ends = np.flatnonzero(token_ids[:-1] == token_ids[-1])  # [C] candidate match ends, before the last token
    if ends.size == 0:
        return []
    match_len = np.ones(ends.size, dtype=np.int64)  # [C]
    is_matching = np.ones(ends.size, dtype=bool)  # [C]
    for back in range(1, min(ngram_max, length - 1)):
        is_matching &= ends >= back
        is_matching[is_matching] = token_ids[ends[is_matching] - back] == token_ids[length - 1 - back]
        match_len += is_matching
    best = int(match_len.max())
    if best < ngram_min:
        return []
    start = int(ends[np.flatnonzero(match_len == best)[-1]]) + 1  # the most recent of the longest
    return token_ids[start:start + num_tokens].tolist()


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, ngram_min: int, ngram_max: int) -> None:
        self.k = num_speculative_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, rows: list[ProposerRow]) -> tuple[list[list[int]], list[None]]:
        """Per row (its prompt + output so far): the drafts for the next step; point masses (no q)."""
        drafts = [propose_ngram(np.asarray(row.token_ids, dtype=np.int64), self.k, self.ngram_min, self.ngram_max)
                  for row in rows]
        return drafts, [None] * len(rows)
