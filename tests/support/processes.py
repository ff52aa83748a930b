"""Watching processes from a test: whether one still runs, and waiting for a condition."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as gone: it serves nothing and holds nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


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
