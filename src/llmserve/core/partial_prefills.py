"""Concurrent partial prefills (vLLM's `--max-num-partial-prefills`, `--max-long-partial-prefills`,
`--long-prefill-token-threshold`): short prompts need not wait behind a long prompt's chunks.

Without them a running long prompt takes each step's whole token budget until its last chunk, and a short
prompt that arrives meanwhile waits for all of it (on a prefill server, seconds to minutes of TTFT). With
them, each step:
- the prompts that may prefill in it (running ones mid-prompt, then waiting ones, at most
  `max_num_partial_prefills`) share the budget: each chunk is at most budget // their number;
- a prompt with more than `long_prefill_token_threshold` tokens left is long; at most
  `max_long_partial_prefills` long prompts prefill at once, and a waiting long prompt beyond that is passed
  over (it keeps its place in the queue) by the shorter ones behind it;
- a long prompt's chunk is at most `long_prefill_token_threshold` tokens (vLLM v1's cap).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from llmserve.core.request import Request

DEFAULT_LONG_FRACTION = 0.04  # vLLM's default threshold with partial prefills on: 4% of the context length


@dataclass(frozen=True)
class PartialPrefillLimits:
    max_num_partial_prefills: int  # prompts prefilling in one step (1: off, a long prompt takes the budget)
    max_long_partial_prefills: int  # long prompts among them
    long_prefill_token_threshold: int  # tokens left above which a prompt is long (0: no prompt is long)

    @classmethod
    def resolve(cls, max_num: int, max_long: int, threshold: int, max_model_len: int) -> PartialPrefillLimits:
        """vLLM's defaults: with max_num > 1 and no threshold given, 4% of the context length."""
        if max_num > 1 and threshold == 0:
            threshold = int(max_model_len * DEFAULT_LONG_FRACTION)
        return cls(max_num, max_long, threshold)

    @property
    def is_enabled(self) -> bool:
        return self.max_num_partial_prefills > 1 or self.long_prefill_token_threshold > 0

    def is_long(self, num_prompt_left: int) -> bool:
        return 0 < self.long_prefill_token_threshold < num_prompt_left


def num_prompt_left(request: Request) -> int:
    """Tokens the request still has to compute before it samples (its prompt, or a preempted request's
    prompt and outputs), prefix-cache hits not yet counted."""
    return request.num_tokens - request.num_computed_tokens


def is_prefilling(request: Request) -> bool:
    """A running request mid-prompt (or mid-recompute): more than its one next token left."""
    return request.num_tokens_with_placeholders - request.num_computed_tokens > 1


class StepPrefills:
    """One step's partial prefills (vLLM's PartialPrefillMetadata): how many prompts share the budget, and
    how many long ones prefill. Made at the start of a step; the waiting path counts the prompts it starts."""

    def __init__(self, limits: PartialPrefillLimits, budget: int, running: Iterable[Request],
                 waiting: Iterable[Request]) -> None:
        self.limits = limits
        num_prefills, self.num_long = 0, 0
        for request in running:
            if is_prefilling(request):
                num_prefills += 1
                self.num_long += limits.is_long(num_prompt_left(request))
        num_waiting_long = 0
        for request in waiting:  # the ones that may start this step, counted to size the share
            if num_prefills >= limits.max_num_partial_prefills:
                break
            if limits.is_long(num_prompt_left(request)):
                if self.num_long + num_waiting_long >= limits.max_long_partial_prefills:
                    continue
                num_waiting_long += 1
            num_prefills += 1
        self.share = max(1, budget // max(1, min(num_prefills, limits.max_num_partial_prefills)))

    def max_chunk(self, num_left: int) -> int:
        """The most tokens a chunk of a prompt with `num_left` tokens left may take in this step."""
        if self.limits.is_long(num_left):
            return min(self.share, self.limits.long_prefill_token_threshold)
        return self.share

    def can_start(self, request: Request) -> bool:
        """Whether a waiting request may start prefilling: not a long one while enough long ones run."""
        return not (self.limits.max_num_partial_prefills > 1 and self.limits.is_long(num_prompt_left(request))
                    and self.num_long >= self.limits.max_long_partial_prefills)

    def on_started(self, num_left: int) -> None:
        self.num_long += self.limits.is_long(num_left)
