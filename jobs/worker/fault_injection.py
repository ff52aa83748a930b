"""Fault-injection hooks of the worker, for tests of the whole system. Off unless set.

The engine has its own (``slotq.engine.fault_injection``: crash the engine thread, fail one admission);
these make the worker's own loops fail the way a bug would, inside a real ``slotq worker``.

``SLOTQ_FAULT_HEARTBEAT_FAIL_AT=K[,K...]``
    The worker's K-th heartbeat (1 = the first, at start-up) raises :class:`InjectedFault`. The
    supervisor must restart the heartbeat, and leases must keep being renewed afterwards.
``SLOTQ_FAULT_MEMORY_BALLAST_FILE=PATH``
    At every observation of the elastic controller the worker reads a number of MiB from PATH (a
    missing or empty file means 0) and holds that much real, touched memory, so its resident set
    grows and shrinks as a test writes the file: memory pressure without a mock.
``SLOTQ_FAULT_WARMUP_DELAY_S=S``
    The worker waits S seconds after its warm-up decode before it reports ready, so a test can see
    that nothing is claimed before then.
``SLOTQ_FAULT_BEAT_BEFORE_STOP=1``
    Right before the worker stops its background loops (the end of a drain), it lets the heartbeat
    finish a beat, sets the "beat now" event and yields once: the stop's cancellation reaches a
    heartbeat whose wait has just ended, the interleaving in which Python 3.11's
    ``asyncio.wait_for`` swallows a cancellation (CPython gh-86296) and the worker never exits.
``SLOTQ_FAULT_RENEW_AFTER_FINISH=1``
    Each job asks for a beat as it starts, and a beat sends its RENEW only once every job on its
    lease list has left the worker: a job's FINISH always reaches Redis before the RENEW that still
    names it, so the heartbeat sees a lease "lost" by a job that simply finished.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

log = logging.getLogger(__name__)

HEARTBEAT_FAIL_AT = "SLOTQ_FAULT_HEARTBEAT_FAIL_AT"
MEMORY_BALLAST_FILE = "SLOTQ_FAULT_MEMORY_BALLAST_FILE"
WARMUP_DELAY_S = "SLOTQ_FAULT_WARMUP_DELAY_S"
BEAT_BEFORE_STOP = "SLOTQ_FAULT_BEAT_BEFORE_STOP"
RENEW_AFTER_FINISH = "SLOTQ_FAULT_RENEW_AFTER_FINISH"


class InjectedFault(RuntimeError):
    """Raised by an armed hook; a plain RuntimeError, like an unexpected bug."""


@dataclass
class WorkerFaults:
    heartbeat_fail_at: frozenset[int] = frozenset()
    memory_ballast_file: Path | None = None
    warmup_delay_s: float = 0.0
    beat_before_stop: bool = False
    renew_after_finish: bool = False
    _beats: int = field(default=0, init=False)
    _ballast: bytes = field(default=b"", init=False, repr=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> WorkerFaults:
        raw = [part.strip() for part in (environ.get(HEARTBEAT_FAIL_AT) or "").split(",") if part.strip()]
        if not all(part.isdigit() and int(part) >= 1 for part in raw):
            raise ValueError(f"{HEARTBEAT_FAIL_AT} must be whole numbers >= 1 separated by commas, not {raw!r}")
        ballast = environ.get(MEMORY_BALLAST_FILE) or None
        try:
            delay = float(environ.get(WARMUP_DELAY_S) or 0)
        except ValueError:
            raise ValueError(f"{WARMUP_DELAY_S} must be a number of seconds, not {environ[WARMUP_DELAY_S]!r}") from None
        faults = cls(heartbeat_fail_at=frozenset(int(part) for part in raw),
                     memory_ballast_file=Path(ballast) if ballast else None, warmup_delay_s=delay,
                     beat_before_stop=_switch(environ, BEAT_BEFORE_STOP),
                     renew_after_finish=_switch(environ, RENEW_AFTER_FINISH))
        if (faults.heartbeat_fail_at or faults.memory_ballast_file or faults.warmup_delay_s
                or faults.beat_before_stop or faults.renew_after_finish):
            log.warning("fault injection is armed (tests only): %s", faults)
        return faults

    def on_heartbeat(self) -> None:
        self._beats += 1
        if self._beats in self.heartbeat_fail_at:
            raise InjectedFault(f"{HEARTBEAT_FAIL_AT}: heartbeat {self._beats} fails")

    async def before_loops_stop(self, beat_now: asyncio.Event, last_beat_at: Callable[[], float]) -> None:
        """``SLOTQ_FAULT_BEAT_BEFORE_STOP``: return just after the heartbeat's wait for its next turn
        has ended (``last_beat_at``: ``time.monotonic()`` at the end of the latest beat)."""
        if not self.beat_before_stop:
            return
        asked = time.monotonic()
        beat_now.set()
        while last_beat_at() < asked:        # once that beat is done, the heartbeat waits for its next turn
            await asyncio.sleep(0.01)
        beat_now.set()
        await asyncio.sleep(0)               # the wait ends; the caller's stop comes before the heartbeat runs
        log.warning("%s: the beat event fired right before the stop", BEAT_BEFORE_STOP)

    def on_job_start(self, beat_now: asyncio.Event) -> None:
        """``SLOTQ_FAULT_RENEW_AFTER_FINISH``: a beat whose lease list holds the job just started."""
        if self.renew_after_finish:
            beat_now.set()

    async def before_renew(self, jobs_still_here: Callable[[], bool]) -> None:
        """``SLOTQ_FAULT_RENEW_AFTER_FINISH``: hold the beat's RENEW until its jobs have left."""
        if not self.renew_after_finish or not jobs_still_here():
            return
        while jobs_still_here():
            await asyncio.sleep(0.01)
        log.warning("%s: RENEW sent after the jobs it names left the worker", RENEW_AFTER_FINISH)

    def hold_memory_ballast(self) -> None:
        if self.memory_ballast_file is None:
            return
        try:
            mib = int(self.memory_ballast_file.read_text().strip() or 0)
        except (OSError, ValueError):
            mib = 0
        if mib << 20 != len(self._ballast):
            self._ballast = b""                      # freed first: never hold both
            self._ballast = b"\x01" * (mib << 20)    # written, so every page is resident


