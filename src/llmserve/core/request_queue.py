"""Waiting queues: FCFS (preempted requests go back to the front) or by integer priority.

Removal (abort) is lazy and O(1): the request is marked and skipped when it reaches the head.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from llmserve.core.request import Request


class _LazyRemovalQueue:
    def __init__(self) -> None:
        self._removed: set[str] = set()
        self._num_live = 0

    def remove(self, request: Request) -> None:
        self._removed.add(request.request_id)
        self._num_live -= 1

    def __len__(self) -> int:
        return self._num_live

    def _skip_removed(self) -> None:
        while self._raw_len() and self._raw_peek().request_id in self._removed:
            self._removed.discard(self._raw_pop().request_id)

    def peek(self) -> Request:
        self._skip_removed()
        return self._raw_peek()

    def pop(self) -> Request:
        self._skip_removed()
        self._num_live -= 1
        return self._raw_pop()

    def __iter__(self) -> Iterator[Request]:
        return (r for r in self._ordered() if r.request_id not in self._removed)


class FCFSQueue(_LazyRemovalQueue):
    def __init__(self) -> None:
        super().__init__()
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)
        self._num_live += 1

    def add_front(self, request: Request) -> None:
        self._queue.appendleft(request)
        self._num_live += 1

    def _raw_len(self) -> int:
        return len(self._queue)

    def _raw_peek(self) -> Request:
        return self._queue[0]

    def _raw_pop(self) -> Request:
        return self._queue.popleft()

    def _ordered(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue(_LazyRemovalQueue):
    """Lower `priority` first, then earlier arrival; a preempted request keeps its place."""

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[Request] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, request)
        self._num_live += 1

    add_front = add

    def _raw_len(self) -> int:
        return len(self._heap)

    def _raw_peek(self) -> Request:
        return self._heap[0]

    def _raw_pop(self) -> Request:
        return heapq.heappop(self._heap)

    def _ordered(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


def make_queue(policy: str) -> FCFSQueue | PriorityQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}: choose fcfs or priority")
