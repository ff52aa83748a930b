"""Children that die with the process that started them, and a report of how one ended.

Shared by every process that starts a child: the embedded Redis server (:mod:`slotq.jobs.redis_server`,
which a worker, ``slotq redis`` and the demo start) and :mod:`slotq.jobs.cli.watch` (the demo's and the
benchmarks' children). Kept out of ``cli`` so that the embedded server, which the gateway also uses,
does not depend on the command line.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

TAIL_LINES = 20
PR_SET_PDEATHSIG = 1          # <linux/prctl.h>


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
