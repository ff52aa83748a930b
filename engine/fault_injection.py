"""Fault-injection hooks for tests of the whole system. Off unless an environment variable sets them.

They exist so that tests can make the real engine fail the way a bug or a bad allocation would,
inside a real worker process, without mocks. Each engine reads the variables once, when it starts,
and logs a warning when any hook is armed, so a hook left on in production is visible at once.

``SLOTQ_FAULT_ENGINE_CRASH_AFTER_STEPS=N``
    The engine thread raises :class:`InjectedFault` right after its N-th ``llama_decode`` step:
    the engine dies (see ``slotq.engine.runner``: every request ends with ``engine_dead``).
``SLOTQ_FAULT_ADMISSION_MARKER=TEXT``
    Admitting a request whose prompt (or any chat message) contains TEXT raises
    :class:`InjectedFault` where its sampler chains are built: only that request fails.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from slotq.engine.request import GenerationRequest

log = logging.getLogger(__name__)

CRASH_AFTER_STEPS = "SLOTQ_FAULT_ENGINE_CRASH_AFTER_STEPS"
ADMISSION_MARKER = "SLOTQ_FAULT_ADMISSION_MARKER"


class InjectedFault(RuntimeError):
    """Raised by an armed hook. A RuntimeError on purpose: the engine must treat it like any
    unexpected exception, not like one of its own :class:`~slotq.engine.errors.EngineError`s."""


@dataclass(frozen=True)
class EngineFaults:
    crash_after_steps: int | None = None
    admission_marker: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> EngineFaults:
        steps = environ.get(CRASH_AFTER_STEPS) or None
        if steps is not None and not (steps.isdigit() and int(steps) >= 1):
            raise ValueError(f"{CRASH_AFTER_STEPS} must be a whole number >= 1, not {steps!r}")
        faults = cls(crash_after_steps=int(steps) if steps else None,
                     admission_marker=environ.get(ADMISSION_MARKER) or None)
        if faults.armed:
            log.warning("fault injection is armed (tests only): %s", faults)
        return faults

    @property
    def armed(self) -> bool:
        return self.crash_after_steps is not None or self.admission_marker is not None

    def after_decode_step(self, decode_steps: int) -> None:
        if self.crash_after_steps is not None and decode_steps >= self.crash_after_steps:
            raise InjectedFault(f"{CRASH_AFTER_STEPS}={self.crash_after_steps}: crashing the engine thread")

    def on_admission(self, request: GenerationRequest) -> None:
        marker = self.admission_marker
        if marker is None:
            return
        texts = [request.prompt or ""] + [m.content for m in request.messages or ()]
        if any(marker in text for text in texts):
            raise InjectedFault(f"{ADMISSION_MARKER}: failing the sampler set-up of request {request.id}")
