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
