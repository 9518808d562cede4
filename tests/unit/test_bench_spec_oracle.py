"""The oracle draft of `bench spec`: it proposes the target's continuation of the speculative engine's
own output, continued again wherever that output departs from (or runs past) its reference."""

from dataclasses import dataclass, field

from llmserve.bench.spec_oracle import OracleDraft


@dataclass
class Row:
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)


class KDrafts:
    """The draft model stand-in: k drafts per row (their values are replaced by the oracle's)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, rows):
        return [[0] * self.k for _ in rows], [None] * len(rows)


class CountingGreedy:
    """continue_greedy of a target whose next token is always the last one + 1."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []  # (context length, tokens asked)

    def __call__(self, context: list[int], num: int) -> list[int]:
        self.calls.append((len(context), num))
        return [context[-1] + 1 + i for i in range(num)]


def _oracle(reference, agreement=1.0, k=3, max_output=40, window=8):
    greedy = CountingGreedy()
    oracle = OracleDraft(KDrafts(k), reference, agreement, vocab_size=1000, seed=0, continue_greedy=greedy,
                         max_output=max_output, window=window)
    return oracle, greedy


def test_proposes_the_reference_while_the_output_follows_it():
    reference = {(1, 2): [3, 4, 5, 6, 7, 8, 9]}
    oracle, greedy = _oracle(reference)
    assert oracle.propose([Row([1, 2], [3, 4])]) == ([[5, 6, 7]], [None])
    assert greedy.calls == [] and oracle.num_rebases == 0


def test_an_output_that_departs_from_the_reference_gets_its_own_continuation():
    """The engine emitted 50 where the plain engine's reference had 4 (a bf16 rounding difference)."""
    reference = {(1, 2): [3, 4, 5, 6, 7, 8, 9]}
    oracle, greedy = _oracle(reference)
    assert oracle.propose([Row([1, 2], [3, 50])]) == ([[51, 52, 53]], [None])
    assert greedy.calls == [(4, 8)]  # prompt + output as context, a window of 8 tokens
    assert reference[(1, 2)] == [3, 50] + list(range(51, 59))
    assert oracle.propose([Row([1, 2], [3, 50, 51, 52])]) == ([[53, 54, 55]], [None])
    assert oracle.num_rebases == 1 and oracle.rebase_s >= 0.0


def test_a_reference_too_short_is_continued_and_max_output_bounds_it():
    reference = {(1,): [2, 3]}
    oracle, greedy = _oracle(reference, max_output=6, window=8)
    assert oracle.propose([Row([1], [2, 3])]) == ([[4, 5, 6]], [None])
    assert greedy.calls == [(3, 4)]  # 6 outputs at most: 4 more
    assert oracle.propose([Row([1], [2, 3, 4, 5, 6, 7])]) == ([[]], [None])  # at max_output: nothing
    assert len(greedy.calls) == 1


def test_agreement_zero_proposes_only_wrong_tokens():
    oracle, _ = _oracle({(1, 2): [3, 4, 5, 6]}, agreement=0.0)
    assert oracle.propose([Row([1, 2], [3])]) == ([[5, 6, 7]], [None])  # each truth + 1


def test_without_a_continuation_the_plain_reference_is_used_as_it_is():
    oracle = OracleDraft(KDrafts(3), {(1,): [2, 3, 4]}, 1.0, vocab_size=1000, seed=0)
    assert oracle.propose([Row([1], [2, 9])]) == ([[4]], [None])
