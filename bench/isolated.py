"""Each measured system decodes in a process of its own.

Once one thread of a process has called ``llama_decode``, a later ``llama_decode`` from another
thread of the same process (an engine's decode thread) runs about 2.5x slower on a 2-core machine:
OpenMP keeps one thread team per calling thread, and two teams of busy-waiting threads share the
cores. So a benchmark that compares modes never runs two of them in one process, and the
benchmark's own process never decodes: each mode gets a spawned process (a fresh interpreter, no
llama.cpp state inherited through fork) that loads its model once and answers calls until closed.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any


class IsolatedProcess:
    """One spawned process; ``setup(*args)`` runs there first (load a model into a module global),
    then ``call(fn, ...)`` runs picklable module-level functions there, one at a time."""

    def __init__(self, setup: Callable[..., None], *args: Any) -> None:
        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=setup, initargs=args)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self._pool.submit(fn, *args).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
