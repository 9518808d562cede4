"""The dynamic speculation rule (spec/policy.py) and the Speculator's timing of steps, with fake costs
and a fake clock: which rows speculate, in which order costs are measured, probes, the cap."""

from dataclasses import dataclass, field

import pytest

from llmserve.sampling_params import SamplingParams
from llmserve.spec.policy import WINDOW_TRIES, SpeculationRule, StepCost, best_num_rows, bucket_of
from llmserve.spec.speculator import Speculator


def _measured_rule(num_rows: int, plain_s: float, spec_s: float, num_spec_rows: int | None = None,
                   **kwargs) -> SpeculationRule:
    """A rule whose bucket of `num_rows` has seen one plain step and one speculative step."""
    rule = SpeculationRule(max_batch=64, num_speculative_tokens=4, **kwargs)
    rule.observe_step(StepCost(num_rows, 0, plain_s))
    rule.observe_step(StepCost(num_rows, num_spec_rows or num_rows, spec_s))
    return rule


def test_buckets_are_powers_of_two():
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9, 64)] == [1, 2, 4, 4, 8, 8, 16, 64]


def test_best_rows_maximise_tokens_per_second():
    # B = 4, plain 1 s, 0.1 s per speculating row: 4/1, 7/1.1, 10/1.2 (best), 10.1/1.3, 10.1/1.4 tok/s
    assert best_num_rows([3.0, 3.0, 0.1, 0.0], 4, 1.0, 0.0, 0.1) == 2
    assert best_num_rows([1.0], 1, 1.0, 0.0, 1.0) == 0  # 2 tokens in 2 s ties plain decoding: plain
    assert best_num_rows([1.01], 1, 1.0, 0.0, 1.0) == 1
    assert best_num_rows([], 3, 1.0, 0.0, 0.1) == 0


def test_a_fixed_proposing_cost_is_paid_once_per_step():
    """The CPU figures of the first rule's failure (smollm2 target, 2-layer draft, B = 4): plain 26 ms, the
    draft's forwards 22 ms a step, 10 ms a speculating row, 2.7 drafts accepted a row. All four rows pay
    (14.8 tokens in 88 ms beat 4 in 26); one row alone would not (6.7 in 58 ms)."""
    assert best_num_rows([2.7] * 4, 4, 0.026, 0.022, 0.010) == 4
    assert best_num_rows([2.7], 4, 0.026, 0.022, 0.010) == 0
    rule = SpeculationRule(max_batch=64, num_speculative_tokens=4)
    rule.observe_step(StepCost(4, 0, 0.026))
    rule.observe_step(StepCost(4, 1, 0.058, propose_s=0.022))  # one row speculated: 22 ms fixed, 10 ms its own
    assert rule.buckets[4].fixed_s == pytest.approx(0.022) and rule.buckets[4].row_s == pytest.approx(0.010)
    for req_id in "abcd":
        rule.observe_row(req_id, 2.7)
    assert rule.choose(list("abcd"), 4) == [True] * 4


def test_plain_decoding_is_priced_by_its_window_forwards_where_windows_ran():
    """On CPU a plain engine decodes in multi-step windows: B = 4 rows, a single plain step 26 ms, a window's
    forward 15 ms. Four rows accepting 2.7 drafts beat the single step (14.8 tokens in 88 ms against 4 in
    26) but not the window (4 in 15 ms); the speculative step is still priced from the single step."""
    assert best_num_rows([2.7] * 4, 4, 0.026, 0.022, 0.010, window_s=0.015) == 0
    assert best_num_rows([2.7] * 4, 4, 0.026, 0.022, 0.010, window_s=0.025) == 4
    rule = SpeculationRule(max_batch=64, num_speculative_tokens=4)
    rule.observe_step(StepCost(4, 0, 0.026))
    rule.observe_step(StepCost(4, 4, 0.088, propose_s=0.022))
    for req_id in "abcd":
        rule.observe_row(req_id, 2.7)
    assert rule.choose(list("abcd"), 4) == [True] * 4
    rule.observe_window(4, 1, 0.010)  # one forward is a single step's: not a window
    rule.observe_window(3, 16, 16 * 0.015)  # 3 rows: bucket 4
    assert rule.buckets[4].window_s == pytest.approx(0.015) and rule.buckets[4].plain_s == pytest.approx(0.026)
    assert rule.choose(list("abcd"), 4) == [False] * 4
    assert rule.buckets[4].row_s == pytest.approx(0.010)  # the window did not move the speculative step's price


