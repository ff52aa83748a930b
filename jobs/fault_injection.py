"""Fault-injection hooks of the worker, for tests of the whole system. Off unless set.

The engine has its own (``engine.fault_injection``: crash the engine thread, fail one admission);
these make the worker's own loops fail the way a bug would, inside a real ``slotq worker``.

``SLOTQ_FAULT_HEARTBEAT_FAIL_AT=K[,K...]``
    The worker's K-th heartbeat (1 = the first, at start-up) raises :class:`InjectedFault`. The
    supervisor must restart the heartbeat, and leases must keep being renewed afterwards.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

HEARTBEAT_FAIL_AT = "SLOTQ_FAULT_HEARTBEAT_FAIL_AT"


class InjectedFault(RuntimeError):
    """Raised by an armed hook; a plain RuntimeError, like an unexpected bug."""


@dataclass
class WorkerFaults:
    heartbeat_fail_at: frozenset[int] = frozenset()
    _beats: int = field(default=0, init=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> WorkerFaults:
        raw = [part.strip() for part in (environ.get(HEARTBEAT_FAIL_AT) or "").split(",") if part.strip()]
        if not all(part.isdigit() and int(part) >= 1 for part in raw):
            raise ValueError(f"{HEARTBEAT_FAIL_AT} must be whole numbers >= 1 separated by commas, not {raw!r}")
        faults = cls(heartbeat_fail_at=frozenset(int(part) for part in raw))
        if faults.heartbeat_fail_at:
            log.warning("fault injection is armed (tests only): %s", faults)
        return faults

    def on_heartbeat(self) -> None:
        self._beats += 1
        if self._beats in self.heartbeat_fail_at:
            raise InjectedFault(f"{HEARTBEAT_FAIL_AT}: heartbeat {self._beats} fails")
