"""The gateway's one piece of shared state: a client per queue, the model router, and a small
record per job it created (queue, model, kind, created time, a fingerprint of the request:
:class:`~slotq.jobs.gateway.records.JobRecord`) so that any replica can find a job again by id.
Gateways hold nothing else: every stream and result lives in Redis.

Tenants: a job's id carries its tenant (:func:`slotq.jobs.protocol.schemas.tenant_job_id`), so the id a caller
names is resolved within the caller's tenant (:func:`own_job_id`): another tenant's job is never
found, and the answer (404) is the one for a job that does not exist.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable
from typing import Literal

from slotq.jobs.gateway import metrics
from slotq.jobs.gateway.adapters import check_lora, split_model, with_adapter
from slotq.jobs.gateway.records import JobRecord, JobRecords
from slotq.jobs.gateway.routing import ModelRouter
from slotq.jobs.gateway.settings import GatewaySettings
from slotq.jobs.openai.errors import ApiError, public_param
from slotq.jobs.producer.client import JobHandle, JobRejected, QueueFull, QuotaExceeded, SlotqClient
from slotq.jobs.protocol.payload import encode_payload
from slotq.jobs.protocol.schemas import (
    AnyJobRequest,
    JobKind,
    JobRequest,
    tenant_job_id,
    tenant_of_job,
)

log = logging.getLogger(__name__)


def own_job_id(tenant: str, job_id: str) -> str | None:
    """The id of the ``tenant``'s job that ``job_id`` names: a full id of one of its jobs, or a
    bare one (an idempotency key, a fresh id) scoped to it. None when it names another tenant's."""
    if tenant_of_job(job_id) != tenant:
        job_id = tenant_job_id(tenant, job_id)
    return job_id if tenant_of_job(job_id) == tenant else None


def fingerprint(job: AnyJobRequest) -> str:
    """What an idempotency key promises: the same key, the same request."""
    return hashlib.sha256(json.dumps(encode_payload(job), sort_keys=True).encode()).hexdigest()


class Gateway:
    def __init__(self, client: SlotqClient, settings: GatewaySettings) -> None:
        self.client = client
        self.settings = settings
        self.router = ModelRouter(client, ttl_s=settings.gateway_routing_ttl_s,
                                  memory_s=settings.gateway_model_memory_s)
        self.records = JobRecords(client.redis)
        self._queues: dict[str, SlotqClient] = {settings.queue_name: client}
        self._background: set[asyncio.Task[None]] = set()

    def queue(self, name: str) -> SlotqClient:
        if name not in self._queues:
            self._queues[name] = self.client.for_queue(name)
        return self._queues[name]

    async def submit(self, job: AnyJobRequest, model: str, kind: Literal["chat", "text", "embedding", "rerank"],
                     param: Callable[[str | None], str | None] = public_param) -> tuple[JobHandle, JobRecord]:
        """Route by model and enqueue. With an idempotency key that matches a live job, that job
        (and the record of the request that created it) is returned instead. ``param`` names a
        JobRequest field as the request called it (for errors). The same key with another request
        is a 409: the key names a job that is not this request's answer."""
        metadata_bytes = len(json.dumps(job.metadata))
        if metadata_bytes > self.settings.gateway_max_metadata_bytes:
            raise ApiError.invalid(f"metadata: {metadata_bytes} bytes as JSON, over the limit of "
                                   f"{self.settings.gateway_max_metadata_bytes} (SLOTQ_GATEWAY_MAX_METADATA_BYTES)",
                                   "metadata", code="metadata_too_large")
        base, adapter = model, None
        if isinstance(job, JobRequest):
            base, adapter = split_model(model, await self.router.routes())     # base:adapter names an adapter
        route = await self.router.route(base, job.kind)
        job = job.model_copy(update={"model": base})     # its worker checks it: never run by another model
        served = {w.kind for w in route.workers} or {route.kind}
        if job.kind not in served:
            if job.kind == JobKind.RERANK:
                raise ApiError.invalid(f"model {model!r} cannot rank: it serves {' and '.join(sorted(served))} jobs; "
                                       "/v1/rerank needs a reranker (a GGUF with rank pooling, such as bge-reranker)",
                                       "model", code="model_cannot_rank")
            path = "/v1/embeddings" if job.kind == JobKind.EMBEDDING else "/v1/chat/completions or /v1/completions"
            raise ApiError.invalid(f"model {model!r} serves {' and '.join(sorted(served))} jobs, not {job.kind.value} "
                                   f"jobs: {path} needs a model that serves them", "model", code="wrong_model_kind")
        if isinstance(job, JobRequest):
            job = with_adapter(job, adapter) if adapter is not None else job
            check_lora(job, route, adapter)
        client = self.queue(route.queue)
        try:
            handle = await client.enqueue_request(job)
        except JobRejected as exc:
            raise ApiError.from_rejection(exc, param) from None
        except QueueFull as exc:
            raise ApiError(429, str(exc), type="rate_limit_exceeded", code="queue_full",
                           headers={"Retry-After": str(self.settings.gateway_retry_after_s)}) from None
        except QuotaExceeded as exc:
            metrics.QUOTA_REFUSALS.labels(tenant=exc.tenant, quota=exc.quota).inc()
            raise self.quota_error(exc) from None
        if handle.created:
            metrics.TENANT_JOBS.labels(tenant=job.tenant).inc()
            metrics.TENANT_TOKENS.labels(tenant=job.tenant).inc(job.quota_tokens())
        record = JobRecord(queue=route.queue, model=model, kind=kind, created=int(time.time()),
                           fingerprint=fingerprint(job))
        if handle.created:
            await self.records.put(handle.id, record, ttl_s=self.settings.keep_result_s)
        else:
            earlier = await self.records.put_if_absent(handle.id, record, ttl_s=self.settings.keep_result_s) or record
            if earlier.fingerprint not in (None, record.fingerprint):
                raise ApiError(409, f"idempotency_key {job.idempotency_key!r} was used before with a different "
                                    "request; use a new key for a new request", param="idempotency_key",
                               code="idempotency_key_reused")
            record = earlier
        return JobHandle(self.queue(record.queue), handle.id, created=handle.created), record

    def quota_error(self, exc: QuotaExceeded) -> ApiError:
        """A tenant's quota refusal as OpenAI's rate limit answer: 429, its ``type`` ``tokens`` or
        ``requests``, and Retry-After (the tokens quota's next minute, else SLOTQ_GATEWAY_RETRY_AFTER_S)."""
        retry_after = (self.settings.gateway_retry_after_s if exc.retry_after_s is None
                       else max(1, math.ceil(exc.retry_after_s)))
        return ApiError(429, str(exc), type="tokens" if exc.quota == "tokens" else "requests",
                        code=f"tenant_{exc.quota}_quota_exceeded", headers={"Retry-After": str(retry_after)})

    async def find(self, tenant: str, job_id: str) -> tuple[str, SlotqClient, JobRecord | None]:
        """The full id of the tenant's job that ``job_id`` names and the client for its queue (the
        default queue for jobs not created here). 404 for another tenant's job, as for none."""
        own = own_job_id(tenant, job_id)
        if own is None:
            raise ApiError.job_not_found(job_id)
        return (own, *await self.locate(own))

    async def locate(self, job_id: str) -> tuple[SlotqClient, JobRecord | None]:
        """The client for the queue of the job with this full id, whoever's it is (the fleet view)."""
        record = await self.records.get(job_id)
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
