"""Background jobs, like OpenAI's background responses: ``POST /v1/jobs`` returns an id at once;
``GET /v1/jobs/{id}`` gives status and result; ``GET /v1/jobs/{id}/events`` streams the job's
own events (resumable with ``?after=`` or ``Last-Event-ID``); ``DELETE /v1/jobs/{id}`` cancels.
A background job never depends on a client staying connected."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Request, Response

from slotq.jobs.gateway.auth import CallerDep, authenticate
from slotq.jobs.gateway.chunks import NativeRenderer, parse_stream_id
from slotq.jobs.gateway.records import JobRecord
from slotq.jobs.gateway.routes_openai import gateway_of
from slotq.jobs.gateway.sse import open_stream
from slotq.jobs.openai.errors import ApiError
from slotq.jobs.openai.translate import (
    kind_of,
    parse_request,
    to_job_request,
    to_response,
    unfinished_error,
    wire_param,
)
from slotq.jobs.openai.wire import JobObject
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.schemas import JobStatus

router = APIRouter(prefix="/v1/jobs", dependencies=[Depends(authenticate)])


@router.post("", status_code=202)
async def create_job(request: Request, response: Response, payload: Annotated[dict[str, Any], Body()],
                     caller: CallerDep) -> JobObject:
    """The body of a chat completion (``messages``) or a completion (``prompt``) request."""
    body = parse_request("chat" if "messages" in payload else "text", payload)
    if body.stream:
        raise ApiError.invalid("stream: a background job is read with GET /v1/jobs/{id}/events", "stream")
    gateway = gateway_of(request)
    job = to_job_request(body, idempotency_key=request.headers.get("idempotency-key"), tenant=caller.tenant)
    handle, record = await gateway.submit(job, body.model, kind_of(body), wire_param(body))
    response.headers["Location"] = f"/v1/jobs/{handle.id}"
    return JobObject(id=handle.id, status=await handle.status(), model=record.model, queue=record.queue,
                     created=record.created)


@router.get("/{job_id}")
async def get_job(job_id: str, request: Request, caller: CallerDep) -> JobObject:
    job_id, client, record = await _existing(request, caller.tenant, job_id)
    return await _job_object(client, record, job_id)


@router.get("/{job_id}/events")
async def job_events(job_id: str, request: Request, caller: CallerDep, after: str | None = None) -> Response:
    """SSE of the job's stream entries after ``Last-Event-ID`` (what a reconnecting EventSource
    sends) or else ``after``; from the start without either."""
    last_id = request.headers.get("last-event-id") or after or "0-0"
    try:
        parse_stream_id(last_id)
    except ValueError as exc:
        raise ApiError.invalid(f"after: {exc}", "after") from None
    job_id, client, _record = await _existing(request, caller.tenant, job_id)
    return await open_stream(request, gateway_of(request), client, job_id, NativeRenderer(job_id, after=last_id),
                             cancel_on_disconnect=False, deadline=None, headers={"X-Slotq-Job-Id": job_id})


@router.delete("/{job_id}")
async def cancel_job(job_id: str, request: Request, caller: CallerDep) -> JobObject:
    job_id, client, record = await _existing(request, caller.tenant, job_id)
    cancelled = await client.cancel(job_id)
    job = await _job_object(client, record, job_id)
    job.cancelled = cancelled
    return job


async def _existing(request: Request, tenant: str, job_id: str) -> tuple[str, SlotqClient, JobRecord | None]:
    """The tenant's job that ``job_id`` names (its full id), or 404."""
    own, client, record = await gateway_of(request).find(tenant, job_id)
    if await client.status(own) == JobStatus.NOT_FOUND:
        raise ApiError.job_not_found(job_id)
    return own, client, record


async def _job_object(client: SlotqClient, record: JobRecord | None, job_id: str) -> JobObject:
    status = await client.status(job_id)
    job = JobObject(id=job_id, status=status, queue=client.settings.queue_name,
                    model=record.model if record else None, created=record.created if record else None)
    if status in (JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.NOT_FOUND):
        return job
    job.result = await client.result(job_id, timeout=10)
    if record is not None and unfinished_error(job.result) is None:
        job.response = to_response(record.kind, job.result, record.model, record.created)
    return job
