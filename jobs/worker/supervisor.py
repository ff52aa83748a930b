"""Supervised background loops: a worker's heartbeat, metrics and listeners never die quietly.

A loop that raises is logged with its traceback, reported to Sentry (when ``SENTRY_DSN`` is set;
``capture_exception`` is a no-op otherwise) and restarted after a short backoff. A loop that
returns is restarted too: background loops are meant to run for the life of the worker.
``on_restart`` (e.g. a metric) is told the loop's name at each restart.

Stopping is bounded (:meth:`Supervisor.stop`): the worker's exit bound must hold even if a loop
ignores its cancellation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import sentry_sdk

log = logging.getLogger(__name__)

Loop = Callable[[], Awaitable[None]]

STOP_WAIT_S = 3.0      # per round of Supervisor.stop: a loop ends at its next await once cancelled


class Supervisor:
    def __init__(self, *, restart_delay_s: float = 1.0, max_delay_s: float = 30.0,
                 on_restart: Callable[[str], None] | None = None) -> None:
        self.on_restart = on_restart
        self.restart_delay_s = restart_delay_s
        self.max_delay_s = max_delay_s
        self.restarts: dict[str, int] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, name: str, loop: Loop) -> None:
        self.restarts[name] = 0
        self._tasks[name] = asyncio.create_task(self._keep_running(name, loop), name=f"slotq-{name}")

    async def _keep_running(self, name: str, loop: Loop) -> None:
        delay = self.restart_delay_s
        this_task = asyncio.current_task()
        assert this_task is not None
        while True:
            started = time.monotonic()
            try:
                await loop()
                log.error("background loop %s returned; restarting it", name)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("background loop %s failed (%s: %s); restarting it in %.1f s",
                              name, type(exc).__name__, exc, delay)
                sentry_sdk.capture_exception(exc)
            if this_task.cancelling():
                return          # it ended while being stopped (it swallowed the cancel): a stop, not a crash
            self.restarts[name] += 1
            if self.on_restart is not None:
                self.on_restart(name)
            if time.monotonic() - started > 60:
                delay = self.restart_delay_s          # it ran well for a while: not a crash loop
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.max_delay_s)

    async def stop(self, wait_s: float = STOP_WAIT_S, *, only: tuple[str, ...] | None = None) -> None:
        """Cancel every loop and wait up to ``wait_s`` for them to end; cancel the ones still
        running again and wait as long once more; log any that would not stop and leave it.

        Never longer than ``2 * wait_s``: a loop that swallows its cancellation (Python 3.11's
        ``asyncio.wait_for`` can, CPython gh-86296) must not keep the worker from exiting. And
        ``asyncio.wait`` does not swallow a cancellation aimed at the caller: it propagates, with
        every loop already cancelled. ``only``: stop those loops (the others go on), e.g. the ones
        bound to a model that a worker unloads.
        """
        names = {task: name for name, task in self._tasks.items() if only is None or name in only}
        for name in names.values():
            del self._tasks[name]
        running = set(names)
        for _ in range(2):
            if not running:
                return
            for task in running:
                task.cancel()
            _, running = await asyncio.wait(running, timeout=wait_s)
        for task in running:
            log.error("background loop %s did not stop within %.0f s of two cancellations; leaving it behind",
                      names[task], 2 * wait_s)
