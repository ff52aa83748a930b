"""The gateway's one piece of shared state: a client per queue, the model router, and a small
record per job it created (queue, model, kind, created time) so that any replica can find a job
again by id. Gateways hold nothing else: every stream and result lives in Redis."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel

from jobs.client import JobHandle, JobRejected, QueueFull, SlotqClient
from jobs.gateway import metrics
from jobs.gateway.errors import ApiError
from jobs.gateway.routing import ModelRouter
from jobs.gateway.settings import GatewaySettings
from jobs.schemas import JobRequest

log = logging.getLogger(__name__)


def job_record_key(job_id: str) -> str:
    return f"slotq:gateway:job:{{{job_id}}}"


class JobRecord(BaseModel):
    queue: str
    model: str
    kind: Literal["chat", "text"]
    created: int


class Gateway:
    def __init__(self, client: SlotqClient, settings: GatewaySettings) -> None:
        self.client = client
        self.settings = settings
        self.router = ModelRouter(client, ttl_s=settings.gateway_routing_ttl_s, memory_s=settings.gateway_model_memory_s)
        self._queues: dict[str, SlotqClient] = {settings.queue_name: client}
        self._background: set[asyncio.Task[None]] = set()

    def queue(self, name: str) -> SlotqClient:
        if name not in self._queues:
            self._queues[name] = self.client.for_queue(name)
        return self._queues[name]

    async def submit(self, job: JobRequest, model: str, kind: Literal["chat", "text"],
                     param: Callable[[str], str] = str) -> tuple[JobHandle, JobRecord]:
        """Route by model and enqueue. With an idempotency key that matches a live job, that job
        (and the record of the request that created it) is returned instead. ``param`` names a
        JobRequest field as the request called it (for errors)."""
        route = await self.router.route(model)
        try:
            handle = await self.queue(route.queue).enqueue(job)
        except JobRejected as exc:
            code = "context_length_exceeded" if exc.field == "max_tokens" else "invalid_value"
            raise ApiError.invalid(str(exc), param(exc.field), code=code) from None
        except QueueFull as exc:
            raise ApiError(429, str(exc), type="rate_limit_exceeded", code="queue_full",
                           headers={"Retry-After": str(self.settings.gateway_retry_after_s)}) from None
        record = JobRecord(queue=route.queue, model=model, kind=kind, created=int(time.time()))
        key = job_record_key(handle.id)
        if handle.created:
            await self.client.redis.set(key, record.model_dump_json(), ex=self.settings.keep_result_s)
        else:
            old = await self.client.redis.set(key, record.model_dump_json(), ex=self.settings.keep_result_s,
                                              nx=True, get=True)
            record = JobRecord.model_validate_json(old) if old else record
        return JobHandle(self.queue(record.queue), handle.id, created=handle.created), record

    async def find(self, job_id: str) -> tuple[SlotqClient, JobRecord | None]:
        """The client for the job's queue (the default queue for jobs not created here)."""
        raw = await self.client.redis.get(job_record_key(job_id))
        record = JobRecord.model_validate_json(raw) if raw else None
        return self.queue(record.queue if record else self.settings.queue_name), record

    def client_left(self, client: SlotqClient, job_id: str) -> None:
        """The client of the request that created this job disconnected: cancel the job."""
        metrics.DISCONNECT_CANCELS.inc()
        self.cancel_soon(client, job_id)

    def cancel_soon(self, client: SlotqClient, job_id: str) -> None:
        """Cancel outside the request's task: a disconnected request is being torn down."""
        async def cancel() -> None:
            try:
                await client.cancel(job_id)
                log.info("job %s cancelled by the gateway", job_id)
            except Exception as exc:  # logged, never raised into the server
                log.warning("could not cancel job %s after its client left: %s", job_id, exc)

        task = asyncio.get_running_loop().create_task(cancel())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=5)
        await self.client.close()
