"""The adapter around arq: the only module of slotq that imports it.

slotq keeps arq (pinned at 0.28.0, maintenance-only upstream) for what it does well, and nothing
else: **running one claimed job** (:class:`ArqJobRunner`). ``Worker.run_job`` reads the job record,
counts the attempt, honours an abort requested before the start, runs the job function under
``job_timeout``, classifies how it ended (``Retry``, ``RetryJob``, abort, cancellation, failure,
success) and builds the result record. Everything around it -- claiming, leases, wake-ups,
preemption, and the finishing writes as fenced scripts -- is slotq's
(:mod:`slotq.jobs.worker.runtime`, :mod:`slotq.jobs.protocol.scripts`).

The record formats and key names that ``run_job`` reads and writes, which the queue's scripts and
producers share, are written out in :mod:`slotq.jobs.protocol.arq_formats` (checked against arq's
own by a test): importing any arq module loads ``arq.worker``, which a producer must not.

arq's ``Worker`` is held, not inherited by slotq's runtime: the rest of slotq sees
:class:`ArqJobRunner`'s few typed methods. Inside, a private subclass overrides only the two
finishing writes ``run_job`` calls. Where the runner relies on arq 0.28 internals beyond its
documented API, the code says which and why; a new arq version must be checked against those places.

**On a Redis Cluster** arq sees each job under its *arq id* (:meth:`QueueKeys.arq_id
<slotq.jobs.protocol.keys.QueueKeys.arq_id>`: the queue's hash tag, then the job id), so the keys
``run_job`` builds from it -- the job record, the attempt counter -- share the queue's slot with the
scripts that write them; the runner maps ids both ways, and slotq's side only ever sees job ids.
``run_job`` opens with a MULTI over the record, the counter and ``arq:abort`` (a key of another
slot), which a cluster refuses, so arq gets the client behind :class:`_PipelinesWithoutMulti`:
the same commands, in one round trip per node, not atomic together. Nothing needs them to be: the
claim's lease already makes the attempt the job's only one.

This module imports nothing else of slotq but :mod:`~slotq.jobs.protocol.arq_formats` and
:mod:`~slotq.jobs.protocol.keys`; only the worker imports it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, cast

from arq.connections import ArqRedis
from arq.worker import Retry, RetryJob, Worker, func
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from slotq.jobs.protocol.arq_formats import Deserializer, Serializer
from slotq.jobs.protocol.keys import PartitionedKeys, QueueKeys

__all__ = [
    # what a job function raises: retry after a delay, or hand the job back
    "Retry", "RetryJob",
    "ArqJobRunner", "Attempt", "Deserializer", "ExitKind", "JobExit", "Serializer",
]

# ---------------------------------------------------------------------------- running a job
@dataclass(frozen=True)
class Attempt:
    """What a job function is told about the attempt it runs."""

    job_id: str
    number: int              # 1 for the job's first attempt (arq's ``job_try``)
    enqueued_at: float       # when the job was enqueued (epoch seconds, from its record)


class ExitKind(Enum):
    FINISHED = "finished"          # for good (success, failure, abort, out of tries): store the result record
    RETRY_LATER = "retry_later"    # ``Retry(defer=...)``: back to the queue once its backoff has passed
    HAND_BACK = "hand_back"        # cancelled (shutdown, preemption, lost lease) or ``RetryJob``: no try used


@dataclass(frozen=True)
class JobExit:
    """How an attempt left, as arq's ``run_job`` decided it."""

    kind: ExitKind
    result: bytes | None = None    # FINISHED: the result record (None: results are not kept)
    result_ttl_ms: int = 0         # FINISHED: how long producers may read it
    retry_delay_ms: int = 0        # RETRY_LATER: the backoff the job asked for (``Retry(defer=...)``)


JobFunction = Callable[[Attempt, Any], Awaitable[Any]]
OnExit = Callable[[str, JobExit], Awaitable[None]]


class _Worker(Worker):
    """arq's ``Worker`` with its two finishing writes handed to slotq.

    arq 0.28's ``run_job`` ends every job through ``self.finish_job`` (after the function ran) or
    ``self.finish_failed_job`` (failed before it could run); overriding them is the only way arq
    offers to replace those writes. Nothing else of the ``Worker`` is overridden, and its own loop
    (``main``, ``start_jobs``, ``close``, signals) is never run."""

    def __init__(self, on_exit: OnExit, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._report_exit = on_exit
        # job id -> the delay of the Retry its function raised. arq hands finish_job only the shift of
        # the job's score, the delay plus the time since that score by this host's clock; the queue
        # counts the delay from Redis' clock instead (scripts.RETRY_LATER), so it needs the delay alone.
        self.retry_delays: dict[str, int] = {}

    async def finish_job(self, job_id: str, finish: bool, result_data: bytes | None, result_timeout_s: float | None,
                         keep_result_forever: bool, incr_score: int | None, keep_in_progress: float | None) -> None:
        # A Retry without a delay leaves incr_score None (its score unchanged): a hand-back, as before.
        retry_delay_ms = self.retry_delays.pop(job_id, 0)
        if finish:
            exit_ = JobExit(ExitKind.FINISHED, result_data, int(1000 * (result_timeout_s or self.keep_result_s)))
        elif incr_score:
            exit_ = JobExit(ExitKind.RETRY_LATER, retry_delay_ms=retry_delay_ms)
        else:
            exit_ = JobExit(ExitKind.HAND_BACK)
        await self._report_exit(job_id, exit_)

    async def finish_failed_job(self, job_id: str, result_data: bytes | None) -> None:
        await self._report_exit(job_id, JobExit(ExitKind.FINISHED, result_data, int(self.keep_result_s * 1000)))


class _PipelinesWithoutMulti:
    """A cluster client whose ``pipeline()`` ignores ``transaction=True`` (see the module): arq's
    only use of a transaction is to send a few commands in one round trip."""

    def __init__(self, redis: RedisCluster) -> None:
        self._redis = redis

    def pipeline(self, transaction: bool = True) -> Any:
        return self._redis.pipeline()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._redis, name)


