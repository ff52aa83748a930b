"""Fail fast when a child that a command depends on has ended.

The demo and the benchmarks wait on things only a child can bring about: a worker appearing in
Redis, a job's stream reaching its end. If that child dies (a model that does not load, a bad
setting, a crash inside llama.cpp), such a wait never ends and the command hangs without a word.
:func:`run_watched` runs the command's body and stops it the moment any watched child ends,
raising :class:`ChildExited` with what the user needs: the exit code (or the exception) and the
last lines of the child's log.

Children are subprocesses (:class:`ChildProcess`, output in a log file) or asyncio tasks
(:class:`WatchedTask`, e.g. the demo's in-process worker).
"""

from __future__ import annotations

import asyncio
import subprocess
import traceback
from collections.abc import Awaitable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar

from slotq.jobs.child_processes import TAIL_LINES, describe_returncode, die_with_parent, log_tail

T = TypeVar("T")


class ChildExited(RuntimeError):
    """A watched child ended while the command still needed it; ``str()`` is the full report."""


class Watched(Protocol):
    name: str

    async def wait_ended(self) -> str:
        """Return once the child has ended, with a report: how it ended and its last log lines."""
        ...


class ChildProcess:
    """A subprocess whose stdout and stderr go to ``log_path``, so its last lines can be shown. It
    gets SIGTERM when this process dies (:func:`die_with_parent`), so a benchmark stopped by a signal
    leaves no worker or fleet process behind."""

    def __init__(self, name: str, argv: Sequence[str], *, log_path: Path, env: Mapping[str, str] | None = None,
                 cwd: Path | None = None, poll_s: float = 0.1) -> None:
        self.name = name
        self.log_path = log_path
        self._poll_s = poll_s
        self._log: IO[bytes] = open(log_path, "ab")  # noqa: SIM115 - open for the child's lifetime; closed in stop()
        self.proc = subprocess.Popen(list(argv), env=dict(env) if env is not None else None, cwd=cwd,
                                     stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent())

    def report(self) -> str:
        code = self.proc.poll()
        state = "is still running" if code is None else f"exited ({describe_returncode(code)})"
        tail = log_tail(self.log_path)
        return f"{self.name} (pid {self.proc.pid}) {state}; last lines of {self.log_path}:\n{tail or '(empty)'}"

    async def wait_ended(self) -> str:
        while self.proc.poll() is None:
            await asyncio.sleep(self._poll_s)
        return self.report()

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


class WatchedTask:
    """An asyncio task that must keep running while the command needs it (an in-process worker)."""

    def __init__(self, name: str, task: asyncio.Task[Any]) -> None:
        self.name = name
        self.task = task

    async def wait_ended(self) -> str:
        await asyncio.wait({self.task})
        if self.task.cancelled():
            return f"{self.name} was cancelled"
        exc = self.task.exception()
        if exc is None:
            return f"{self.name} stopped without an error"
        lines = "".join(traceback.format_exception(exc)).rstrip().splitlines()
        return f"{self.name} failed: {type(exc).__name__}: {exc}\nlast lines of its traceback:\n" + \
            "\n".join(lines[-TAIL_LINES:])


async def run_watched(body: Awaitable[T], *children: Watched) -> T:
    """Await ``body``; if a child ends first, cancel the body and raise :class:`ChildExited`."""
    body_task = asyncio.ensure_future(body)
    watchers = {asyncio.create_task(child.wait_ended()): child for child in children}
    try:
        done, _ = await asyncio.wait({body_task, *watchers}, return_when=asyncio.FIRST_COMPLETED)
        if body_task in done:
            return body_task.result()
        raise ChildExited(next(w for w in watchers if w in done).result())
    finally:
        pending = [t for t in (body_task, *watchers) if not t.done()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