def _switch(environ: Mapping[str, str], name: str) -> bool:
    value = (environ.get(name) or "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 1 (on) or 0 (off), not {value!r}")
    return value == "1"


KILL_BEFORE_TOKEN = "SLOTQ_FAULT_KILL_BEFORE_TOKEN"
KILL_AFTER_NEW_TOKENS = "SLOTQ_FAULT_KILL_AFTER_NEW_TOKENS"
KILL_WORKER_AT_START_OF = "SLOTQ_FAULT_KILL_WORKER_AT_START_OF"


@dataclass(frozen=True)
class JobFaults:
    """Hooks that SIGKILL the worker in the middle of a job (as the OOM killer or a lost node
    would), at a chosen token and after everything before it reached the job's stream, so what an
    interrupted attempt delivered is exact. Every job of the worker is subject to the first two.

    ``SLOTQ_FAULT_KILL_BEFORE_TOKEN=K``
        Dies before a job's K-th token (its count, resumed tokens included) is written: every
        attempt that gets there dies at the same place, like a job that crashes its worker
        (K = 1: before its first token).
    ``SLOTQ_FAULT_KILL_AFTER_NEW_TOKENS=M``
        Dies once an attempt has written M tokens of its own: each attempt makes progress, then dies.
    ``SLOTQ_FAULT_KILL_WORKER_AT_START_OF=ID[,ID...]``
        Dies when an attempt of one of these jobs has started and is handed to the engine, the
        point where a job that kills its worker does it (a grammar that exhausts memory, a prompt
        that crashes llama.cpp): poison jobs among ordinary ones.
    """

    kill_before_token: int | None = None
    kill_after_new_tokens: int | None = None
    kill_worker_at_start_of: frozenset[str] = frozenset()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> JobFaults:
        def count(name: str) -> int | None:
            raw = (environ.get(name) or "").strip()
            if raw and not (raw.isdigit() and int(raw) >= 1):
                raise ValueError(f"{name} must be a whole number >= 1, not {raw!r}")
            return int(raw) if raw else None

        poison = frozenset(part.strip() for part in (environ.get(KILL_WORKER_AT_START_OF) or "").split(",")
                           if part.strip())
        faults = cls(kill_before_token=count(KILL_BEFORE_TOKEN), kill_after_new_tokens=count(KILL_AFTER_NEW_TOKENS),
                     kill_worker_at_start_of=poison)
        if faults.kill_before_token or faults.kill_after_new_tokens or faults.kill_worker_at_start_of:
            log.warning("fault injection is armed (tests only): %s", faults)
        return faults

    def kill_due(self, *, delivered: int, new: int, arriving: int) -> bool:
        """Whether the worker must die before writing ``arriving`` tokens after the ``delivered``
        ones (``new`` of them by this attempt). Cheap: it runs for every text delta."""
        return ((self.kill_before_token is not None and delivered + arriving >= self.kill_before_token)
                or (self.kill_after_new_tokens is not None and new >= self.kill_after_new_tokens))

    def kills_at_start(self, job_id: str) -> bool:
        """Whether the worker must die as this job's attempt is handed to the engine."""
        return job_id in self.kill_worker_at_start_of

    async def kill_worker(self, flush: Awaitable[object]) -> NoReturn:
        """Let ``flush`` put what came before in the stream, then SIGKILL this process."""
        await flush
        log.warning("fault injection: SIGKILL")
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable: SIGKILL was sent to this process")
