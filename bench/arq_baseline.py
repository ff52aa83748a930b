"""The claim path slotq used before the queue redesign, kept only as the fleet benchmark's baseline.

Reconstructed from main at 77e1be9 (``git show 77e1be9:jobs/worker.py``, ``jobs/client.py``,
``jobs/lease.py``) so that ``slotq bench fleet`` can show what the redesign changed, measured by
the same simulator in the same run. Nothing in slotq uses it.

What it keeps from that code, as it was:

* arq's stock ``Worker`` poll loop on one sorted set (``SLOTQ_QUEUE_NAME``): while a slot is free,
  every ``poll_delay`` (50 ms then) it reads up to ``queue_read_limit`` (1000) ids from the head
  of the set, where running jobs stay until they finish;
* slotq's tweaks: one pipelined ``EXISTS`` of arq's in-progress key for every id read, to skip
  running jobs before arq's per-job claim (``WATCH``, ``EXISTS``, ``ZSCORE``, ``MULTI``,
  ``PSETEX``, ``EXEC``); the in-progress key set to the worker's lease token when the job starts
  and renewed by the heartbeat (one script per job); a ``PUBLISH`` on ``slotq:wake`` per enqueue,
  which every worker receives and answers with a poll; a finished job wakes its own worker;
* the producer's enqueue: ``ZCARD`` (queue length limit), arq's ``enqueue_job`` (``WATCH`` /
  ``MULTI``), then the ``PUBLISH``.

What is shared with the current worker, so only the claim path differs: the job function
(:class:`~slotq.jobs.worker.job_run.JobRun`), the stream writer, the simulated engine and the readers. One
difference flatters the baseline: its stream writes skip the lease check the old script made
(one command fewer per job and flush).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from arq.connections import ArqRedis, RedisSettings
from arq.constants import in_progress_key_prefix
from arq.worker import Worker, func
from redis.asyncio import Redis
from redis.exceptions import RedisError

from slotq.jobs.errors import QueueFull
from slotq.jobs.producer.client import JobHandle, SlotqClient
from slotq.jobs.protocol import registry
from slotq.jobs.protocol.connection import redis_settings
from slotq.jobs.protocol.keys import JOB_FUNCTION
from slotq.jobs.protocol.payload import encode_payload
from slotq.jobs.protocol.schemas import JobRequest, WorkerInfo
from slotq.jobs.protocol.serialization import deserialize, serialize
from slotq.jobs.settings import ClientSettings
from slotq.jobs.worker.engine_api import EngineFactory, JobEngine
from slotq.jobs.worker.job_run import JobRun
from slotq.jobs.worker.settings import WorkerSettings
from slotq.jobs.worker.stream_writer import StreamWriter

log = logging.getLogger(__name__)

WAKE_CHANNEL = "slotq:wake"
POLL_DELAY_S = 0.05          # the old SLOTQ_POLL_DELAY_S default
QUEUE_READ_LIMIT = 1000      # the old SLOTQ_QUEUE_READ_LIMIT default

# The old lease renewal (jobs/lease.py at 77e1be9). KEYS: lock, queue; ARGV: token, job id, ttl ms.
RENEW_SCRIPT = """
local holder = redis.call('GET', KEYS[1])
if holder ~= ARGV[1] then
  if holder or not redis.call('ZSCORE', KEYS[2], ARGV[2]) then return 0 end
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""


class BaselineClient(SlotqClient):
    """The old producer path: ``ZCARD``, arq's ``enqueue_job``, ``PUBLISH`` (workers' limit check as now)."""

    def __init__(self, redis: Redis, settings: ClientSettings, **options: Any) -> None:
        super().__init__(redis, settings, **options)
        self.arq = ArqRedis(connection_pool=redis.connection_pool, job_serializer=serialize,
                            job_deserializer=deserialize)       # arq's enqueue_job, on the client's connections

    async def enqueue(self, request: JobRequest | str, **fields: Any) -> JobHandle:
        assert isinstance(request, JobRequest) and not fields
        await self._check_fits(request)
        job_id = request.idempotency_key or uuid.uuid4().hex
        depth = await self.redis.zcard(self.settings.queue_name)
        if depth >= self.settings.max_queue_length:
            raise QueueFull(depth, self.settings.max_queue_length)
        job = await self.arq.enqueue_job(JOB_FUNCTION, encode_payload(request), _job_id=job_id,
                                         _queue_name=self.settings.queue_name)
        if job is not None:
            await self.redis.publish(WAKE_CHANNEL, job_id)
        return JobHandle(self, job_id, created=job is not None)


