"""Small asyncio building blocks that stay correct on Python 3.11."""

from __future__ import annotations

import asyncio
import contextlib


async def wait_until_set(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait at most ``timeout_s`` for ``event``; True if it is set.

    Loops that wake on an event or a period use this rather than
    ``asyncio.wait_for(event.wait(), timeout_s)``: on Python 3.11 ``wait_for`` swallows a
    cancellation that arrives once the event is set but before its own task resumes (CPython
    gh-86296, fixed in 3.12), so a ``while True`` loop built on it outlives the cancel meant to end
    it; a worker hung on SIGTERM that way. ``asyncio.timeout`` runs the wait in the caller's own
    task, so a cancellation aimed at the caller always propagates.
    """
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await event.wait()
    return event.is_set()
