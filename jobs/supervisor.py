"""Supervised background loops: a worker's heartbeat, metrics and listeners never die quietly.

A loop that raises is logged with its traceback, reported to Sentry (when ``SENTRY_DSN`` is set;
``capture_exception`` is a no-op otherwise) and restarted after a short backoff. A loop that
returns is restarted too: background loops are meant to run for the life of the worker.
``on_restart`` (e.g. a metric) is told the loop's name at each restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import sentry_sdk

log = logging.getLogger(__name__)

Loop = Callable[[], Awaitable[None]]


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
            self.restarts[name] += 1
            if self.on_restart is not None:
                self.on_restart(name)
            if time.monotonic() - started > 60:
                delay = self.restart_delay_s          # it ran well for a while: not a crash loop
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.max_delay_s)

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
