"""Events leave the engine thread once per step: one ``call_soon_threadsafe`` per event loop.

During a step the runner puts every event it produces (text deltas of all sequences, finished
events) into the :class:`Outbox`. At the end of the step it flushes: for each event loop that has
events, one callback that hands them, in the order they were produced, to each request's queue.
A step with 16 generating sequences thus costs one cross-thread wake-up instead of 16, and one
request's events still arrive in order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from slotq.engine.events import Event

Deliver = Callable[[Event], None]     # called on the request's event loop (e.g. Queue.put_nowait)


@dataclass(frozen=True, slots=True)
class Sink:
    """Where one request's events go: a callable to run on its event loop."""

    loop: asyncio.AbstractEventLoop
    deliver: Deliver


class Outbox:
    """Engine thread only."""

    def __init__(self) -> None:
        self._pending: dict[asyncio.AbstractEventLoop, list[tuple[Deliver, Event]]] = {}

    def put(self, sink: Sink, event: Event) -> None:
        batch = self._pending.get(sink.loop)
        if batch is None:
            batch = self._pending[sink.loop] = []
        batch.append((sink.deliver, event))

    def flush(self) -> set[str]:
        """Send everything put since the last flush. Returns the ids of requests whose event
        loop is closed (nobody can read their events: the caller cancels them)."""
        pending, self._pending = self._pending, {}
        orphans: set[str] = set()
        for loop, batch in pending.items():
            try:
                loop.call_soon_threadsafe(_deliver_all, batch)
            except RuntimeError:        # the loop is closed
                orphans.update(event.request_id for _, event in batch)
        return orphans


def _deliver_all(batch: list[tuple[Deliver, Event]]) -> None:
    for deliver, event in batch:
        deliver(event)
