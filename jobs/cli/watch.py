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
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)

TAIL_LINES = 20
PR_SET_PDEATHSIG = 1          # <linux/prctl.h>


class ChildExited(RuntimeError):
    """A watched child ended while the command still needed it; ``str()`` is the full report."""


class Watched(Protocol):
    name: str

    async def wait_ended(self) -> str:
        """Return once the child has ended, with a report: how it ended and its last log lines."""
        ...


def log_tail(path: Path, lines: int = TAIL_LINES, *, since: int = 0) -> str:
    """The last ``lines`` lines of a log file, from byte offset ``since`` on ('' if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(since, f.tell() - 64 * 1024))      # a log can be long; the tail is near the end
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def describe_returncode(code: int) -> str:
    """``exit code 1``, or ``killed by signal SIGSEGV (exit code -11)`` for a signal."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by signal {signal.Signals(-code).name} (exit code {code})"
    return f"exit code {code}"


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child receive SIGTERM when its parent dies.

    PR_SET_PDEATHSIG fires when the parent *thread* that forked the child exits, not the process.
    slotq starts its children (the embedded server, the benchmarks' workers and fleet processes) from
    the main thread (``slotq worker``/``redis`` before their event loop, ``slotq demo`` and the
    benchmarks inside ``asyncio.run`` on the main thread), and the main thread lives as long as the
    process. From any other thread the signal would kill the child when that thread ends, so there
    it is not set (with a warning).
    """
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        log.warning("a child process started outside the main thread will not stop by itself if this "
                    "process is killed")
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl     # looked up before the fork
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:        # the parent died before prctl took effect
            os._exit(1)
    return preexec


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
