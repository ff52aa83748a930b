"""The slotq worker: one engine (one model, N slots) fed by arq from Redis.

arq settings that are wrong for this workload and changed on purpose (see shared notes on arq):

* ``max_jobs = slots``: arq never claims more jobs than the engine has slots.
* Wake-ups instead of a tight poll: producers PUBLISH on ``slotq:wake`` after enqueueing and a
  finished job wakes its own worker, which then claims at once (arq's 0.5 s poll would add up to
  half a second to every job). ``poll_delay`` (50 ms) remains the fallback for retries whose
  backoff has elapsed and for lost wake-ups; it also bounds how fast an abort is noticed.
* ``queue_read_limit`` 1000: running jobs sit at the head of arq's queue, so a worker must read
  past every running job of the fleet to see the waiting ones.
* A heartbeat renews a short lease (``lock_ttl_s``) on arq's in-progress key instead of arq's
  job_timeout + 10 s lock: a killed worker's jobs are picked up by another within seconds, a
  live job's lease never lapses however long it runs, and a worker that stalled past its lease
  while another took the job over is fenced off (see ``jobs/lease.py``).
* ``max_tries`` is one more than the setting so the job function itself sees the exhausted
  attempt and dead-letters it (arq would fail it without calling anything).
* msgpack payloads (data only, nothing that executes on load); abort enabled (``slotq cancel``).
* SIGTERM/SIGINT: stop claiming, let running jobs finish within ``drain_grace_s``, then hand the
  rest back without burning a try; a second signal hands everything back at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
import uuid
from datetime import datetime
from typing import Any

from arq.constants import in_progress_key_prefix, retry_key_prefix
from arq.worker import Function, Worker, func
from redis.exceptions import RedisError

from engine import Engine
from jobs import metrics
from jobs.connection import redis_settings
from jobs.job_run import JobRun
from jobs.keys import JOB_FUNCTION, WAKE_CHANNEL, worker_key
from jobs.lease import RENEW_SCRIPT, Lease
from jobs.serialization import deserialize, serialize
from jobs.settings import WorkerSettings
from jobs.stream import StreamWriter

log = logging.getLogger(__name__)


class ResilientWorker(Worker):
    """arq's Worker with three changes: a Redis outage pauses the poll loop instead of ending the
    worker; a job whose lease another worker took over is left alone when it ends (arq would
    store its result and delete the new holder's lock); running jobs are skipped in one round trip."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lease_lost: set[str] = set()

    def claim_with_lease_ttl(self, ttl_s: float) -> None:
        """arq claims a job with an in-progress key that lives job_timeout + 10 s; a worker killed
        before its first heartbeat would leave the job locked that long. Claim with the lease
        TTL instead (the job timeout itself is enforced separately by arq)."""
        self.in_progress_timeout_s = ttl_s

    async def finish_job(self, job_id: str, *args: Any, **kwargs: Any) -> None:
        if job_id in self.lease_lost:
            self.lease_lost.discard(job_id)
            return
        await super().finish_job(job_id, *args, **kwargs)

    async def start_jobs(self, job_ids: list[bytes]) -> None:
        """Skip jobs that are already running before arq's per-job claim. Running jobs sit at the
        head of the queue and arq spends three round trips on each before skipping it; one
        pipelined EXISTS for all of them is enough (the claim itself still re-checks under WATCH)."""
        if job_ids:
            async with self.pool.pipeline(transaction=False) as pipe:
                for job_id in job_ids:
                    pipe.exists(in_progress_key_prefix + job_id.decode())
                running = await pipe.execute()
            job_ids = [job_id for job_id, busy in zip(job_ids, running) if not busy]
        await super().start_jobs(job_ids)

    async def _poll_iteration(self) -> None:
        try:
            await super()._poll_iteration()
        except (RedisError, OSError) as exc:
            log.warning("Redis unavailable (%s: %s); retrying in 1 s", type(exc).__name__, exc)
            await asyncio.sleep(1)


class SlotqWorker:
    """Owns the engine, the stream writer, the heartbeat and the arq worker."""

    def __init__(self, settings: WorkerSettings, redis_url: str) -> None:
        self.settings = settings
        self.redis_url = redis_url
        self.id = settings.worker_name or f"{socket.gethostname()}:{os.getpid()}"
        self.lease = Lease(token=f"{self.id}:{uuid.uuid4().hex[:8]}", queue_name=settings.queue_name,
                           ttl_ms=settings.lock_ttl_s * 1000)
        self.engine: Engine | None = None
        self.writer: StreamWriter | None = None
        self.started_at = time.time()
        self._background: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()
        self._draining = False
        self._handing_back: set[str] = set()
        # arq logs every job's arguments (the prompt) at INFO; slotq logs its own prompt-free lines.
        logging.getLogger("arq.worker").setLevel(max(logging.WARNING, logging.getLogger().getEffectiveLevel()))
        self.arq = ResilientWorker(
            functions=[self._job_function()],
            queue_name=settings.queue_name,
            redis_settings=redis_settings(redis_url),
            on_startup=self._on_startup,
            on_shutdown=self._on_shutdown,
            on_job_start=self._on_job_start,
            after_job_end=self._after_job_end,
            handle_signals=False,
            max_jobs=settings.slots,
            job_timeout=settings.job_timeout_s,
            keep_result=settings.keep_result_s,
            poll_delay=settings.poll_delay_s,
            queue_read_limit=settings.queue_read_limit,
            max_tries=settings.max_tries + 1,
            health_check_interval=max(5, settings.lock_ttl_s),
            allow_abort_jobs=True,
            job_serializer=serialize,
            job_deserializer=deserialize,
            log_results=False,
        )
        self.arq.claim_with_lease_ttl(settings.lock_ttl_s)

    def _job_function(self) -> Function:
        async def generate(ctx: dict[str, Any], payload: Any) -> dict[str, Any]:
            return await self.run_job(ctx, payload)
        return func(generate, name=JOB_FUNCTION)

    # ------------------------------------------------------------------ lifecycle
    async def _on_startup(self, ctx: dict[str, Any]) -> None:
        config = self.settings.engine_config()
        log.info("loading %s (%d slots, ctx %d)", config.model_path.name, config.slots, config.ctx)
        self.engine = await Engine.start(config)
        self.writer = StreamWriter(ctx["redis"], flush_ms=self.settings.stream_flush_ms,
                                   maxlen=self.settings.stream_maxlen, ttl_s=self.settings.stream_ttl_s,
                                   lease=self.lease, on_fenced=self._on_lease_lost)
        self._renew = ctx["redis"].register_script(RENEW_SCRIPT)
        self.writer.start()
        self._background = [
            asyncio.create_task(self._heartbeat_loop(), name="slotq-heartbeat"),
            asyncio.create_task(self._metrics_loop(), name="slotq-metrics"),
            asyncio.create_task(self._wake_listener(), name="slotq-wake-listener"),
            asyncio.create_task(self._wake_loop(), name="slotq-wake-loop"),
        ]
        log.info("worker %s ready: model %s, %d slots", self.id, self.engine.info.model_name, config.slots)

    async def _on_shutdown(self, ctx: dict[str, Any]) -> None:
        for task in self._background:
            task.cancel()
        if self.writer:
            await self.writer.close()
        try:
            await ctx["redis"].delete(worker_key(self.id))
        except RedisError:
            pass
        if self.engine:
            await self.engine.close()

    async def _on_job_start(self, ctx: dict[str, Any]) -> None:
        # Exceptions here would crash arq's loop: never raise.
        try:
            await ctx["redis"].set(Lease.lock_key(ctx["job_id"]), self.lease.token, px=self.lease.ttl_ms)
        except RedisError as exc:
            log.warning("could not take the lease of %s: %s", ctx["job_id"], exc)

    def _on_lease_lost(self, job_id: str) -> None:
        """Another worker holds this job now: stop generating it and let arq forget it."""
        self.arq.lease_lost.add(job_id)
        task = self.arq.job_tasks.get(job_id)
        if task is not None:
            task.cancel()

    async def _after_job_end(self, ctx: dict[str, Any]) -> None:
        self._wake.set()          # a slot is free: look for the next job now, not at the next poll

    async def _wake_listener(self) -> None:
        """Turn PUBLISHes on the wake channel into local wake-ups; reconnect if Redis drops."""
        while True:
            try:
                async with self.arq.pool.pubsub() as pubsub:
                    await pubsub.subscribe(WAKE_CHANNEL)
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            self._wake.set()
            except (RedisError, OSError) as exc:
                log.warning("wake-up channel lost (%s); relying on polling until it is back", exc)
                await asyncio.sleep(1)

    async def _wake_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(0.001)   # let arq's done-callbacks release the finished job's slot
            if not self.arq.allow_pick_jobs or self.arq.job_counter >= self.arq.max_jobs:
                continue
            try:
                await self.arq._poll_iteration()   # arq 0.28 has no public "poll now"
            except Exception as exc:  # the regular poll loop reports the same errors
                log.debug("woken poll failed: %s", exc)

    async def _metrics_loop(self) -> None:
        if not self.settings.metrics_port:
            return
        metrics.serve(self.settings.metrics_port)
        log.info("Prometheus metrics on :%d/metrics", self.settings.metrics_port)
        sampler = metrics.EngineSampler()
        while True:
            if self.engine is not None:
                sampler.update(self.engine.stats())
            try:
                await metrics.sample_queue(self.arq.pool, self.settings.queue_name)
            except (RedisError, OSError):
                pass
            await asyncio.sleep(1)

    async def _heartbeat_loop(self) -> None:
        """Renew the in-progress locks of running jobs and advertise this worker."""
        interval = self.settings.lock_ttl_s / 3
        while True:
            try:
                redis = self.arq.pool
                stats = self.engine.stats() if self.engine else None
                job_ids = [j for j in self.arq.job_tasks if j not in self.arq.lease_lost]
                async with redis.pipeline(transaction=False) as pipe:
                    for job_id in job_ids:
                        await self._renew(keys=[Lease.lock_key(job_id), self.settings.queue_name],
                                          args=[self.lease.token, job_id, self.lease.ttl_ms], client=pipe)
                    if stats is not None:
                        pipe.hset(worker_key(self.id), mapping={
                            "id": self.id, "queue": self.settings.queue_name, "ctx": self.engine.ctx_per_seq,
                            "model": self.settings.model_name or stats.model, "slots_total": stats.slots_total,
                            "slots_busy": stats.slots_busy, "waiting": stats.waiting,
                            "generated_tokens": stats.generated_tokens, "started_at": self.started_at,
                            "updated_at": time.time(), "draining": int(self._draining)})
                        pipe.expire(worker_key(self.id), max(3, int(interval * 3)))
                    renewed = await pipe.execute()
                for job_id, ok in zip(job_ids, renewed):
                    if not ok:
                        log.warning("job %s: lease taken over by another worker; abandoning it", job_id)
                        self._on_lease_lost(job_id)
            except (RedisError, OSError) as exc:
                log.warning("heartbeat failed (%s); retrying", exc)
            await asyncio.sleep(interval)

    # ------------------------------------------------------------------ the job function
    async def run_job(self, ctx: dict[str, Any], payload: Any) -> dict[str, Any]:
        assert self.engine is not None and self.writer is not None
        job_id = ctx["job_id"]
        enqueue_time: datetime | None = ctx.get("enqueue_time")
        run = JobRun(engine=self.engine, writer=self.writer, settings=self.settings, worker_id=self.id,
                     job_id=job_id, attempt=ctx["job_try"], payload=payload,
                     enqueued_at=enqueue_time.timestamp() if enqueue_time else None,
                     is_abort=lambda: job_id in self.arq.aborting_tasks,
                     lease_lost=lambda: job_id in self.arq.lease_lost)
        started = time.monotonic()
        log.info("job %s attempt %d started", job_id, ctx["job_try"])
        try:
            result = await run.run()
        except asyncio.CancelledError:
            if job_id in self._handing_back:
                await asyncio.shield(self._give_back_try(ctx))
                log.info("job %s handed back", job_id)
            raise
        self.arq.aborting_tasks.discard(job_id)
        metrics.observe_result(result)
        log.info("job %s %s (%s) in %.2f s: %d prompt + %d completion tokens", job_id, result.status.value,
                 result.finish_reason.value if result.finish_reason else "-", time.monotonic() - started,
                 result.usage.prompt_tokens, result.usage.completion_tokens)
        return result.model_dump(mode="json")

    async def _give_back_try(self, ctx: dict[str, Any]) -> None:
        """A job handed back on shutdown should not count as a failed try (arq #267)."""
        try:
            await ctx["redis"].decr(retry_key_prefix + ctx["job_id"])
        except RedisError:
            pass

    # ------------------------------------------------------------------ running and draining
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            await self.arq.async_run()
        except asyncio.CancelledError:
            if not self._draining:
                raise
            log.info("worker %s stopped", self.id)   # the signal path cancels arq's main task
        finally:
            await self.arq.close()

    def _on_signal(self, sig: signal.Signals) -> None:
        if self._draining:
            log.warning("second %s: handing every running job back now", sig.name)
            self._hand_back_all()
            return
        self._draining = True
        log.info("%s: draining (no new jobs; up to %d s for %d running)", sig.name, self.settings.drain_grace_s,
                 len(self.arq.job_tasks))
        self.arq.allow_pick_jobs = False
        asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.settings.drain_grace_s
        while self.arq.tasks and time.monotonic() < deadline:    # arq's run_job tasks: job + result write
            await asyncio.sleep(0.1)
        self._hand_back_all()

    def _hand_back_all(self) -> None:
        self._handing_back.update(self.arq.job_tasks)
        self.arq.handle_sig(signal.SIGTERM)

