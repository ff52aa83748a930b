"""The producer API: enqueue jobs, follow their streams, await results, cancel.

    async with await SlotqClient.connect("redis://...") as client:
        job = await client.enqueue(JobRequest(prompt="Hello", max_tokens=64))
        async for text in job.text():
            print(text, end="")
        result = await job.result(timeout=60)

:class:`SyncSlotqClient` offers the same calls for Flask, Django and scripts.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from arq.connections import ArqRedis
from arq.constants import abort_jobs_ss, in_progress_key_prefix, job_key_prefix, result_key_prefix, retry_key_prefix
from arq.jobs import Job, JobStatus as ArqJobStatus, serialize_result

from engine import ErrorInfo, FinishReason
from jobs import dead_letters
from jobs.keys import JOB_FUNCTION, WAKE_CHANNEL, WORKER_PREFIX, stream_key
from jobs.connection import connect
from jobs.errors import JobNotFound, JobRejected, JobTimeout, QueueFull
from jobs.payload import decode_payload, encode_payload
from jobs.schemas import EntryKind, JobRequest, JobResult, JobStatus, QueueInfo, StreamEntry, WorkerInfo
from jobs.serialization import deserialize, serialize
from jobs.settings import ClientSettings
from jobs.stream import StreamWriter, read_stream

__all__ = ["JobHandle", "JobNotFound", "JobRejected", "JobTimeout", "QueueFull", "SlotqClient"]

WORKERS_CACHE_S = 5.0     # how long enqueue trusts its last read of the workers' advertised limits


# Atomically take a job that no worker has claimed out of the queue. Touching the in-progress
# key also breaks the WATCH of a worker that is claiming it at this very moment.
_CANCEL_QUEUED = """
if redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
if not redis.call('ZSCORE', KEYS[2], ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], 'cancelled', 'PX', 10000)
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('DEL', KEYS[3])
return 1
"""


class JobHandle:
    """A job's id plus the calls that concern it."""

    def __init__(self, client: SlotqClient, job_id: str, *, created: bool = True) -> None:
        self.client = client
        self.id = job_id
        self.created = created     # False when an idempotency key matched an existing job

    def stream(self, last_id: str = "0-0") -> AsyncIterator[StreamEntry]:
        return self.client.stream(self.id, last_id=last_id)

    def text(self) -> AsyncIterator[str]:
        return self.client.text(self.id)

    async def result(self, timeout: float | None = None) -> JobResult:
        return await self.client.result(self.id, timeout=timeout)

    async def status(self) -> JobStatus:
        return await self.client.status(self.id)

    async def cancel(self) -> bool:
        return await self.client.cancel(self.id)

    def __repr__(self) -> str:
        return f"JobHandle({self.id!r})"


