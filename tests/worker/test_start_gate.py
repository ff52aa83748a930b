"""The worker's start gate (jobs/worker/start_gate.py): a suspect starts only once every other attempt
of its worker has made progress, and no attempt starts beside it until it has made progress itself."""

from __future__ import annotations

import asyncio

from slotq.jobs.worker.start_gate import StartGate


async def _settle() -> None:
    """Let every task that can run, run (the gate's waits are all on the same loop)."""
    for _ in range(10):
        await asyncio.sleep(0)


async def test_a_suspect_starts_alone_and_holds_new_starts_back_until_it_made_progress():
    flushes: list[str] = []

    async def flush() -> None:
        flushes.append("flushed")

    gate = StartGate(flush)
    order: list[str] = []

    async def start(job: str, *, suspect: bool = False) -> None:
        await gate.enter(job)
        if suspect:
            await gate.enter_isolated(job)
        order.append(job)

    await start("a")
    await start("b")
    suspect = asyncio.create_task(start("s", suspect=True))
    await _settle()
    assert order == ["a", "b"]                    # a and b have no token yet: s waits
    late = asyncio.create_task(start("c"))       # a new attempt waits behind the suspect
    gate.leave("a")
    await _settle()
    assert order == ["a", "b"] and not flushes
    gate.leave("b")                               # b's first token: s is alone without progress
    await _settle()
    assert order == ["a", "b", "s"] and flushes == ["flushed"]
    assert gate.isolated("s")
    gate.leave("s")                               # s's first token is in its stream: c may start
    await _settle()
    assert order == ["a", "b", "s", "c"]
    await asyncio.gather(suspect, late)


async def test_two_suspects_start_one_after_the_other_and_a_cancelled_one_lets_the_next_go():
    async def nothing_buffered() -> None:
        pass

    gate = StartGate(nothing_buffered)
    started: list[str] = []

    async def suspect(job: str) -> None:
        try:
            await gate.enter(job)
            await gate.enter_isolated(job)
            started.append(job)
            await asyncio.Event().wait()          # runs until cancelled, never making progress
        finally:
            gate.leave(job)                       # what the worker does when an attempt ends

    first = asyncio.create_task(suspect("s1"))
    second = asyncio.create_task(suspect("s2"))
    await _settle()
    assert started == ["s1"]
    first.cancel()                                # e.g. handed back at SIGTERM
    await _settle()
    assert started == ["s1", "s2"]
    second.cancel()
    await asyncio.gather(first, second, return_exceptions=True)
