"""Shared fixtures, and the rule that the suite's child processes end with the run.

Tests start real processes: Valkey servers (the session's, Sentinel set-ups, servers restarted
from a thread), ``slotq worker``/``gateway``/``redis`` subprocesses. Fixture teardown stops them
when a run ends normally or with Ctrl-C (pytest turns SIGINT into KeyboardInterrupt and still tears
down). A run stopped with SIGTERM (a CI time limit, ``timeout``, a closed terminal with SIGHUP)
runs no teardown at all, and a Valkey left behind that way was found holding a test's temp dir.

So this module ends every descendant of the pytest process itself:

* on SIGTERM or SIGHUP, a handler sends SIGTERM to every descendant (found in /proc, so children
  of any test, started from any thread, in their own session or not, and their children too),
  waits up to :data:`CHILD_EXIT_WAIT_S`, SIGKILLs what is left, then lets the signal take its
  ordinary course (pytest dies of it, exactly as before);
* at the end of every run (``pytest_unconfigure``), whatever a test leaked is ended the same way.

Why not ``PR_SET_PDEATHSIG`` on every child: the suite starts children in many places, some from
threads, and the parent-death signal fires when the *thread* that forked the child exits, so a
server restarted from ``asyncio.to_thread`` would be killed at once or not protected at all. One
handler here covers them all. What no handler can cover is SIGKILL of pytest itself; there the
embedded servers' and ``ChildProcess`` children's own ``PR_SET_PDEATHSIG``
(``slotq.jobs.child_processes.die_with_parent``, main thread only) still applies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from slotq.engine import bundled_model_path
from tests.support.tiny_model import TINY_SCALE, TINY_SEED, write_tiny_llama, write_tiny_reranker

# Fixtures every folder uses: a session Valkey, clients and in-process workers (tests/support/jobs.py).
# Helpers (not fixtures) are imported by name from tests.support.*; folder-only fixtures live in that
# folder's conftest.py.
pytest_plugins = ["tests.support.jobs"]


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny.gguf", seed=TINY_SEED, scale=TINY_SCALE)


@pytest.fixture(scope="session")
def tiny_reranker_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BERT cross-encoder with rank pooling: the suite's reranker (``slotq worker`` serves rerank jobs on it)."""
    return write_tiny_reranker(tmp_path_factory.mktemp("reranker") / "tiny-reranker.gguf")


@pytest.fixture(scope="session")
def real_model_path() -> Path:
    return bundled_model_path()


# ---------------------------------------------------------------------- child processes end with the run
CHILD_EXIT_WAIT_S = 5.0
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _descendants(root: int) -> list[int]:
    """Every live process below ``root``, parents before their children."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            parent = _stat(int(entry.name))
            if parent is not None and parent[0] != "Z":
                children.setdefault(parent[1], []).append(int(entry.name))
    found: list[int] = []
    queue = [root]
    while queue:
        below = children.get(queue.pop(), [])
        found += below
        queue += below
    return found


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process from /proc, None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def _running(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def end_child_processes() -> None:
    """SIGTERM every descendant of this process, then SIGKILL those still running after
    :data:`CHILD_EXIT_WAIT_S`. The tree is read once, before anything is signalled: a child whose
    parent dies is re-parented and could no longer be found."""
    pids = _descendants(os.getpid())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in filter(_running, pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + CHILD_EXIT_WAIT_S
        while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)


def _end_children_then_die(signum: int, frame: FrameType | None) -> None:
    end_child_processes()
    signal.signal(signum, _previous_handlers.get(signum) or signal.SIG_DFL)
    os.kill(os.getpid(), signum)


_previous_handlers: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}


def pytest_configure(config: pytest.Config) -> None:
    if sys.platform.startswith("linux"):
        for signum in _STOP_SIGNALS:
            if signal.getsignal(signum) != signal.SIG_IGN:        # under nohup SIGHUP stays ignored
                _previous_handlers[signum] = signal.signal(signum, _end_children_then_die)


def pytest_unconfigure(config: pytest.Config) -> None:
    if sys.platform.startswith("linux"):
        end_child_processes()
