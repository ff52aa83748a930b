"""Errors the job layer raises to producers. Each says what happened and what to do about it.

They share :class:`SlotqError`, so a web app can catch everything slotq raises in one place; the
``slotq`` commands print the message as one line and exit non-zero instead of a traceback.
"""

from __future__ import annotations


class SlotqError(Exception):
    """Base class of slotq's own errors."""


class RedisUnavailable(SlotqError, ConnectionError):
    """Redis could not be reached (nothing listening, wrong password, TLS or DNS failure)."""


class QueueFull(SlotqError):
    """The queue holds ``max_queue_length`` jobs; nothing was enqueued. Retry later (HTTP 429).

    ``depth`` jobs were waiting where the job would have gone, against ``limit``. Of a queue split into
    partitions (``SLOTQ_QUEUE_PARTITIONS``) that is the job's partition (``partition`` of ``partitions``) and
    its share of ``SLOTQ_MAX_QUEUE_LENGTH`` (``max_queue_length``), ``ceil(max_queue_length / partitions)``: a
    job's partition is its id's, so one partition may be full while the queue as a whole holds fewer jobs
    than the setting says, and the message names the partition and the share rather than leave a limit the
    user never set unexplained."""

    def __init__(self, depth: int, limit: int, *, partition: int | None = None, partitions: int = 1,
                 max_queue_length: int | None = None) -> None:
        self.depth = depth
        self.limit = limit
        self.partition = partition
        self.partitions = partitions
        self.max_queue_length = limit if max_queue_length is None else max_queue_length
        if partition is None:
            super().__init__(f"queue is full: {depth} jobs waiting, limit {limit} (SLOTQ_MAX_QUEUE_LENGTH)")
            return
        super().__init__(
            f"queue is full: partition {partition} of {partitions} holds {depth} jobs waiting, its share "
            f"(ceil({self.max_queue_length} / {partitions}) = {limit}) of SLOTQ_MAX_QUEUE_LENGTH="
            f"{self.max_queue_length} under SLOTQ_QUEUE_PARTITIONS={partitions} (partitions 0..{partitions - 1}: "
            "a job's partition is its id's, so one may fill before the others)")


class QuotaExceeded(SlotqError):
    """A tenant's quota (``SLOTQ_TENANT_*``) refused the job; nothing was enqueued. ``quota`` is
    ``waiting``, ``in_flight`` or ``tokens``. Retry after ``retry_after_s`` (the tokens quota's next
    minute), or once one of the tenant's jobs starts or ends (None). HTTP 429."""

    def __init__(self, message: str, *, tenant: str, quota: str, retry_after_s: float | None) -> None:
        super().__init__(message)
        self.tenant = tenant
        self.quota = quota
        self.retry_after_s = retry_after_s


class JobRejected(SlotqError, ValueError):
    """The request cannot run on the workers that serve this queue; nothing was enqueued.
    ``field`` names the offending request field."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


class QueueServedByAnotherModel(SlotqError):
    """A worker may not join a queue that live workers of another model or kind serve: the jobs on
    it were queued for theirs. It says which queue, which model and how to give this one its own."""

    def __init__(self, *, queue: str, model: str, kind: str, other_worker: str, other_model: str,
                 other_kind: str) -> None:
        super().__init__(
            f"queue {queue!r} is served by model {other_model!r} ({other_kind} jobs, worker {other_worker}); this "
            f"worker serves {model!r} ({kind} jobs) and may not join it. Give it a queue of its own: "
            f"SLOTQ_QUEUE_NAME (--queue-name), e.g. SLOTQ_QUEUE_NAME=slotq:queue:{model}; or stop the workers of "
            f"{other_model!r} first")
        self.queue = queue
        self.other_model = other_model


class QueuePartitionsDiffer(SlotqError):
    """This process splits a queue into another number of partitions (``SLOTQ_QUEUE_PARTITIONS``) than the
    live workers serving it: its jobs would sit in partitions those workers never claim, or it would claim
    from partitions that no producer fills. Set the same count everywhere (drain the queue to change it)."""

    def __init__(self, *, queue: str, partitions: int, other_partitions: int, other: str) -> None:
        super().__init__(
            f"queue {queue!r} is split into {other_partitions} partitions by {other}, but this process uses "
            f"SLOTQ_QUEUE_PARTITIONS={partitions}; set SLOTQ_QUEUE_PARTITIONS={other_partitions} here (or stop "
            f"those workers and drain the queue before changing the count)")
        self.queue = queue
        self.partitions = partitions
        self.other_partitions = other_partitions


class JobNotFound(SlotqError, LookupError):
    """No such job: never enqueued, or its result expired."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job {job_id!r} (never enqueued, or its result expired)")
        self.job_id = job_id


class JobTimeout(SlotqError, TimeoutError):
    """The job did not finish within the time the caller was willing to wait (it keeps running)."""


class StreamGone(SlotqError, LookupError):
    """A job's output stream can no longer give the entries a reader is missing: it expired
    (``stream_ttl_s``), was trimmed past the reader's position (``stream_maxlen``), or the job
    ended without writing a final entry. The job's result (``client.result``) may still be there."""

    def __init__(self, job_id: str, last_id: str, why: str) -> None:
        super().__init__(f"the output stream of job {job_id!r} {why}; the last entry read was {last_id}")
        self.job_id = job_id
        self.last_id = last_id


class JobFailed(SlotqError):
    """A job the caller waited for ended without its answer: failed (``code`` is its error's, e.g.
    ``invalid_request`` for an input over the model's limit) or cancelled (``code`` ``cancelled``)."""

    def __init__(self, job_id: str, code: str, message: str) -> None:
        super().__init__(f"job {job_id!r} {'was cancelled' if code == 'cancelled' else f'failed: {code}: {message}'}")
        self.job_id = job_id
        self.code = code
