"""Stored responses (``store``, ``previous_response_id``): conversation state in Redis, per tenant.

A stored response is a small record next to its job: the request as it ran, its ``input`` the
whole conversation (a ``previous_response_id`` chain already unrolled into items) and the model
and time it was created at. Its output is not copied: it is the job's result, read when the
response is retrieved or continued. So a record is written once, when the job is submitted (a
response in progress can be retrieved), and lives ``SLOTQ_GATEWAY_RESPONSE_TTL_S``, never longer
than the job's result (``SLOTQ_KEEP_RESULT_S``). A conversation holds at most
``SLOTQ_GATEWAY_RESPONSE_MAX_ITEMS`` items; continuing one past that is a 400 naming
``previous_response_id``.

Tenants: a response id is ``resp_<job id>`` and job ids are scoped to their tenant
(:meth:`~slotq.jobs.gateway.service.Gateway.find`), so another tenant's response is a 404 as one
that does not exist.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from slotq.jobs.gateway.records import JobRecord
from slotq.jobs.gateway.service import Gateway
from slotq.jobs.openai.errors import ApiError
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.schemas import JobResult, JobStatus
from slotq.jobs.responses.translate import output_items_of, response_id
from slotq.jobs.responses.wire import ResponsesRequest

RESPONSE_PREFIX = "resp_"


def stored_response_key(job_id: str) -> str:
    return f"slotq:gateway:response:{{{job_id}}}"


class StoredResponse(BaseModel):
    request: ResponsesRequest           # as it ran: ``input`` the whole conversation, as items
    model: str
    created: int


class Stored:
    """A stored response found for a tenant: its job's full id, queue client, record and result
    (None while the job has not finished)."""

    def __init__(self, job_id: str, client: SlotqClient, stored: StoredResponse, result: JobResult | None,
                 status: JobStatus) -> None:
        self.job_id = job_id
        self.client = client
        self.stored = stored
        self.result = result
        self.status = status

    @property
    def id(self) -> str:
        return response_id(self.job_id)

    def conversation(self) -> list[dict[str, Any]]:
        """Its input items and then its output items: what a response continuing it starts from."""
        items = self.stored.request.input if isinstance(self.stored.request.input, list) else [
            {"role": "user", "content": self.stored.request.input}]
        output = output_items_of(self.result) if self.result is not None else []
        return [*items, *(item.model_dump() for item in output)]


class ResponseStore:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.redis = gateway.client.redis

    @property
    def ttl_s(self) -> int:
        settings = self.gateway.settings
        return min(settings.gateway_response_ttl_s, settings.keep_result_s)

    async def put(self, job_id: str, request: ResponsesRequest, record: JobRecord) -> None:
        stored = StoredResponse(request=request, model=record.model, created=record.created)
        await self.redis.set(stored_response_key(job_id), stored.model_dump_json(by_alias=True), ex=self.ttl_s)

    async def get(self, tenant: str, response_id: str, param: str | None = None) -> Stored:
        """The tenant's stored response; a 404 (naming ``param`` when given) for none, another
        tenant's, or one expired."""
        job_id = response_id.removeprefix(RESPONSE_PREFIX)
        try:
            own, client, _record = await self.gateway.find(tenant, job_id)
        except ApiError:
            own, client = None, None
        raw = await self.redis.get(stored_response_key(own)) if own else None
        if raw is None or own is None or client is None:
            raise ApiError(404, f"no response {response_id!r} (never stored, deleted, or expired after "
                                f"{self.ttl_s} s)", param=param, code="response_not_found")
        finished = (await client.finished([own])).get(own)
        status = finished.status if finished is not None else await client.status(own)
        return Stored(own, client, StoredResponse.model_validate_json(raw), finished, status)

    async def delete(self, tenant: str, response_id: str) -> str:
        stored = await self.get(tenant, response_id)
        await self.redis.delete(stored_response_key(stored.job_id))
        return stored.id

    def continued(self, previous: Stored, request: ResponsesRequest) -> ResponsesRequest:
        """``request`` with the conversation ``previous`` ended with before its own input. The
        previous response's ``instructions`` are not carried over, as OpenAI's are not."""
        if previous.result is None or previous.status != JobStatus.SUCCEEDED:
            raise ApiError.invalid(f"previous_response_id: {previous.id} is {previous.status.value}; continue a "
                                   "response that finished", "previous_response_id", code="previous_response_unusable")
        own = request.input if isinstance(request.input, list) else [{"role": "user", "content": request.input}]
        items = [*previous.conversation(), *own]
        cap = self.gateway.settings.gateway_response_max_items
        if len(items) > cap:
            raise ApiError.invalid(f"previous_response_id: the conversation would hold {len(items)} items, over the "
                                   f"limit of {cap} (SLOTQ_GATEWAY_RESPONSE_MAX_ITEMS)", "previous_response_id",
                                   code="conversation_too_long")
        return request.model_copy(update={"input": items})
