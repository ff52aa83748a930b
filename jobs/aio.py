"""Small asyncio building blocks that stay correct on Python 3.11."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


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


async def cancel_and_wait(task: asyncio.Future[Any] | None) -> None:
    """Cancel ``task`` and wait until it has ended, whatever it ended with; a cancellation aimed at
    the caller still propagates.

    ``task.cancel(); with suppress(BaseException): await task`` swallows both: while the caller waits
    for ``task``, a cancel aimed at the caller (a ``close()`` being cancelled by its own shutdown)
    arrives as the same ``CancelledError`` the task ended with, and was dropped, so the caller went
    on as if nothing had asked it to stop. Here the task's own end (its ``CancelledError``, or an
    error it raised) is ignored, and the caller's cancellation is re-raised: it is told apart by
    ``asyncio.current_task().cancelling()``, which counts the cancels aimed at the caller.
    """
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
    except Exception:
        pass            # the task's own failure: ignored, as before (whoever ran it reports it)
