"""Webhook events of background responses: ``response.completed`` / ``.incomplete`` / ``.failed`` /
``.cancelled`` once a ``background: true`` response's job ends.

The job runs on a worker and may end long after its request was answered, on a gateway other than
the one that created it, or after that gateway restarted. So creating a background response adds
its job id to a set in Redis (:meth:`~slotq.jobs.gateway.records.WebhookRecords.watch`, the
webhooks' slot), and every gateway replica looks at the set every second: it takes the jobs due a
look (a script moves each to its next look, so replicas share the work rather than repeat it),
reads their results in one round trip per queue, emits each ended job's event with
:func:`~slotq.jobs.gateway.webhooks.emit_event`, and only then removes it from the set. A gateway
that dies in between leaves the job to the next look; emitting again delivers nothing twice (an
event's id follows from (tenant, type, response id)).

Cost: a tenant with no endpoint subscribed to a ``response.*`` event when its response is first
looked at (within a second of its creation) pays the set entry and one read of its endpoints per
look; its response leaves the set at once, and no result is read. Register an endpoint before
creating the responses it should hear of. A watched job whose gateway record is gone (its result
expired, ``SLOTQ_KEEP_RESULT_S``) leaves the set without an event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict

from redis.exceptions import RedisError

from slotq.jobs.gateway.records import WebhookRecords
from slotq.jobs.gateway.service import Gateway
from slotq.jobs.gateway.webhooks import EVENT_TYPES, EventType, emit_event, subscribed_endpoints
from slotq.jobs.openai.translate import unfinished_error
from slotq.jobs.protocol.schemas import JobResult, JobStatus, tenant_of_job
from slotq.jobs.protocol.wire import FinishReason
from slotq.jobs.responses.translate import response_id

log = logging.getLogger(__name__)

LOOK_EVERY_S = 1.0
LOOK_AT_MOST = 500            # jobs per look; a fuller set is looked at again at once
RESPONSE_EVENTS: tuple[EventType, ...] = tuple(t for t in EVENT_TYPES if t.startswith("response."))


def ending_event(result: JobResult) -> EventType:
    """The event of a finished job, as its Response's status reads
    (:func:`~slotq.jobs.gateway.routes_responses.stored_response`): cancelled; failed (an error, a
    deadline); incomplete (``max_output_tokens`` cut it); completed."""
    if result.status == JobStatus.CANCELLED:
        return "response.cancelled"
    if unfinished_error(result) is not None:
        return "response.failed"
    reason = result.choices[0].finish_reason if result.choices else result.finish_reason
    return "response.incomplete" if reason == FinishReason.LENGTH else "response.completed"


class ResponseWatcher:
    """This gateway's share of watching background responses end (see the module)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.records = WebhookRecords(gateway.client.redis)
        self._loop: asyncio.Task[None] | None = None

    async def watch(self, job_id: str) -> None:
        """A background response was created: emit its event when its job ends."""
        await self.records.watch(job_id, look_at_ms=time.time_ns() // 1_000_000)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop().create_task(self._look_forever(), name="slotq-response-watch")

    @property
    def running(self) -> bool:
        """Whether its looks go on (the gateway's /ready)."""
        return self._loop is not None and not self._loop.done()

    async def close(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)

    async def _look_forever(self) -> None:
        while True:
            try:
                while await self.look() == LOOK_AT_MOST:
                    pass
            except (RedisError, OSError) as exc:
                log.warning("looking at background responses failed (%s: %s); retrying", type(exc).__name__, exc)
            await asyncio.sleep(LOOK_EVERY_S)

    async def look(self) -> int:
        """One look at the jobs due one; returns how many it took."""
        now_ms = time.time_ns() // 1_000_000
        job_ids = await self.records.claim_watched(now_ms=now_ms, next_look_ms=now_ms + int(LOOK_EVERY_S * 1000),
                                                   count=LOOK_AT_MOST)
        by_tenant: dict[str, list[str]] = defaultdict(list)
        for job_id in job_ids:
            by_tenant[tenant_of_job(job_id)].append(job_id)
        ended: list[str] = []
        by_queue: dict[str, list[str]] = defaultdict(list)
        for tenant, ids in by_tenant.items():
            if not await subscribed_endpoints(self.records, tenant, RESPONSE_EVENTS):
                ended += ids                    # nobody to tell
                continue
            for job_id in ids:
                record = await self.gateway.records.get(job_id)
                if record is None:
                    ended.append(job_id)        # its result expired with it
                else:
                    by_queue[record.queue].append(job_id)
        for queue, ids in by_queue.items():
            for job_id, result in (await self.gateway.queue(queue).finished(ids)).items():
                await emit_event(self.gateway.client.redis, tenant_of_job(job_id), ending_event(result),
                                 response_id(job_id))
                ended.append(job_id)
        await self.records.unwatch(ended)
        return len(job_ids)
