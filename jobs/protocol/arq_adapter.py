"""The adapter around arq: the only module of slotq that imports it.

slotq keeps arq (pinned at 0.28.0, maintenance-only upstream) for what it does well, and nothing
else:

* **Running one claimed job** (:class:`ArqJobRunner`): ``Worker.run_job`` reads the job record,
  counts the attempt, honours an abort requested before the start, runs the job function under
  ``job_timeout``, classifies how it ended (``Retry``, ``RetryJob``, abort, cancellation, failure,
  success) and builds the result record. Everything around it -- claiming, leases, wake-ups,
  preemption, and the finishing writes as fenced scripts -- is slotq's
  (:mod:`slotq.jobs.worker.runtime`, :mod:`slotq.jobs.protocol.scripts`).
* **The record formats and key names** that ``run_job`` reads and writes, which the queue's
  scripts therefore share: the job record an enqueue writes (:func:`job_record`), the result
  record a producer reads (:func:`result_record`, :func:`read_result_record`), and how an
  exception that arq stores as a result is serialized (:func:`exception_data`).
* **Its connection helpers** (``RedisSettings``, ``create_pool``, ``ArqRedis``), which
  :mod:`slotq.jobs.protocol.connection` builds every Redis client with.

arq's ``Worker`` is held, not inherited by slotq's runtime: the rest of slotq sees
:class:`ArqJobRunner`'s few typed methods. Inside, a private subclass overrides only the two
finishing writes ``run_job`` calls. Where the runner relies on arq 0.28 internals beyond its
documented API, the code says which and why; a new arq version must be checked against those places.

This module imports nothing else of slotq, so any protocol module may import it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, cast

from arq.connections import ArqRedis, RedisSettings, create_pool
from arq.constants import abort_jobs_ss, job_key_prefix, result_key_prefix, retry_key_prefix
from arq.jobs import Deserializer, Serializer, deserialize_result, serialize_job, serialize_result
from arq.worker import Retry, RetryJob, Worker, func
from redis.asyncio import Redis

__all__ = [
    # arq's key names: run_job reads and writes these keys, so the queue's scripts use them too (keys.py)
    "abort_jobs_ss", "job_key_prefix", "result_key_prefix", "retry_key_prefix",
    # its connection helpers (connection.py)
    "ArqRedis", "RedisSettings", "create_pool",
    # what a job function raises: retry after a delay, or hand the job back
    "Retry", "RetryJob",
    "ArqJobRunner", "Attempt", "Deserializer", "ExitKind", "JobExit", "ResultRecord", "Serializer", "exception_data",
    "job_record", "read_result_record", "result_record",
]

# ---------------------------------------------------------------------------- records
_EXCEPTION = "__exception__"


def exception_data(exc: BaseException) -> dict[str, str]:
    """How an exception is serialized: arq stores one as the result of a job it failed (expired,
    aborted, out of tries, timed out), and msgpack cannot carry it."""
    return {_EXCEPTION: type(exc).__name__, "message": str(exc)}


def job_record(function: str, payload: Any, enqueued_ms: int, serializer: Serializer) -> bytes:
    """The job record an enqueue writes (``JOB_RECORD_PREFIX + id``): ``function(payload)``."""
    return serialize_job(function, (payload,), {}, None, enqueued_ms, serializer=serializer)


def result_record(job_id: str, function: str, value: Any, queue_name: str, now_ms: int,
                  serializer: Serializer) -> bytes:
    """The result record of a job that no worker ran (e.g. cancelled while queued), stored as a
    success with ``value`` and attempt 0."""
    record = serialize_result(function, (), {}, 0, now_ms, True, value, now_ms, now_ms, job_id, queue_name, job_id,
                              serializer=serializer)
    assert record is not None, "arq returns None only when even its fallback record cannot be serialized"
    return record


@dataclass(frozen=True)
class ResultRecord:
    """A finished job's result record (:func:`read_result_record`)."""

    attempts: int                       # the attempt that ended the job (0: no worker ran it)
    output: dict[str, Any] | None       # what the job function returned, when it returned a mapping
    cancelled: bool                     # aborted: arq stored a CancelledError
    error: str                          # a failure's exception class ("" when the record names none)
    message: str                        # a failure's message (the stored value's text when it has none)


