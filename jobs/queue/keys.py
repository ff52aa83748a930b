"""Every Redis key of a queue, and the arq record keys the job runtime shares with it.

A queue ``Q`` (one per model, ``SLOTQ_QUEUE_NAME``) with lanes ``L`` (highest priority first):

================================  ======  ===========================================================
``Q:waiting:L``                   ZSET    job id -> ready time (ms); claimed lowest first (FIFO)
``Q:deferred:L``                  ZSET    job id -> run-at time (ms) of a retry waiting out its backoff
``Q:running:L``                   ZSET    job id -> lease deadline (ms); the reaper requeues expired ones
``Q:jobs``                        HASH    job id -> ``lane<TAB>ready time`` for every job in the queue
``Q:owners``                      HASH    job id -> lease of the attempt running it (``<worker token>#<claim number>``)
``Q:progress``                    HASH    job id -> ``accounted<TAB>started<TAB>tokens<TAB>interruptions`` (see below)
``Q:attempt_outcomes``            HASH    ``interrupted`` / ``failed`` -> attempts judged so, since the queue began
``Q:wake``                        LIST    one token per waiting job (capped): an idle worker BLPOPs one
``Q:abort:<token>``               PUBSUB  cancel requests for the jobs of one worker
``arq:job:<id>``                  STRING  the job record in arq's format (function, payload, enqueue time)
``arq:retry:<id>``                STRING  attempt counter (arq's ``run_job`` increments it)
``arq:result:<id>``               STRING  the result record in arq's format
``arq:abort``                     ZSET    arq's pending aborts (checked by ``run_job`` before a job starts)
================================  ======  ===========================================================

``Q:progress`` is how a lost attempt is told from a failed one (:mod:`jobs.queue.scripts`,
``START_ATTEMPT``): attempts up to ``accounted`` have been judged; attempt ``started`` began with
``tokens`` delivered tokens in the job's stream; ``interruptions`` earlier attempts were lost after
delivering new tokens, and so spent no try.

Counts are O(1): ZCARD of a lane's sets, HLEN of ``Q:jobs`` (everything not finished, the demand
KEDA scales on). This module is the only place that knows arq's key names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from arq.constants import abort_jobs_ss, job_key_prefix, result_key_prefix, retry_key_prefix

LANE_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


def job_record_key(job_id: str) -> str:
    return job_key_prefix + job_id


def retry_counter_key(job_id: str) -> str:
    return retry_key_prefix + job_id


def result_key(job_id: str) -> str:
    return result_key_prefix + job_id


ABORTS = abort_jobs_ss


@dataclass(frozen=True)
class QueueKeys:
    """The key names of one queue and its lanes."""

    queue: str
    lanes: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.lanes or len(set(self.lanes)) != len(self.lanes):
            raise ValueError(f"lanes must be distinct and at least one: {self.lanes}")
        for lane in self.lanes:
            if not LANE_RE.match(lane):
                raise ValueError(f"lane {lane!r}: use 1-32 of a-z 0-9 _ - starting with a letter")

    def waiting(self, lane: str) -> str:
        return f"{self.queue}:waiting:{lane}"

    def deferred(self, lane: str) -> str:
        return f"{self.queue}:deferred:{lane}"

    def running(self, lane: str) -> str:
        return f"{self.queue}:running:{lane}"

    @property
    def jobs(self) -> str:
        return f"{self.queue}:jobs"

    @property
    def owners(self) -> str:
        return f"{self.queue}:owners"

    @property
    def progress(self) -> str:
        return f"{self.queue}:progress"

    @property
    def attempt_outcomes(self) -> str:
        return f"{self.queue}:attempt_outcomes"

    @property
    def wake(self) -> str:
        return f"{self.queue}:wake"

    def abort_channel(self, token: str) -> str:
        return f"{self.queue}:abort:{token}"

    def lane_triples(self) -> list[str]:
        """waiting, deferred, running of every lane, highest priority first (the claim order)."""
        return [key for lane in self.lanes for key in (self.waiting(lane), self.deferred(lane), self.running(lane))]
