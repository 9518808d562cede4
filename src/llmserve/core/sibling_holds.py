"""Parallel sampling (n > 1) with prefix caching: a request's later siblings wait while the first one computes
their shared prompt, then run from its cached blocks instead of computing the prompt n times."""

from __future__ import annotations

from collections.abc import Container, Mapping

from llmserve.core.request import Request


class SiblingHolds:
    """The siblings held behind a first sibling still in prefill; truthy while any is held."""

    def __init__(self) -> None:
        self.held: dict[str, list[Request]] = {}  # first sibling id -> siblings waiting for it, in arrival order

    def __bool__(self) -> bool:
        return bool(self.held)

    def num_held(self) -> int:
        return sum(len(siblings) for siblings in self.held.values())

    def hold(self, request: Request, requests: Mapping[str, Request], compiling: Container[Request]) -> bool:
        """Hold `request` behind a sibling of it that is still computing the prompt; False when none is (the
        caller queues it). `requests`: the scheduler's; a sibling whose grammar is compiling does not count."""
        if request.parent_id is None:
            return False
        for other in requests.values():
            if other.parent_id == request.parent_id and other is not request and other not in compiling:
                if other.num_computed_tokens >= other.num_prompt_tokens:
                    return False
                self.held.setdefault(other.request_id, []).append(request)
                return True
        return False

    def release(self, request: Request) -> list[Request]:
        """The siblings held behind `request` (its prompt is computed, or it ended), in arrival order."""
        return self.held.pop(request.request_id, [])

    def remove(self, request: Request) -> bool:
        """Drop a held request (aborted); False when it was not held."""
        for siblings in self.held.values():
            if request in siblings:
                siblings.remove(request)
                return True
        return False