class SlotqClient:
    """A producer's view of one queue. ``for_queue`` gives a client of another queue (another
    model) on the same connections; only the client that connected closes them."""

    def __init__(self, redis: ArqRedis, settings: ClientSettings, *, owns_connection: bool = True) -> None:
        self.redis = redis
        self.settings = settings
        self._owns_connection = owns_connection
        self._cancel_script = redis.register_script(_CANCEL_QUEUED)
        self._workers_cache: tuple[float, list[WorkerInfo]] | None = None

    @classmethod
    async def connect(cls, redis_url: str, settings: ClientSettings | None = None) -> SlotqClient:
        """Connect and check that Redis answers; raises RedisUnavailable within
        ``redis_connect_timeout_s`` when it does not."""
        settings = settings or ClientSettings()
        pool = await connect(redis_url, patient=False, connect_timeout_s=settings.redis_connect_timeout_s,
                             queue_name=settings.queue_name)
        return cls(pool, settings)

    def for_queue(self, queue_name: str) -> SlotqClient:
        """A client of ``queue_name`` sharing this client's connections."""
        return SlotqClient(self.redis, self.settings.model_copy(update={"queue_name": queue_name}),
                           owns_connection=False)

    async def close(self) -> None:
        if self._owns_connection:
            await self.redis.aclose()

    async def __aenter__(self) -> SlotqClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ enqueue
    async def enqueue(self, request: JobRequest | str, **fields: Any) -> JobHandle:
        """Queue a job. ``request`` is a JobRequest, or a text plus JobRequest fields; the text is
        sent as the user's chat message (the model's chat template applies, as in llama.cpp's
        conversation mode). For a raw completion prompt pass ``JobRequest(prompt=...)``.

        Raises pydantic.ValidationError (field named), JobRejected (a limit the workers of this
        queue advertise, e.g. max_tokens beyond their context) or QueueFull; nothing is queued then.
        """
        if isinstance(request, str):
            if "messages" in fields:
                raise TypeError("enqueue() got a text and messages=; give one of them")
            request = JobRequest(messages=[{"role": "user", "content": request}], **fields)
        elif fields:
            request = JobRequest.model_validate({**request.model_dump(exclude_unset=True), **fields})
        await self._check_fits(request)
        job_id = request.idempotency_key or uuid.uuid4().hex
        depth = await self.redis.zcard(self.settings.queue_name)
        if depth >= self.settings.max_queue_length:
            existing = await self.redis.exists(job_key_prefix + job_id, result_key_prefix + job_id)
            if not existing:
                raise QueueFull(depth, self.settings.max_queue_length)
        job = await self.redis.enqueue_job(JOB_FUNCTION, encode_payload(request),
                                           _job_id=job_id, _queue_name=self.settings.queue_name)
        if job is not None:
            await self.redis.publish(WAKE_CHANNEL, job_id)
        return JobHandle(self, job_id, created=job is not None)

    def job(self, job_id: str) -> JobHandle:
        return JobHandle(self, job_id, created=False)

    # ------------------------------------------------------------------ reading
    async def stream(self, job_id: str, *, last_id: str = "0-0", block_ms: int = 1000) -> AsyncIterator[StreamEntry]:
        """Every stream entry after ``last_id`` until the final one. Pass the last id you saw to
        resume after a dropped connection: nothing is missed or repeated."""

        async def gone() -> bool:
            # The final entry is written before the result, so once the job has a terminal status
            # a quiet stream has nothing more to give (e.g. a reader resuming after the end).
            return await self.status(job_id) not in (JobStatus.QUEUED, JobStatus.RUNNING)

        async for entry in read_stream(self.redis, job_id, last_id=last_id, block_ms=block_ms, idle_check=gone):
            yield entry

    async def text(self, job_id: str) -> AsyncIterator[str]:
        """Just the text of choice 0, as it arrives. Retried attempts continue seamlessly."""
        async for entry in self.stream(job_id):
            if entry.kind == EntryKind.CHUNK and entry.choice == 0 and entry.text:
                yield entry.text

    async def result(self, job_id: str, timeout: float | None = None) -> JobResult:
        """Wait for the job's result. The job's stream doubles as the wake-up signal, so waiting
        costs one blocked XREAD, not a poll loop."""
        deadline = None if timeout is None else time.monotonic() + timeout
        job = Job(job_id, self.redis, _queue_name=self.settings.queue_name, _deserializer=deserialize)
        last_id = "0-0"
        missing = 0
        while True:
            info = await job.result_info()
            if info is not None:
                return _to_job_result(job_id, info.success, info.result, info.job_try)
            missing = missing + 1 if await job.status() == ArqJobStatus.not_found else 0
            if missing >= 3:   # not a momentary gap (e.g. a cancel between its two writes)
                raise JobNotFound(job_id)
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise JobTimeout(f"job {job_id} did not finish within {timeout} s")
            block = 200 if remaining is None else max(1, min(200, int(remaining * 1000)))
            response = await self.redis.xread({stream_key(job_id): last_id}, count=1000, block=block)
            for _key, entries in response or ():
                last_id = entries[-1][0]
                if any(raw.get(b"f") == b"1" for _id, raw in entries):
                    await asyncio.sleep(0.002)   # the result lands right after the final entry

    async def status(self, job_id: str) -> JobStatus:
        job = Job(job_id, self.redis, _queue_name=self.settings.queue_name, _deserializer=deserialize)
        arq_status = await job.status()
        if arq_status == ArqJobStatus.complete:
            info = await job.result_info()
            return _to_job_result(job_id, info.success, info.result, info.job_try).status if info else JobStatus.NOT_FOUND
        return {
            ArqJobStatus.in_progress: JobStatus.RUNNING,
            ArqJobStatus.queued: JobStatus.QUEUED,
            ArqJobStatus.deferred: JobStatus.QUEUED,
        }.get(arq_status, JobStatus.NOT_FOUND)

    # ------------------------------------------------------------------ cancel
    async def cancel(self, job_id: str) -> bool:
        """Cancel a job. A queued job never starts; a running one stops at the next decode step
        and its stream ends with finish_reason 'cancelled'. False if it had already finished."""
        taken = await self._cancel_script(
            keys=[in_progress_key_prefix + job_id, self.settings.queue_name, job_key_prefix + job_id], args=[job_id])
        if taken == -1:
            await self.redis.zadd(abort_jobs_ss, {job_id: int(time.time() * 1000)})
            return True
        if taken == 0:
            return False
        result = JobResult(id=job_id, status=JobStatus.CANCELLED, finish_reason=FinishReason.CANCELLED)
        now_ms = int(time.time() * 1000)
        await self.redis.psetex(result_key_prefix + job_id, self.settings.keep_result_s * 1000, serialize_result(
            JOB_FUNCTION, (), {}, 0, now_ms, True, result.model_dump(mode="json"), now_ms, now_ms, job_id,
            self.settings.queue_name, job_id, serializer=serialize))
        writer = StreamWriter(self.redis, flush_ms=1, maxlen=self.settings.stream_maxlen,
                              ttl_s=self.settings.stream_ttl_s)
        writer.add(job_id, StreamEntry(id="", kind=EntryKind.DONE, attempt=0,
                                       finish_reason=FinishReason.CANCELLED, final=True))
        await writer.write_all(job_id)
        return True

    async def requeue_dead_letter(self, job_id: str) -> bool:
        """Run a dead-lettered job again under the same id, from scratch (its old result and
        stream are removed). False when the record holds no valid request."""
        letter = await dead_letters.get(self.redis, job_id)
        if letter is None or letter.payload is None:
            return False
        request = decode_payload(letter.payload).request
        if request is None:
            return False
        await self.redis.delete(result_key_prefix + job_id, retry_key_prefix + job_id, stream_key(job_id))
        await self.redis.enqueue_job(JOB_FUNCTION, encode_payload(request),
                                     _job_id=job_id, _queue_name=self.settings.queue_name)
        await self.redis.publish(WAKE_CHANNEL, job_id)
        await dead_letters.remove(self.redis, job_id)
        return True

    # ------------------------------------------------------------------ fleet
    async def workers(self) -> list[WorkerInfo]:
        """Every live worker on this Redis (all queues), from their heartbeats."""
        workers = []
        async for key in self.redis.scan_iter(match=f"{WORKER_PREFIX}*", count=100):
            raw = await self.redis.hgetall(key)
            if raw:
                workers.append(WorkerInfo.model_validate({k.decode(): v.decode() for k, v in raw.items()}))
        return sorted(workers, key=lambda w: w.id)

    async def _check_fits(self, request: JobRequest) -> None:
        """Refuse what no live worker of this queue could ever run. The prompt's token count is
        only known to a worker, so the check is ``max_tokens`` against the largest per-sequence
        context advertised (the prompt takes at least one token). With no live worker, accept."""
        now = time.monotonic()
        if self._workers_cache is None or now - self._workers_cache[0] > WORKERS_CACHE_S:
            self._workers_cache = (now, await self.workers())
        contexts = [w.ctx for w in self._workers_cache[1] if w.queue == self.settings.queue_name and w.ctx]
        if contexts and request.max_tokens >= max(contexts):
            raise JobRejected(
                f"max_tokens is {request.max_tokens}; the workers of queue {self.settings.queue_name!r} have a "
                f"per-sequence context of {max(contexts)} tokens, which must hold the prompt and max_tokens",
                field="max_tokens")

    async def queue_info(self) -> QueueInfo:
        now_ms = time.time() * 1000
        entries = await self.redis.zrange(self.settings.queue_name, 0, 9999, withscores=True)
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id, _score in entries:
                pipe.exists(in_progress_key_prefix + job_id.decode())
            in_progress = await pipe.execute()
        queued_scores = [s for (j, s), busy in zip(entries, in_progress) if not busy and s <= now_ms]
        workers = [w for w in await self.workers() if w.queue == self.settings.queue_name]
        return QueueInfo(
            queue=self.settings.queue_name,
            queued=len(queued_scores),
            deferred=sum(1 for (j, s), busy in zip(entries, in_progress) if not busy and s > now_ms),
            running=sum(1 for busy in in_progress if busy),
            oldest_queued_age_s=(now_ms - min(queued_scores)) / 1000 if queued_scores else None,
            workers=workers,
            dead_letters=await dead_letters.count(self.redis),
        )


def _to_job_result(job_id: str, success: bool, raw: Any, attempts: int) -> JobResult:
    """Our job function returns a JobResult; arq stores an exception record when it failed a job
    without running it (expired, aborted before start, timeout)."""
    if success and isinstance(raw, dict) and "status" in raw:
        return JobResult.model_validate(raw)
    name = raw.get("__exception__", "") if isinstance(raw, dict) else ""
    message = raw.get("message", str(raw)) if isinstance(raw, dict) else str(raw)
    if name == "CancelledError":
        return JobResult(id=job_id, status=JobStatus.CANCELLED, finish_reason=FinishReason.CANCELLED, attempts=attempts)
    return JobResult(id=job_id, status=JobStatus.FAILED, finish_reason=FinishReason.ERROR, attempts=attempts,
                     error=ErrorInfo(code=(name or "job_failed").lower(), message=message or name, retryable=False))
