"""The waiting queue: highest precedence (priority class, then priority) first, then oldest first.

Preempted sequences keep their original arrival number, so they go back near the front of their
priority lane instead of behind everything that arrived while they ran.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from slotq.engine.sequence import Sequence


class RequestQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, int, int], Sequence]] = []

    def push(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (seq.queue_order, seq))

    def peek(self) -> Sequence | None:
        return self._heap[0][1] if self._heap else None

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[1]

    def remove_request(self, request_id: str) -> list[Sequence]:
        """Take every waiting sequence of a request out of the queue (cancellation)."""
        removed = [e[1] for e in self._heap if e[1].request_id == request_id]
        if removed:
            self._heap = [e for e in self._heap if e[1].request_id != request_id]
            heapq.heapify(self._heap)
        return removed

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        return (e[1] for e in sorted(self._heap))
