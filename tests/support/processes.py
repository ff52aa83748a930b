"""Watching processes from a test: whether one still runs, freezing one, and waiting for a condition."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as gone: it serves nothing and holds nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@contextmanager
def frozen(pid: int) -> Iterator[None]:
    """The process ``pid`` stopped (SIGSTOP) for the block, continued (SIGCONT) after it however it ends: a
    server frozen so keeps its connections open and its kernel acknowledges what is sent, but nothing
    answers (as under a VM pause or a network black hole that drops packets)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s")
        time.sleep(0.05)


async def wait_for_async(condition: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    """:func:`wait_for` for a condition that asks Redis (or anything else awaited)."""
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s")
        await asyncio.sleep(0.05)
