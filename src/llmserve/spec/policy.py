"""Where to speculate: the dynamic rule (what SGLang and TensorRT-LLM call dynamic speculation).

A speculative step costs extra time (the proposing of its drafts, their verification) and yields extra
tokens (its accepted drafts). Both are measured, never assumed:
- per batch-size bucket (1, 2, 4, 8, ...), moving averages of the seconds of a plain decode step,
  `plain_s`; of the proposing a speculative step pays once whatever its rows, `fixed_s` (a draft model's
  k forwards read its weights for any number of rows; n-gram lookup costs next to nothing); and of what
  each speculating row adds to the verification, `row_s` (its k more tokens through the target). A step
  with S of its B rows speculating is modelled as plain_s + fixed_s + S * row_s;
- per request, a moving average of the drafts accepted per verified step, `a_r`; and over all requests,
  the pooled average `a_pool`. A candidate the rule leaves out of a step has its `a_r` moved toward
  `a_pool` (as a verified step would move it), so that a request that was unlucky in a few steps is
  tried again rather than left out for good: a row that never speculates is never measured, and at
  batch 8 on CPU the rule without this kept the same 2 of 8 rows out for a whole run (docs/benchmarks.md).
With S speculating rows a step yields B + sum(a_r over S) tokens in that time, so the best set is the m
rows of highest a_r for the m that maximises the ratio against plain decoding's B tokens a forward.
Plain decoding's forward is priced at `window_s` where measured: on CPU a plain step that finds no drafts
backs off into multi-step windows (core/spec_stats.DraftBackoff), and a window's seconds a forward are
what plain decoding costs there; elsewhere at `plain_s` (which still prices the speculative step, a single
step). Every cost here is the runner's share of a step (launch to tokens on the host, with the proposing):
the engine's scheduling and update are not in it, so what windows save there the rule does not see (at 16
rows on CPU a window's forward cost the runner what a single step did: docs/benchmarks.md). The rule
speculates for those rows only, so speculation never buys fewer tokens per second than plain decoding,
as far as the averages tell. (A single per-row average, the rule's first form, charged a step of one
speculating row the whole draft cost and switched speculation off where it paid: docs/speculative.md.)

Unmeasured costs are measured first: a bucket without `plain_s` decodes plainly, then one without
`row_s` speculates, then, on an engine that runs windows (`has_windows`), one without `window_s` decodes
plainly again until the back-off has run a window (its second plain choice backs off for 2 forwards: a
rule that rarely chose plain decoding never learnt its windows' price otherwise), for at most
`WINDOW_TRIES` decisions (streamed requests, for one, run no windows). A proposal that first caught the
draft up on more tokens than a verified step accepts (after plain steps, or a prompt) is left out of
`fixed_s`: that catch-up is the price of having switched, not of speculating. Every `probe_every`-th
decision of a bucket takes the other choice (a plain step while speculating, a speculative step while
not), so the averages follow a changing load, and requests that were switched off get their acceptance
measured again. `--speculative-max-batch` caps it all.
"""

from __future__ import annotations

from dataclasses import dataclass

EMA_WEIGHT = 0.2  # weight of a new observation in the moving averages
PROBE_EVERY = 32  # every this many decisions of a bucket, take the other choice to refresh its cost
WINDOW_TRIES = 4  # plain choices a bucket makes for want of a window's price before it goes without


@dataclass(frozen=True)
class StepCost:
    """One measured decode step (no prompt tokens): its rows, the rows that verified drafts, and the
    seconds it took, the proposing of those drafts (propose_s) included; has_long_catch_up: that
    proposing first caught the draft up on more tokens than a verified step accepts."""

    num_rows: int
    num_spec_rows: int
    seconds: float
    propose_s: float = 0.0
    has_long_catch_up: bool = False


@dataclass
class BucketCost:
    plain_s: float | None = None  # a plain decode step
    window_s: float | None = None  # a forward of a plain multi-step window (None: no window measured)
    num_window_tries: int = 0  # plain choices made to measure window_s
    fixed_s: float | None = None  # the proposing of a speculative step (None: not measured, taken as 0)
    row_s: float | None = None  # added to the verification per speculating row
    num_decisions: int = 0


def bucket_of(num_rows: int) -> int:
    """The smallest power of two >= num_rows: steps of similar batch sizes share their costs."""
    return 1 << max(0, num_rows - 1).bit_length()


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + EMA_WEIGHT * (new - old)


