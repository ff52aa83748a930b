"""A file's blocking calls, off the event loop, in the order they were asked for.

The gateway runs Batch API jobs as bulk runs inside its own event loop, beside every HTTP request
it serves, so a bulk run must never make the loop wait on a disk: a slow disk (or a 100 MB output
written in bursts) would stall every stream the gateway is sending. Each open input or output gets
one :class:`FileThread`, and every read, write, fsync and close of it runs there.

Why one thread per file rather than ``asyncio.to_thread``: the calls must keep their order. The
output's records must be written before the fsync that makes them durable (the run then removes
their results from Redis), and both before the close; ``asyncio.to_thread`` hands calls to a shared
pool in no order. A call also runs to its end when the coroutine that asked for it is cancelled
(it is shielded), so a cancelled run never leaves half a batch of records unwritten behind an fsync
that claims them. Memory stays flat: the caller awaits each call, so one batch of lines or records
is in flight per file.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class FileThread:
    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def call(self, function: Callable[..., T], *args: object) -> T:
        """``function(*args)`` in this file's thread, after every call asked for before it."""
        return await asyncio.shield(asyncio.get_running_loop().run_in_executor(self._executor, function, *args))

    def close(self, last: Callable[[], object] | None = None) -> None:
        """End the thread once the calls asked for so far, then ``last`` (if given), have run;
        returns at once (for a ``finally`` that may not await, such as an async generator's)."""
        if last is not None:
            self._executor.submit(last)
        self._executor.shutdown(wait=False)
