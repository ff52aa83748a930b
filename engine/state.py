"""The engine's life: running, failed (its thread crashed) or closed. Shared by all threads.

A dead engine thread must never look like an idle one: requests sent to it would wait forever.
So the state is explicit, requests are refused at once when it is not RUNNING, and the owner (the
worker) can await the failure instead of polling for it.

    RUNNING --close()--> CLOSED        clean: submits raise EngineStopped
    RUNNING --crash----> FAILED        submits raise EngineDead; wait_failed() returns the exception
    CLOSED  --crash----> FAILED        a crash while shutting down is still reported
FAILED is final: closing a failed engine frees its resources but it stays FAILED.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from enum import StrEnum

from slotq.engine.errors import EngineDead, EngineStopped


class EngineState(StrEnum):
    RUNNING = "running"
    FAILED = "failed"
    CLOSED = "closed"


class Lifecycle:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.state = EngineState.RUNNING
        self.failure: BaseException | None = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[BaseException]]] = []

    def raise_unless_running(self) -> None:
        """Raise :class:`EngineDead` (retryable) or :class:`EngineStopped` unless RUNNING."""
        if self.state is EngineState.FAILED:
            assert self.failure is not None
            raise EngineDead.from_crash(self.failure)
        if self.state is EngineState.CLOSED:
            raise EngineStopped("the engine is closed")

    def while_running(self, action: Callable[[], None]) -> None:
        """Run ``action`` (queue a command) only while RUNNING, atomically with the state: the
        engine thread ends by setting the state, then draining its queue, so a command queued
        here is always drained, and one refused here never reaches the queue."""
        with self._lock:
            self.raise_unless_running()
            action()

    def close(self) -> None:
        with self._lock:
            if self.state is EngineState.RUNNING:
                self.state = EngineState.CLOSED

    def fail(self, exc: BaseException) -> None:
        """Engine thread: the thread is dying of ``exc``. Wakes every :meth:`wait_failed` on its
        own event loop."""
        with self._lock:
            if self.state is EngineState.FAILED:
                return
            self.state, self.failure = EngineState.FAILED, exc
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, future, exc)
            except RuntimeError:       # that event loop is closed: nobody is waiting there any more
                pass

    async def wait_failed(self) -> BaseException:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.failure is not None:
                return self.failure
            future: asyncio.Future[BaseException] = loop.create_future()
            entry = (loop, future)
            self._waiters.append(entry)
        try:
            return await future
        finally:
            with self._lock:
                if entry in self._waiters:
                    self._waiters.remove(entry)


def _resolve(future: asyncio.Future[BaseException], exc: BaseException) -> None:
    if not future.done():          # the waiter may have been cancelled meanwhile
        future.set_result(exc)