def best_num_rows(accepted: list[float], num_rows: int, plain_s: float, fixed_s: float, row_s: float,
                  window_s: float | None = None) -> int:
    """accepted: per candidate row its expected accepted drafts per step, best first; num_rows: the
    step's rows (B). Returns how many leading candidates speculate so that
    (B + their accepted) / (plain_s + fixed_s + m * row_s) is largest, plain decoding's rate being
    B / window_s where windows were measured, else B / plain_s (m = 0, also on ties)."""
    best, best_rate = 0, num_rows / (plain_s if window_s is None else window_s)
    total = float(num_rows)
    for m, a in enumerate(accepted, start=1):
        total += a
        rate = total / (plain_s + max(fixed_s, 0.0) + m * max(row_s, 0.0))
        if rate > best_rate:
            best, best_rate = m, rate
    return best


class SpeculationRule:
    def __init__(self, max_batch: int, num_speculative_tokens: int, is_dynamic: bool = True,
                 probe_every: int = PROBE_EVERY, has_windows: bool = False) -> None:
        """has_windows: plain decoding backs off into multi-step windows (CPU), whose price is measured."""
        self.max_batch = max_batch
        self.is_dynamic = is_dynamic
        self.has_windows = has_windows
        self.probe_every = probe_every
        self.num_speculative_tokens = num_speculative_tokens  # k
        self.prior = float(num_speculative_tokens)  # a request's acceptance before any is measured
        self.buckets: dict[int, BucketCost] = {}
        self.accepted: dict[str, float] = {}  # req_id -> drafts accepted per verified step (average)
        self.pooled: float | None = None  # the same over every verified row

    def choose(self, candidates: list[str], num_rows: int) -> list[bool]:
        """Per candidate (a request that may speculate) of a coming step of `num_rows` rows: whether it
        proposes drafts."""
        num = len(candidates)
        if num == 0 or num_rows > self.max_batch:
            return [False] * num
        if not self.is_dynamic:
            return [True] * num
        cost = self.buckets.setdefault(bucket_of(num_rows), BucketCost())
        cost.num_decisions += 1
        if cost.plain_s is None or cost.row_s is None:
            return [cost.plain_s is not None] * num  # measure the plain step first, then the speculative
        if self.has_windows and cost.window_s is None and cost.num_window_tries < WINDOW_TRIES:
            cost.num_window_tries += 1
            return [False] * num  # then plain decoding's windows
        accepted = [self.accepted.get(r, self.prior) for r in candidates]
        order = sorted(range(num), key=lambda i: -accepted[i])
        num_spec = best_num_rows([accepted[i] for i in order], num_rows, cost.plain_s, cost.fixed_s or 0.0,
                                 cost.row_s, cost.window_s)
        if cost.num_decisions % self.probe_every == 0:
            num_spec = 0 if num_spec else num  # the other choice, to refresh its cost
        chosen = set(order[:num_spec])
        self._regress_left_out([r for i, r in enumerate(candidates) if i not in chosen])
        return [i in chosen for i in range(num)]

    def _regress_left_out(self, req_ids: list[str]) -> None:
        """Move the estimates of the candidates left out of a step toward the pooled acceptance."""
        if self.pooled is None:
            return
        for req_id in req_ids:
            if req_id in self.accepted:
                self.accepted[req_id] = _average(self.accepted[req_id], self.pooled)

    def observe_step(self, step: StepCost) -> None:
        if not self.is_dynamic or step.num_rows == 0:
            return
        cost = self.buckets.setdefault(bucket_of(step.num_rows), BucketCost())
        if step.num_spec_rows == 0:
            cost.plain_s = _average(cost.plain_s, step.seconds)
        elif cost.plain_s is not None:
            verify_extra = max(0.0, step.seconds - step.propose_s - cost.plain_s)
            cost.row_s = _average(cost.row_s, verify_extra / step.num_spec_rows)
            if not step.has_long_catch_up:
                cost.fixed_s = _average(cost.fixed_s, step.propose_s)

    def observe_window(self, num_rows: int, num_forwards: int, seconds: float) -> None:
        """A plain multi-step window: `num_forwards` forwards of `num_rows` rows each took `seconds`."""
        if self.is_dynamic and num_rows and num_forwards > 1:
            cost = self.buckets.setdefault(bucket_of(num_rows), BucketCost())
            cost.window_s = _average(cost.window_s, seconds / num_forwards)

    def observe_row(self, req_id: str, num_accepted: int) -> None:
        """A verified step of `req_id`: `num_accepted` of its drafts were kept."""
        self.accepted[req_id] = _average(self.accepted.get(req_id), float(num_accepted))
        self.pooled = _average(self.pooled, float(num_accepted))

    def forget(self, req_ids) -> None:
        for req_id in req_ids:
            self.accepted.pop(req_id, None)
