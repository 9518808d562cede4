"""Prompt-lookup (n-gram) proposer: find the latest earlier occurrence of the sequence's last n tokens
and propose the tokens that followed it. No model, numpy only: a few array ops per row, on a token
array per request that grows with its new tokens (never rebuilt from the Python list)."""

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


class TokenArray:
    """A request's prompt + output as an int64 array that only grows: each sync copies the new tokens."""

    def __init__(self) -> None:
        self.array = np.empty(0, dtype=np.int64)  # [capacity]
        self.length = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """token_ids: the request's tokens so far (the ones synced before are a prefix). Returns [L]."""
        num = len(token_ids)
        if num > self.array.size:
            grown = np.empty(max(num, 2 * self.array.size, 64), dtype=np.int64)
            grown[:self.length] = self.array[:self.length]
            self.array = grown
        if num > self.length:
            self.array[self.length:num] = token_ids[self.length:num]
        self.length = num
        return self.array[:num]


class NgramProposer:
    max_catch_up = 0  # no model to catch up
    needs_target_features = False

    def __init__(self, num_speculative_tokens: int, ngram_min: int, ngram_max: int) -> None:
        self.k = num_speculative_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.tokens: dict[str, TokenArray] = {}  # req_id -> its tokens as an array

    def propose(self, rows: list[ProposerRow]) -> tuple[list[list[int]], list[None]]:
        """Per row (its prompt + output so far): the drafts for the next step; point masses (no q)."""
        drafts = [propose_ngram(self._array(row), self.k, self.ngram_min, self.ngram_max) for row in rows]
        return drafts, [None] * len(rows)

    def can_propose_early(self, rows: list[ProposerRow], num_block_columns: int) -> bool:
        return False  # its lookups read the accepted tokens on the host

    def propose_early(self, rows: list[ProposerRow], step) -> None:
        raise NotImplementedError("n-gram drafts are proposed on the host")

    def _array(self, row: ProposerRow) -> np.ndarray:
        tokens = self.tokens.get(row.req_id)
        if tokens is None:
            tokens = self.tokens[row.req_id] = TokenArray()
        return tokens.sync(row.token_ids)

    def forget(self, req_ids) -> None:
        """Finished or preempted requests: their arrays go (a resumed one starts a new array)."""
        for req_id in req_ids:
            self.tokens.pop(req_id, None)
