"""Requests whose grammar is compiling (or compiled since the last step): they join the waiting queue once it is compiled, so a
slow compile never stalls the steps of the other requests."""

from __future__ import annotations

import concurrent.futures

from llmserve.core.request import Request


class GrammarWaitList:
    def __init__(self) -> None:
        self.requests: list[Request] = []  # arrival order

    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, request: Request) -> bool:
        return request in self.requests

    def add(self, request: Request) -> None:
        assert request.grammar is not None
        self.requests.append(request)

    def remove(self, request: Request) -> bool:
        """Take `request` out (an abort); False if it was not here."""
        if request not in self.requests:
            return False
        self.requests.remove(request)
        return True

    def ready(self) -> list[Request]:
        """The requests whose compile has ended (compiled or failed), in arrival order; each stays here until
        removed (so a sibling admitted before it does not wait for it)."""
        return [r for r in self.requests if r.grammar.is_ready]

    def wait(self, timeout: float) -> None:
        """Block until one compile ends or `timeout` seconds pass (an engine with nothing else to do)."""
        if self.requests:
            concurrent.futures.wait([r.grammar.compiled for r in self.requests], timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