class ArqJobRunner:
    """Runs claimed jobs through arq's ``Worker.run_job``, one task per attempt.

    ``job(attempt, payload)`` is the job function (registered as ``function_name``, the name job
    records carry); ``on_exit(job_id, exit)`` is awaited once per attempt that reached arq's
    outcome, with how it left, and does the finishing write. arq sends its own commands on
    ``redis``: reading the job record, counting the attempt, checking aborts. ``keys``: the
    queue's, whose arq ids arq sees (see the module); a partitioned queue's give each job its
    partition's arq id."""

    def __init__(self, *, function_name: str, job: JobFunction, on_exit: OnExit, redis: Redis,
                 keys: QueueKeys | PartitionedKeys, job_timeout_s: float, keep_result_s: float, max_tries: int,
                 serializer: Serializer, deserializer: Deserializer) -> None:
        self._job = job
        self._keys = keys

        async def exited(arq_id: str, exit_: JobExit) -> None:
            await on_exit(keys.job_id(arq_id), exit_)

        # run_job sends only plain commands on its pool (GET, INCR, EXPIRE, ZREM, SETEX), in MULTIs on one Redis
        pool = _PipelinesWithoutMulti(redis) if isinstance(redis, RedisCluster) else redis
        self._worker = _Worker(
            exited, functions=[func(self._call, name=function_name)], redis_pool=cast(ArqRedis, pool),
            queue_name=keys.queue, handle_signals=False, job_timeout=job_timeout_s, keep_result=keep_result_s,
            max_tries=max_tries, allow_abort_jobs=True, job_serializer=serializer, job_deserializer=deserializer,
            log_results=False)
        # arq logs every job's arguments (the prompt) at INFO; slotq logs its own prompt-free lines.
        logging.getLogger("arq.worker").setLevel(max(logging.WARNING, logging.getLogger().getEffectiveLevel()))

    def start(self, job_id: str, ready_ms: int) -> asyncio.Task[None]:
        """Run an attempt of the claimed job ``job_id`` (``ready_ms``: its ready time, arq's score,
        which only arq's own log lines use). The task ends after ``on_exit``."""
        return asyncio.get_running_loop().create_task(self._worker.run_job(self._keys.arq_id(job_id), ready_ms))

    async def _call(self, ctx: dict[str, Any], payload: Any) -> Any:
        # run_job's per-job ctx (arq 0.28): job_id, job_try (the retry counter it just incremented),
        # enqueue_time (a datetime from the job record) and score.
        arq_id = ctx["job_id"]
        try:
            result = await self._job(Attempt(self._keys.job_id(arq_id), ctx["job_try"],
                                             ctx["enqueue_time"].timestamp()), payload)
        except Retry as retry:
            self._worker.retry_delays[arq_id] = retry.defer_score or 0
            raise
        # An abort that came too late to stop the job: run_job clears aborting_tasks only when the
        # cancellation lands, and a later attempt of this job here would otherwise count as aborted.
        self._worker.aborting_tasks.discard(arq_id)
        return result

    # job_tasks (arq 0.28): job id -> the task of the job function, set by run_job while the
    # function runs (not during its prelude or its finishing write). Cancelling that task is how
    # arq itself stops a job; run_job then classifies the CancelledError.
    def function_running(self, job_id: str) -> bool:
        """Whether the job function of ``job_id`` runs now (its prelude is over, its end not reached)."""
        return self._keys.arq_id(job_id) in self._worker.job_tasks

    def cancel(self, job_id: str) -> None:
        """Cancel the running job function of ``job_id``, if any: the attempt is handed back
        (unless it is being aborted); it checks for itself whether it lost its lease."""
        task = self._worker.job_tasks.get(self._keys.arq_id(job_id))
        if task is not None:
            task.cancel()

    def cancel_all(self) -> None:
        """Cancel every running job function once (a second cancel would interrupt its hand-back)."""
        for task in list(self._worker.job_tasks.values()):
            if not task.cancelling():
                task.cancel()

    async def check_aborts(self) -> None:
        """Cancel the running jobs that a producer asked to abort (``arq:abort``).

        Calls arq 0.28's private ``_cancel_aborted_jobs``: it reads the aborts, cancels the
        matching job functions and marks them in ``aborting_tasks``, which ``run_job`` reads to
        record the cancellation as an abort (final) instead of a hand-back. arq has no public call
        for it (its own poll loop makes it), and the marks must be the ones ``run_job`` reads."""
        await self._worker._cancel_aborted_jobs()

    def is_aborting(self, job_id: str) -> bool:
        """Whether ``job_id``'s attempt is being aborted (``aborting_tasks``, see :meth:`check_aborts`)."""
        return self._keys.arq_id(job_id) in self._worker.aborting_tasks

    @property
    def jobs_complete(self) -> int:
        """Attempts that returned (arq's count)."""
        return self._worker.jobs_complete

    @property
    def jobs_failed(self) -> int:
        """Jobs that ended failed or aborted, including those arq failed before running (arq's count)."""
        return self._worker.jobs_failed
