"""Suspects start alone: how a worker keeps a job that may kill it from taking other jobs down with it.

A job whose last started attempt was lost without progress (its worker died, most likely by that
job's hand: a grammar that exhausts memory, a prompt that crashes llama.cpp) is a *suspect*
(``START_ATTEMPT``, :mod:`slotq.jobs.protocol.scripts`). When a worker dies, every one of its
attempts still without progress counts as a death of its job, since the queue cannot tell which
job killed it. Jobs handed back by a dead worker keep their places, so the next worker tends to
claim them together again, and two such deaths would dead-letter the innocent jobs along with the
one that killed both workers.

So a suspect starts *isolated*: it waits until every other attempt of its worker has put a token in
its job's stream (or ended), and no other attempt starts until the suspect's own first token is in
its stream. If it then kills the worker, it is the only attempt lost without progress: the others
were interrupted (no try spent, no death). Jobs that are not suspects start as before, in parallel.
While a suspect waits or starts, new attempts wait behind it, so a stream of new jobs cannot keep it
waiting for ever; the wait is short, as it ends with the other attempts' first tokens.

An attempt that waits here has not started, so a worker that dies meanwhile costs it a try but
never a death (it cannot have killed it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class StartGate:
    """One per worker. ``flush`` returns once everything the worker's attempts have added to their
    streams is in Redis: what makes "the others have made progress" true in the stream, where the
    next attempt judges it, and not only in this worker's buffers."""

    def __init__(self, flush: Callable[[], Awaitable[None]]) -> None:
        self._flush = flush
        self._unproven: set[str] = set()      # attempts started (or starting) here, without a token in their stream
        self._isolated: str | None = None     # the suspect that waits to start, or runs, alone
        self._changed = asyncio.Event()       # set (and replaced) at every change: wakes every waiter

    async def enter(self, job_id: str) -> None:
        """Before an attempt starts: wait while a suspect waits or runs isolated, then count it as
        without progress until :meth:`leave`."""
        await self._wait_until(lambda: self._isolated is None)
        self._unproven.add(job_id)

    async def enter_isolated(self, job_id: str) -> None:
        """A suspect (it had entered): wait its turn, then until every other attempt here has a
        token in its stream or has ended, and have those tokens written."""
        self._unproven.discard(job_id)
        self._notify()
        await self._wait_until(lambda: self._isolated is None)
        self._isolated = job_id
        await self._wait_until(lambda: not self._unproven)
        await self._flush()

    def isolated(self, job_id: str) -> bool:
        """Whether ``job_id`` is the suspect that runs alone now: its first token must be in its
        stream before it leaves."""
        return self._isolated == job_id

    def leave(self, job_id: str) -> None:
        """The attempt has its first token (a suspect's: in its stream), or ended: it holds no one
        back any more. Not a coroutine, so a cancelled attempt's ``finally`` always gets it done."""
        self._unproven.discard(job_id)
        if self._isolated == job_id:
            self._isolated = None
        self._notify()

    async def _wait_until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