def test_an_engine_with_windows_measures_a_plain_window_third():
    rule = SpeculationRule(max_batch=8, num_speculative_tokens=4, has_windows=True)
    rule.observe_step(StepCost(1, 0, 0.010))
    assert rule.choose(["a"], 1) == [True]
    rule.observe_step(StepCost(1, 1, 0.030))
    rule.observe_row("a", 4)
    assert rule.choose(["a"], 1) == [False]  # 5 tokens in 30 ms beat 1 in 10, but the window is unmeasured
    rule.observe_window(1, 2, 0.016)
    assert rule.choose(["a"], 1) == [True]  # 5 in 30 ms beat 1 in 8
    for _ in range(10):
        rule.observe_window(1, 16, 16 * 0.005)  # longer windows, 5 ms a forward: 1 in ~5.3 ms beats 5 in 30
    assert rule.choose(["a"], 1) == [False]


def test_a_bucket_that_runs_no_window_goes_without_its_price_after_a_few_tries():
    """Streamed requests run no windows: the rule must not decode plainly for ever waiting for one."""
    rule = SpeculationRule(max_batch=8, num_speculative_tokens=4, has_windows=True)
    rule.observe_step(StepCost(1, 0, 0.010))
    rule.observe_step(StepCost(1, 1, 0.030))
    rule.observe_row("a", 4)
    assert [rule.choose(["a"], 1) for _ in range(WINDOW_TRIES + 1)] == [[False]] * WINDOW_TRIES + [[True]]


def test_costs_are_measured_plain_first_then_speculative():
    rule = SpeculationRule(max_batch=8, num_speculative_tokens=4)
    assert rule.choose(["a"], 1) == [False]  # no plain cost yet: a plain step measures it
    rule.observe_step(StepCost(1, 0, 0.010))
    assert rule.choose(["a"], 1) == [True]  # no speculative cost yet: speculate to measure it
    rule.observe_step(StepCost(1, 1, 0.030))
    assert rule.buckets[1].plain_s == pytest.approx(0.010) and rule.buckets[1].row_s == pytest.approx(0.020)
    assert rule.choose(["a"], 2) == [False]  # another bucket: measured on its own


@pytest.mark.parametrize("accepted, speculates", [(3, True), (2, True), (1, False), (0, False)])
def test_a_request_speculates_only_where_it_beats_plain_decoding(accepted, speculates):
    """Plain step 10 ms, speculative 20 ms: it pays when more than 1 draft is accepted a step."""
    rule = _measured_rule(1, 0.010, 0.020)
    rule.observe_row("a", accepted)
    assert rule.choose(["a"], 1) == [speculates]


def test_rows_are_chosen_by_their_own_acceptance():
    """Batch 4 (plain 40 ms), 10 ms more per speculating row: only rows that add more than one token
    per 10 ms beyond the batch's rate speculate."""
    rule = _measured_rule(4, 0.040, 0.080)
    for req_id, accepted in zip("abcd", (4, 0, 3, 0)):
        rule.observe_row(req_id, accepted)
    assert rule.choose(list("abcd"), 4) == [True, False, True, False]
    assert rule.choose(["e"], 4) == [True]  # unmeasured: the prior (k accepted) until it is measured


def test_acceptance_is_a_moving_average_and_forgotten_with_the_request():
    rule = _measured_rule(1, 0.010, 0.020)
    rule.observe_row("a", 4)
    for _ in range(12):
        rule.observe_row("a", 0)
    assert rule.choose(["a"], 1) == [False]
    rule.forget(["a"])
    assert rule.choose(["a"], 1) == [True]


@pytest.mark.parametrize("req_id, accepted, choices", [("good", 4, [True, True, True, False] * 2),
                                                       ("bad", 0, [False, False, False, True] * 2)])
def test_every_probe_interval_takes_the_other_choice(req_id, accepted, choices):
    rule = _measured_rule(1, 0.010, 0.020, probe_every=4)
    rule.observe_row(req_id, accepted)
    # the two measuring decisions happened before any choose(): decisions 1..8 from here
    assert [rule.choose([req_id], 1)[0] for _ in range(8)] == choices


def test_a_row_left_out_drifts_back_to_the_pooled_acceptance_and_is_tried_again():
    """Batch 2 (plain 20 ms, 10 ms more per speculating row): "b" was unlucky once (0 accepted) while
    the pool accepts 3 a step. Left out, its estimate moves toward the pool step by step until it
    speculates again; one that was never measured keeps the prior."""
    rule = _measured_rule(2, 0.020, 0.040)
    for _ in range(10):
        rule.observe_row("a", 3)
    rule.observe_row("b", 0)
    choices = [rule.choose(["a", "b"], 2) for _ in range(10)]
    assert choices[0] == [True, False]
    assert [True, True] in choices
    first_back = choices.index([True, True])
    assert all(c == [True, False] for c in choices[:first_back])
    assert rule.accepted["b"] > 1.0


