"""Events leave the engine thread once per step: one output batch per event loop.

During a step the runner puts every event it produces (text deltas of all sequences, finished
events) into the :class:`Outbox`, grouped by where they go: each request's :class:`StepReceiver`.
At the end of the step it flushes: for each event loop that has events, ONE callback
(``call_soon_threadsafe``) that hands each receiver on that loop the list of its events, in the
order they were produced. A step with 256 generating sequences thus costs one cross-thread wake-up
and one call per receiver, and a receiver decides itself what wakes a task: a
:class:`~slotq.engine.engine.RequestHandle` queues the step's list for the one task iterating it;
the worker's job receivers write the output straight into the job's stream and wake the job's task
only when it has something to decide (``slotq.jobs.worker.job_run``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from slotq.engine.events import Event


class StepReceiver(Protocol):
    """Takes one request's events of one step, on the request's event loop. It must not block or
    raise: it runs inside the callback that delivers the whole step to every receiver of the loop."""

    def receive(self, events: list[Event]) -> None: ...


@dataclass(frozen=True, slots=True)
class Sink:
    """Where one request's events go: a receiver called on its event loop."""

    loop: asyncio.AbstractEventLoop
    receiver: StepReceiver


StepBatch = dict[StepReceiver, list[Event]]
"""One step's output for one event loop: each receiver's events, in the order they were produced."""


class Outbox:
    """Engine thread only."""

    def __init__(self) -> None:
        self._pending: dict[asyncio.AbstractEventLoop, StepBatch] = {}

    def put(self, sink: Sink, event: Event) -> None:
        batch = self._pending.get(sink.loop)
        if batch is None:
            batch = self._pending[sink.loop] = {}
        events = batch.get(sink.receiver)
        if events is None:
            batch[sink.receiver] = [event]
        else:
            events.append(event)

    def flush(self) -> set[str]:
        """Send everything put since the last flush. Returns the ids of requests whose event
        loop is closed (nobody can read their events: the caller cancels them)."""
        pending, self._pending = self._pending, {}
        orphans: set[str] = set()
        for loop, batch in pending.items():
            try:
                loop.call_soon_threadsafe(deliver_step, batch)
            except RuntimeError:        # the loop is closed
                orphans.update(event.request_id for events in batch.values() for event in events)
        return orphans


def deliver_step(batch: StepBatch) -> None:
    """Hand each receiver its events of the step (on their event loop)."""
    for receiver, events in batch.items():
        receiver.receive(events)
