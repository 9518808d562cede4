"""Counts of speculative decoding for one step, drained into SchedulerStats."""

from __future__ import annotations

from llmserve.messages import SpecDecodeStats


class SpecDecodeCounter:
    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self._reset()

    def _reset(self) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One row verified: `num_accepted` of its `num_draft_tokens` leading drafts were kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(min(num_accepted, self.num_speculative_tokens)):
            self.accepted_per_position[position] += 1

    def take(self) -> SpecDecodeStats | None:
        """This step's counts (None if no row carried drafts), then zero."""
        if self.num_drafts == 0:
            return None
        stats = SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                self.accepted_per_position)
        self._reset()
        return stats


MAX_SKIPPED_STEPS = 16  # the most forwards (overlapped, or a window's) between two steps that look for drafts


class DraftBackoff:
    """A step that may carry drafts pays for it even when it finds none: with async scheduling it runs in
    order (the next step's drafts need this step's tokens on the host), and on CPU it runs alone where a
    plain engine would run a multi-step window (core/decode_window.py). When such a step finds drafts for
    no row (n-gram lookup that matches nothing, a rule that turned every row off), that bought nothing;
    the next 1, 2, 4, ... up to MAX_SKIPPED_STEPS forwards then run without looking (overlapped, or in a
    window of at most that many forwards). The first step that finds drafts again ends the back-off, and
    so does a request that may speculate starting to run (its rows were not looked at). With neither
    overlap nor windows nothing is gained and nothing is skipped."""

    def __init__(self, is_enabled: bool) -> None:
        self.is_enabled = is_enabled
        self.num_to_skip = 0  # length of the current skip run
        self.num_skips_left = 0

    @property
    def is_skipping(self) -> bool:
        return self.num_skips_left > 0

    def on_scheduled(self, num_forwards: int = 1) -> None:
        """A step of `num_forwards` forwards was scheduled (while skipping: as many skips used)."""
        self.num_skips_left = max(0, self.num_skips_left - num_forwards)

    def reset(self) -> None:
        """Look for drafts again from the next step."""
        self.num_to_skip = self.num_skips_left = 0

    def observe(self, num_rows_with_drafts: int) -> None:
        """A step that looked for drafts found them for this many rows."""
        if not self.is_enabled:
            return
        if num_rows_with_drafts:
            self.num_to_skip = 0
            return
        self.num_to_skip = min(max(1, 2 * self.num_to_skip), MAX_SKIPPED_STEPS)
        self.num_skips_left = self.num_to_skip