def test_spec_step_before_a_plain_one_teaches_nothing_and_negative_extra_is_zero():
    rule = SpeculationRule(max_batch=8, num_speculative_tokens=4)
    rule.observe_step(StepCost(2, 2, 0.050))
    assert rule.buckets[2].row_s is None
    rule.observe_step(StepCost(2, 0, 0.020))
    rule.observe_step(StepCost(2, 1, 0.015))  # faster than plain (noise): free, not negative
    assert rule.buckets[2].row_s == 0.0


def test_the_cap_and_the_static_rule():
    rule = SpeculationRule(max_batch=2, num_speculative_tokens=4, is_dynamic=False)
    assert rule.choose(["a", "b"], 2) == [True, True]
    assert rule.choose(["a", "b"], 3) == [False, False]  # three rows: above the cap
    rule.observe_step(StepCost(2, 0, 0.010))
    assert rule.buckets == {}  # the static rule measures nothing


# ---- the Speculator's timing --------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeRow:
    req_id: str
    params: SamplingParams = field(default_factory=SamplingParams)
    draft_probs: object = None


class SlowProposer:
    """Proposes [7, 7] per row and takes 5 ms of the fake clock, after catching up on `max_catch_up` tokens."""

    def __init__(self, clock: FakeClock, max_catch_up: int = 1) -> None:
        self.clock = clock
        self.max_catch_up = max_catch_up

    def propose(self, rows):
        self.clock.now += 0.005
        return [[7, 7] for _ in rows], [None] * len(rows)


def _speculator(max_catch_up: int = 1):
    clock = FakeClock()
    rule = SpeculationRule(max_batch=8, num_speculative_tokens=2)
    return Speculator(SlowProposer(clock, max_catch_up), rule, clock), clock, rule


def _step(speculator, clock, rows, num_spec_rows: int, seconds: float, is_decode: bool = True):
    speculator.begin_step(len(rows), num_spec_rows, is_decode)
    clock.now += seconds
    speculator.end_step()
    return speculator.propose(rows, len(rows), may_speculate=True)


def test_speculator_charges_the_proposing_to_the_step_that_verifies():
    speculator, clock, rule = _speculator()
    rows = [FakeRow("a"), FakeRow("b", SamplingParams(speculative=False))]
    assert _step(speculator, clock, rows, 0, 0.050, is_decode=False) == [[], []]  # a prefill: not measured
    assert rule.buckets[2].plain_s is None
    assert _step(speculator, clock, rows, 0, 0.020) == [[7, 7], []]  # plain measured; `b` opted out
    assert rule.buckets[2].plain_s == pytest.approx(0.020)
    _step(speculator, clock, rows, 1, 0.030)  # verification 30 ms (10 ms more than plain) + 5 ms proposing
    assert rule.buckets[2].row_s == pytest.approx(0.010) and rule.buckets[2].fixed_s == pytest.approx(0.005)


def test_a_long_catch_up_is_left_out_of_the_proposing_cost():
    """k = 2: a proposal that first caught up on more than k + 1 tokens paid for switching, not speculating."""
    speculator, clock, rule = _speculator(max_catch_up=4)
    rows = [FakeRow("a")]
    _step(speculator, clock, rows, 0, 0.020)
    _step(speculator, clock, rows, 1, 0.030)
    assert rule.buckets[1].row_s == pytest.approx(0.010) and rule.buckets[1].fixed_s is None
    speculator.proposer.max_catch_up = 3
    _step(speculator, clock, rows, 1, 0.030)  # verifies drafts of the long catch-up; proposes after a short one
    assert rule.buckets[1].fixed_s is None
    _step(speculator, clock, rows, 1, 0.030)
    assert rule.buckets[1].fixed_s == pytest.approx(0.005)


def test_speculator_skips_a_step_whose_proposed_drafts_were_dropped():
    speculator, clock, rule = _speculator()
    rows = [FakeRow("a")]
    _step(speculator, clock, rows, 0, 0.020)  # plain measured, then drafts proposed
    _step(speculator, clock, rows, 0, 0.040)  # the scheduler placed none: says nothing
    assert rule.buckets[1].plain_s == pytest.approx(0.020) and rule.buckets[1].row_s is None
    speculator.propose(rows, 1, may_speculate=False)
    assert rows[0].draft_probs is None and speculator.num_proposed == 0
