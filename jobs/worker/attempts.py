"""What a job's attempts have cost it: tries, interruptions and worker deaths, and what a failure costs.

Tries count failures, not interruptions. An attempt that was lost with its worker (killed,
stalled past its lease) is judged when the next one starts: if the job's stream grew while it ran,
it was *interrupted* and spent no try (the next attempt resumes from what it delivered); if not,
it *failed* like an attempt that raised a retryable error, so a job that kills its worker before
its first token, or at the same token every time, is still dead-lettered after ``max_tries``.
``max_interruptions`` bounds the rest, so nothing runs forever.

A job that kills workers is stopped sooner: once ``max_worker_deaths`` of its started attempts in
a row were lost without progress, the next attempt refuses to run it and dead-letters it
(``killed_its_worker``), and after one such death it starts only isolated in its worker
(:mod:`slotq.jobs.worker.start_gate`), so the jobs beside it are not taken for killers.

An error an attempt meets while it runs is classified by :meth:`AttemptAccount.classify`: the
engine died (the job is handed back, no try used), not retryable (the job fails now), retryable
with tries left (retried after a backoff that doubles each try) or on its last try (dead-lettered).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass

from slotq.engine import EngineDead
from slotq.jobs.protocol import dead_letters
from slotq.jobs.protocol.redis_queue import AttemptLedger, AttemptStart, AttemptVerdict
from slotq.jobs.protocol.wire import ErrorInfo
from slotq.jobs.worker import metrics
from slotq.jobs.worker.settings import WorkerSettings
from slotq.jobs.worker.start_gate import StartGate

log = logging.getLogger(__name__)

ENGINE_DEAD = EngineDead.code


class Failure(enum.Enum):
    """What an error met while the attempt runs does to the job (:meth:`AttemptAccount.classify`)."""

    HAND_BACK = "hand_back"          # the worker's engine died: not the job's fault, no try used
    FAIL = "fail"                    # not retryable: the job ends failed
    RETRY = "retry"                  # retryable, tries left: again after :meth:`AttemptAccount.retry_delay_s`
    DEAD_LETTER = "dead_letter"      # retryable, but this was the last try


@dataclass(frozen=True)
class DeadLetter:
    """Why an attempt dead-letters its job before running it, and the worker deaths in a row behind it."""

    error: ErrorInfo
    worker_deaths: int = 0


class AttemptAccount:
    """The accounting of attempt ``attempt`` of ``job_id``. ``ledger`` judges lost attempts
    (interrupted or failed); without one (arq's own queue, as the arq baseline runs) every attempt
    spends a try. ``gate``: the worker's, where suspects start isolated (with a ledger; without one,
    a suspect starts like any job)."""

    def __init__(self, *, job_id: str, attempt: int, settings: WorkerSettings, ledger: AttemptLedger | None,
                 gate: StartGate | None) -> None:
        self.job_id = job_id
        self.attempt = attempt
        self.settings = settings
        self.ledger = ledger
        self.gate = gate
        self.interruptions = 0       # earlier attempts lost after delivering new tokens: no try spent

    @property
    def tries(self) -> int:
        """Tries spent with this attempt: the attempts so far that were not interruptions."""
        return self.attempt - self.interruptions

    # ------------------------------------------------------------------ at the start
    async def start(self, delivered_tokens: int) -> AttemptStart | None:
        """Judge the attempts lost before this one and note where this one starts (the queue's
        ``START_ATTEMPT``; ``delivered_tokens``: what the stream holds): the last one was an
        interruption, spending no try, if the stream grew while it ran, else a failure and a worker
        death. At ``max_worker_deaths`` deaths in a row the attempt is refused; a suspect (fewer,
        but some) is not started yet: see :meth:`start_isolated`. None: no ledger."""
        if self.ledger is None:
            return None
        if self.gate is not None:
            await self.gate.enter(self.job_id)
        start = await self._ledger_start(delivered_tokens, isolated=self.gate is None)
        self.interruptions = start.interruptions
        metrics.ATTEMPTS_LOST.labels(counted_as="interruption").inc(start.interrupted)
        metrics.ATTEMPTS_LOST.labels(counted_as="failure").inc(start.failed)
        if start.interrupted or start.failed:
            log.warning("job %s attempt %d: of the attempts lost before it, %d had delivered new tokens (interrupted, "
                        "no try spent) and %d had not (failed, a try each); try %d, %d interruptions so far, %d "
                        "worker deaths in a row", self.job_id, self.attempt, start.interrupted, start.failed,
                        self.tries, self.interruptions, start.worker_deaths)
        return start

    def dead_letter(self, start: AttemptStart | None, delivered_tokens: int) -> DeadLetter | None:
        """Why this attempt must dead-letter its job instead of running it, if it must: it killed
        its worker too often, its tries or its interruptions are spent."""
        if start is not None and start.verdict == AttemptVerdict.REFUSED:
            return DeadLetter(ErrorInfo(code=dead_letters.KILLED_ITS_WORKER, retryable=False, message=(
                f"its last {start.worker_deaths} attempts that started ended with their worker dying (killed, out of "
                f"memory, crashed) or stalling past its lease before delivering any token; at SLOTQ_MAX_WORKER_DEATHS "
                f"({self.settings.max_worker_deaths}) it is not run again")), worker_deaths=start.worker_deaths)
        if self.tries > self.settings.max_tries:
            return DeadLetter(ErrorInfo(code="tries_exhausted", retryable=True, message=(
                f"attempt {self.attempt} would be try {self.tries}, over max_tries ({self.settings.max_tries}): the "
                f"earlier attempts failed or were lost before delivering new tokens (does the job kill its worker?); "
                f"{self.interruptions} interrupted after making progress did not count")))
        if self.interruptions > self.settings.max_interruptions:
            return DeadLetter(ErrorInfo(code="interruptions_exhausted", retryable=True, message=(
                f"{self.interruptions} attempts were lost after making progress, over max_interruptions "
                f"({self.settings.max_interruptions}); the stream holds {delivered_tokens} tokens")))
        return None

    async def start_isolated(self, delivered_tokens: int, worker_deaths: int) -> None:
        """A suspect starts once it is alone in this worker without progress (the worker's
        :class:`~slotq.jobs.worker.start_gate.StartGate`), so that if it kills the worker, no other
        job's attempt dies with it before making progress."""
        assert self.ledger is not None and self.gate is not None
        log.warning("job %s attempt %d: its last %d started attempts were lost with their worker before any progress; "
                    "it starts once it is alone here without progress", self.job_id, self.attempt, worker_deaths)
        await self.gate.enter_isolated(self.job_id)
        await self._ledger_start(delivered_tokens, isolated=True)

    async def _ledger_start(self, delivered_tokens: int, *, isolated: bool) -> AttemptStart:
        """The queue's ``START_ATTEMPT`` for this attempt; a lease lost meanwhile cancels the run."""
        assert self.ledger is not None
        start = await self.ledger.start(self.attempt, delivered_tokens,
                                        max_worker_deaths=self.settings.max_worker_deaths, isolated=isolated)
        if not start.owned:
            raise asyncio.CancelledError(f"job {self.job_id}: lease lost before the start")
        return start

    # ------------------------------------------------------------------ on an error
    def classify(self, error: ErrorInfo) -> Failure:
        """What ``error``, met while this attempt ran, does to the job."""
        if error.code == ENGINE_DEAD:
            return Failure.HAND_BACK
        if not error.retryable:
            return Failure.FAIL
        if self.tries >= self.settings.max_tries:
            return Failure.DEAD_LETTER
        return Failure.RETRY

    def retry_delay_s(self) -> float:
        """The backoff before the next try: ``retry_backoff_s``, doubled for each try spent before this one."""
        return self.settings.retry_backoff_s * 2.0 ** (self.tries - 1)