class _OldArqWorker(Worker):
    """arq's Worker as slotq's ``ResilientWorker`` had it, plus the pickup observation."""

    def __init__(self, *args: Any, on_pickup: Callable[[str, int], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lease_lost: set[str] = set()
        self.on_pickup = on_pickup

    async def start_jobs(self, job_ids: list[bytes]) -> None:
        """Skip running jobs with one pipelined EXISTS before arq's per-job claim."""
        if job_ids:
            async with self.pool.pipeline(transaction=False) as pipe:
                for job_id in job_ids:
                    pipe.exists(in_progress_key_prefix + job_id.decode())
                running = await pipe.execute()
            job_ids = [job_id for job_id, busy in zip(job_ids, running) if not busy]
        await super().start_jobs(job_ids)

    async def run_job(self, job_id: str, score: int) -> None:
        self.on_pickup(job_id, score)            # arq starts this task right after its claim succeeded
        await super().run_job(job_id, score)

    async def finish_job(self, job_id: str, *args: Any, **kwargs: Any) -> None:
        if job_id in self.lease_lost:
            self.lease_lost.discard(job_id)
            return
        await super().finish_job(job_id, *args, **kwargs)

    async def _poll_iteration(self) -> None:
        try:
            await super()._poll_iteration()
        except (RedisError, OSError) as exc:
            log.warning("Redis unavailable (%s: %s); retrying in 1 s", type(exc).__name__, exc)
            await asyncio.sleep(1)


class BaselineWorker:
    """The old ``SlotqWorker``'s claim path around the current job function."""

    def __init__(self, settings: WorkerSettings, redis_url: str, engine_factory: EngineFactory,
                 on_pickup: Callable[[str, int], None]) -> None:
        self.settings = settings
        self.id = settings.worker_name or uuid.uuid4().hex[:8]
        self.token = f"{self.id}:{uuid.uuid4().hex[:8]}"
        self.ttl_ms = settings.lock_ttl_s * 1000
        self.engine_factory = engine_factory
        self.engine: JobEngine | None = None
        self.writer: StreamWriter | None = None
        self.ready = asyncio.Event()
        self.started_at = time.time()
        self._wake = asyncio.Event()
        self._background: list[asyncio.Task[None]] = []

        async def generate(ctx: dict[str, Any], payload: Any) -> dict[str, Any]:
            return await self._run_job(ctx, payload)

        self.arq = _OldArqWorker(
            functions=[func(generate, name=JOB_FUNCTION)], queue_name=settings.queue_name,
            redis_settings=RedisSettings(**vars(redis_settings(redis_url))),    # slotq's fields, under arq's names
            on_startup=self._on_startup, on_shutdown=self._on_shutdown, on_job_start=self._on_job_start,
            after_job_end=self._after_job_end, handle_signals=False,
            max_jobs=settings.slots, job_timeout=settings.job_timeout_s, keep_result=settings.keep_result_s,
            poll_delay=POLL_DELAY_S, queue_read_limit=QUEUE_READ_LIMIT, max_tries=settings.max_tries + 1,
            health_check_interval=max(5, settings.lock_ttl_s), allow_abort_jobs=True,
            job_serializer=serialize, job_deserializer=deserialize, log_results=False, on_pickup=on_pickup)
        self.arq.in_progress_timeout_s = settings.lock_ttl_s    # the old claim_with_lease_ttl

    async def run(self) -> None:
        """Serve until :meth:`request_stop`; running jobs are then cancelled (arq runs them again)."""
        with contextlib.suppress(asyncio.CancelledError):
            await self.arq.async_run()
        with contextlib.suppress(asyncio.CancelledError):
            await self.arq.close()

    def request_stop(self) -> None:
        self.arq.allow_pick_jobs = False
        if self.arq.main_task is not None:
            self.arq.main_task.cancel()

    # ------------------------------------------------------------------ lifecycle
    async def _on_startup(self, ctx: dict[str, Any]) -> None:
        self.engine = await self.engine_factory(self.settings.engine_config())
        self.writer = StreamWriter(ctx["redis"], flush_ms=self.settings.stream_flush_ms,
                                   maxlen=self.settings.stream_maxlen, ttl_s=self.settings.stream_ttl_s)
        self.writer.start()
        self._renew = ctx["redis"].register_script(RENEW_SCRIPT)
        self._background = [asyncio.create_task(loop()) for loop in (self._heartbeat_loop, self._wake_listener,
                                                                    self._wake_loop)]
        self.ready.set()

    async def _on_shutdown(self, ctx: dict[str, Any]) -> None:
        for task in self._background:
            task.cancel()
        if self.writer:
            await self.writer.close()
        if self.engine:
            await self.engine.close()

    async def _on_job_start(self, ctx: dict[str, Any]) -> None:
        try:
            await ctx["redis"].set(in_progress_key_prefix + ctx["job_id"], self.token, px=self.ttl_ms)
        except RedisError as exc:
            log.warning("could not take the lease of %s: %s", ctx["job_id"], exc)

    async def _after_job_end(self, ctx: dict[str, Any]) -> None:
        self._wake.set()

    # ------------------------------------------------------------------ wake-ups and heartbeat
    async def _wake_listener(self) -> None:
        async with self.arq.pool.pubsub() as pubsub:
            await pubsub.subscribe(WAKE_CHANNEL)
            async for message in pubsub.listen():
                if message.get("type") == "message":
                    self._wake.set()

    async def _wake_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(0.001)   # let arq's done-callbacks release the finished job's slot
            if not self.arq.allow_pick_jobs or self.arq.job_counter >= self.arq.max_jobs:
                continue
            try:
                await self.arq._poll_iteration()   # arq 0.28 has no public "poll now"; the old code did this
            except Exception as exc:  # as the old code: its poll loop reports the same errors
                log.debug("woken poll failed: %s", exc)

    async def _heartbeat_loop(self) -> None:
        interval = self.settings.lock_ttl_s / 3
        while True:
            assert self.engine is not None
            stats = self.engine.stats()
            job_ids = [j for j in self.arq.job_tasks if j not in self.arq.lease_lost]
            try:
                if job_ids:
                    async with self.arq.pool.pipeline(transaction=False) as pipe:
                        for job_id in job_ids:
                            await self._renew(keys=[in_progress_key_prefix + job_id, self.settings.queue_name],
                                              args=[self.token, job_id, self.ttl_ms], client=pipe)
                        await pipe.execute()
                # the worker registry slotq's producers read (the benchmark waits for every worker in it)
                await registry.beat(self.arq.pool, WorkerInfo(
                    id=self.id, queue=self.settings.queue_name, ctx=self.engine.ctx_per_seq, model=stats.model,
                    slots_total=stats.slots_total, slots_busy=stats.slots_busy, waiting=stats.waiting,
                    generated_tokens=stats.generated_tokens, started_at=self.started_at, updated_at=time.time(),
                    draining=False), interval_s=interval)
            except (RedisError, OSError) as exc:
                log.warning("heartbeat failed (%s); retrying", exc)
            await asyncio.sleep(interval)

    # ------------------------------------------------------------------ the job function
    async def _run_job(self, ctx: dict[str, Any], payload: Any) -> dict[str, Any]:
        assert self.engine is not None and self.writer is not None
        job_id = ctx["job_id"]
        enqueue_time = ctx.get("enqueue_time")
        run = JobRun(engine=self.engine, writer=self.writer, settings=self.settings, worker_id=self.id,
                     job_id=job_id, attempt=ctx["job_try"], payload=payload,
                     enqueued_at=enqueue_time.timestamp() if enqueue_time else None,
                     is_abort=lambda: job_id in self.arq.aborting_tasks,
                     lease_lost=lambda: job_id in self.arq.lease_lost)
        result = await run.run(await self.writer.open(job_id))
        self.arq.aborting_tasks.discard(job_id)
        return result.model_dump(mode="json")
