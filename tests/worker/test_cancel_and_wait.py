"""``cancel_and_wait`` (jobs/aio.py), which the runtime's and the stream reader's ``close()`` use to
stop their tasks: the task's own end is ignored, a cancellation aimed at the caller is not."""

from __future__ import annotations

import asyncio

import pytest

from slotq.jobs.aio import cancel_and_wait


async def test_the_task_is_cancelled_and_its_end_ignored() -> None:
    forever = asyncio.create_task(asyncio.Event().wait())
    await asyncio.sleep(0)
    await cancel_and_wait(forever)
    assert forever.cancelled()


async def test_an_error_the_task_raised_is_ignored_and_none_is_nothing() -> None:
    async def fails() -> None:
        raise RuntimeError("its own failure")

    failed = asyncio.create_task(fails())
    await asyncio.wait([failed])
    await cancel_and_wait(failed)
    await cancel_and_wait(None)


async def test_a_cancel_aimed_at_the_caller_propagates() -> None:
    """The caller is cancelled while the task is still ending (a loop that flushes on its way out):
    ``suppress(BaseException)`` took that cancel for the task's and the caller carried on."""
    stopping, never = asyncio.Event(), asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            stopping.set()
            await never.wait()          # ended by the second cancel: the one aimed at the caller
            raise

    inner = asyncio.create_task(slow_to_stop())
    await asyncio.sleep(0)
    closing = asyncio.create_task(cancel_and_wait(inner))
    await stopping.wait()
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert inner.cancelled()