def read_result_record(raw: bytes, deserializer: Deserializer) -> ResultRecord:
    """Decode a result record, whether the job function returned or arq failed the job and stored
    an exception (:func:`exception_data`)."""
    record = deserialize_result(raw, deserializer=deserializer)
    value = record.result
    if isinstance(value, dict):
        error, message = value.get(_EXCEPTION, ""), value.get("message", str(value))
    else:
        error, message = "", str(value)
    return ResultRecord(attempts=record.job_try, output=value if record.success and isinstance(value, dict) else None,
                        cancelled=error == "CancelledError", error=error, message=message)


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


class ArqJobRunner:
    """Runs claimed jobs through arq's ``Worker.run_job``, one task per attempt.

    ``job(attempt, payload)`` is the job function (registered as ``function_name``, the name job
    records carry); ``on_exit(job_id, exit)`` is awaited once per attempt that reached arq's
    outcome, with how it left, and does the finishing write. arq sends its own commands on
    ``redis``: reading the job record, counting the attempt, checking aborts."""

    def __init__(self, *, function_name: str, job: JobFunction, on_exit: OnExit, redis: Redis, queue_name: str,
                 job_timeout_s: float, keep_result_s: float, max_tries: int, serializer: Serializer,
                 deserializer: Deserializer) -> None:
        self._job = job
        # run_job sends only plain commands on its pool (GET, INCR, EXPIRE, ZREM, SETEX): any client does.
        self._worker = _Worker(
            on_exit, functions=[func(self._call, name=function_name)], redis_pool=cast(ArqRedis, redis),
            queue_name=queue_name, handle_signals=False, job_timeout=job_timeout_s, keep_result=keep_result_s,
            max_tries=max_tries, allow_abort_jobs=True, job_serializer=serializer, job_deserializer=deserializer,
            log_results=False)
        # arq logs every job's arguments (the prompt) at INFO; slotq logs its own prompt-free lines.
        logging.getLogger("arq.worker").setLevel(max(logging.WARNING, logging.getLogger().getEffectiveLevel()))

    def start(self, job_id: str, ready_ms: int) -> asyncio.Task[None]:
        """Run an attempt of the claimed job ``job_id`` (``ready_ms``: its ready time, arq's score,
        which only arq's own log lines use). The task ends after ``on_exit``."""
        return asyncio.get_running_loop().create_task(self._worker.run_job(job_id, ready_ms))

    async def _call(self, ctx: dict[str, Any], payload: Any) -> Any:
        # run_job's per-job ctx (arq 0.28): job_id, job_try (the retry counter it just incremented),
        # enqueue_time (a datetime from the job record) and score.
        job_id = ctx["job_id"]
        try:
            result = await self._job(Attempt(job_id, ctx["job_try"], ctx["enqueue_time"].timestamp()), payload)
        except Retry as retry:
            self._worker.retry_delays[job_id] = retry.defer_score or 0
            raise
        # An abort that came too late to stop the job: run_job clears aborting_tasks only when the
        # cancellation lands, and a later attempt of this job here would otherwise count as aborted.
        self._worker.aborting_tasks.discard(job_id)
        return result

    # job_tasks (arq 0.28): job id -> the task of the job function, set by run_job while the
    # function runs (not during its prelude or its finishing write). Cancelling that task is how
    # arq itself stops a job; run_job then classifies the CancelledError.
    def function_running(self, job_id: str) -> bool:
        """Whether the job function of ``job_id`` runs now (its prelude is over, its end not reached)."""
        return job_id in self._worker.job_tasks

    def cancel(self, job_id: str) -> None:
        """Cancel the running job function of ``job_id``, if any: the attempt is handed back
        (unless it is being aborted); it checks for itself whether it lost its lease."""
        task = self._worker.job_tasks.get(job_id)
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
        return job_id in self._worker.aborting_tasks

    @property
    def jobs_complete(self) -> int:
        """Attempts that returned (arq's count)."""
        return self._worker.jobs_complete

    @property
    def jobs_failed(self) -> int:
        """Jobs that ended failed or aborted, including those arq failed before running (arq's count)."""
        return self._worker.jobs_failed
