"""Prompt-lookup (n-gram) proposer: which earlier occurrence is matched, and what is proposed."""

from dataclasses import dataclass

import numpy as np
import pytest

from llmserve.spec.ngram import NgramProposer, propose_ngram


def propose(tokens: list[int], k: int = 3, ngram_min: int = 1, ngram_max: int = 4) -> list[int]:
    return propose_ngram(np.array(tokens, dtype=np.int64), k, ngram_min, ngram_max)


def reference(tokens: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Straight from the definition: the longest suffix (ngram_max down to ngram_min) that occurs
    earlier, ending before the last token; its most recent occurrence; the k tokens after it."""
    length = len(tokens)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        if n <= 0:
            break
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):  # occurrences ending at length - 2 at the latest
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_longest_suffix_wins_over_a_more_recent_shorter_match():
    # suffix [2, 3]: "2 3" at 1..2 (followed by 9 5 3); "3" alone at 5 is more recent (followed by 7)
    tokens = [1, 2, 3, 9, 5, 3, 7, 2, 3]
    assert propose(tokens) == [9, 5, 3]


def test_most_recent_of_equally_long_matches():
    # "1 2" at 0..1 (followed by 7) and at 3..4 (followed by 8)
    assert propose([1, 2, 7, 1, 2, 8, 1, 2], k=2) == [8, 1]


@pytest.mark.parametrize("tokens", [[1, 2, 3, 4], [5], [], [4, 5, 6]], ids=["distinct", "one", "empty", "no-repeat"])
def test_no_match_proposes_nothing(tokens):
    assert propose(tokens) == []


def test_continuation_shorter_than_k_near_the_end():
    # "5 6" at 0..1 is followed by 7 and then the suffix itself: only three tokens remain
    assert propose([5, 6, 7, 5, 6], k=5) == [7, 5, 6]
    # overlapping match "1 1" at 1..2 (a longer one than "1" at 0..0 or 1..1): one token left
    assert propose([1, 1, 1], k=3) == [1]


def test_ngram_min_is_respected():
    tokens = [1, 2, 3, 4, 2]  # the only match is "2" (preceded by 1, not 4): length 1
    assert propose(tokens, ngram_min=1) == [3, 4, 2]
    assert propose(tokens, ngram_min=2) == []
    # a match of exactly ngram_min tokens counts
    assert propose([8, 1, 2, 3, 9, 1, 2], ngram_min=2, k=2) == [3, 9]
    # too short a sequence to hold an earlier ngram_min-gram
    assert propose([1, 1], ngram_min=2) == []
    assert propose([1, 1, 1], ngram_min=2) == [1]


def test_ngram_max_bounds_the_matched_length():
    # "7 8 9" at 0..2 (followed by 11) matches 3 tokens; "0 8 9" at 4..6 (followed by 12) only 2
    tokens = [7, 8, 9, 11, 0, 8, 9, 12, 7, 8, 9]
    assert propose(tokens, ngram_max=3) == [11, 0, 8]
    # with ngram_max = 2 both match 2 tokens: the most recent wins
    assert propose(tokens, ngram_max=2) == [12, 7, 8]
    # with ngram_max = 1 every earlier 9 ties: the most recent one
    assert propose(tokens, ngram_max=1) == [12, 7, 8]


def test_matches_longer_than_ngram_max_are_still_found():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 0, 3, 1, 4, 1, 5, 9]  # a 6-token repeat
    assert propose(tokens, ngram_min=2, ngram_max=3, k=4) == [2, 6, 0, 3]


def test_the_suffix_is_not_matched_against_itself():
    # the occurrence that is the suffix itself would propose nothing (or the suffix's own tail);
    # the earlier one is matched
    assert propose([1, 2, 1, 2], k=4) == [1, 2]
    assert propose([6, 7, 8], ngram_min=1) == []
    # a one-token sequence has no earlier occurrence even of itself
    assert propose([4], ngram_min=1) == []


def test_returns_python_ints():
    out = propose([1, 2, 1], k=2)
    assert out == [2, 1] and all(type(t) is int for t in out)


def test_k_zero_proposes_nothing():
    assert propose([1, 2, 1, 2], k=0) == []


@pytest.mark.parametrize("seed", range(3))
def test_agrees_with_the_definition_on_random_sequences(seed):
    rng = np.random.default_rng(seed)
    for _ in range(300):
        tokens = rng.integers(3, size=int(rng.integers(0, 25))).tolist()
        ngram_min = int(rng.integers(1, 4))
        ngram_max = int(rng.integers(ngram_min, 6))
        k = int(rng.integers(1, 6))
        assert propose(tokens, k, ngram_min, ngram_max) == reference(tokens, k, ngram_min, ngram_max), \
            (tokens, k, ngram_min, ngram_max)


@dataclass
class Row:
    token_ids: list[int]
    req_id: str = "r"


def test_proposer_returns_drafts_per_row_and_no_q():
    proposer = NgramProposer(num_speculative_tokens=2, ngram_min=1, ngram_max=3)
    rows = [Row([1, 2, 3, 1, 2], "a"), Row([4, 5, 6], "b"), Row([9, 9, 9, 9], "c"), Row([], "d")]
    drafts, probs = proposer.propose(rows)
    assert drafts == [[3, 1], [], [9], []]  # [9]: only one token follows the longest match
    assert probs == [None, None, None, None]


def test_proposer_with_no_rows():
    assert NgramProposer(3, 1, 3).propose([]) == ([], [])


def test_the_proposer_grows_each_requests_array_and_proposes_as_from_scratch():
    """Tokens arrive 0..5 at a time (accepted drafts + 1); the kept array never goes stale."""
    rng = np.random.default_rng(4)
    proposer = NgramProposer(num_speculative_tokens=3, ngram_min=1, ngram_max=3)
    rows = [Row(rng.integers(4, size=5).tolist(), "a"), Row(rng.integers(4, size=70).tolist(), "b")]
    for _ in range(60):
        drafts, _ = proposer.propose(rows)
        assert drafts == [propose(row.token_ids, 3, 1, 3) for row in rows]
        for row in rows:
            row.token_ids.extend(rng.integers(4, size=int(rng.integers(0, 6))).tolist())
    proposer.propose(rows)
    assert proposer.tokens["b"].length == len(rows[1].token_ids)
    assert proposer.tokens["b"].array.size < 2 * len(rows[1].token_ids) + 64  # grown by doubling
    proposer.forget(["a", "zz"])
    assert set(proposer.tokens) == {"b"}
    rows[0].token_ids[:] = [7, 8, 7]  # a new request under the forgotten id
    assert proposer.propose(rows[:1])[0] == [[8, 7]]
