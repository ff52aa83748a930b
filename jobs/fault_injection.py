"""Fault-injection hooks of the worker, for tests of the whole system. Off unless set.

The engine has its own (``engine.fault_injection``: crash the engine thread, fail one admission);
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
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

HEARTBEAT_FAIL_AT = "SLOTQ_FAULT_HEARTBEAT_FAIL_AT"
MEMORY_BALLAST_FILE = "SLOTQ_FAULT_MEMORY_BALLAST_FILE"
WARMUP_DELAY_S = "SLOTQ_FAULT_WARMUP_DELAY_S"


class InjectedFault(RuntimeError):
    """Raised by an armed hook; a plain RuntimeError, like an unexpected bug."""


@dataclass
class WorkerFaults:
    heartbeat_fail_at: frozenset[int] = frozenset()
    memory_ballast_file: Path | None = None
    warmup_delay_s: float = 0.0
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
                     memory_ballast_file=Path(ballast) if ballast else None, warmup_delay_s=delay)
        if faults.heartbeat_fail_at or faults.memory_ballast_file or faults.warmup_delay_s:
            log.warning("fault injection is armed (tests only): %s", faults)
        return faults

    def on_heartbeat(self) -> None:
        self._beats += 1
        if self._beats in self.heartbeat_fail_at:
            raise InjectedFault(f"{HEARTBEAT_FAIL_AT}: heartbeat {self._beats} fails")

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
