"""``/v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API on the queue.

A Messages request is the same job a chat completion is (:mod:`slotq.jobs.anthropic.translate`),
submitted, streamed, waited for and cancelled the same way (:mod:`.routes_openai`'s pieces): the
tenant's quotas, lanes, limits and idempotency keys apply alike, and a stream resumes with
``Last-Event-ID`` plus the original request's ``Idempotency-Key`` header (or ``idempotency_key``).
Errors on these paths are in Anthropic's shape (:mod:`.http_errors`), and the caller's key may come
as ``x-api-key``, as the ``anthropic`` SDK sends it, or as a Bearer token (:mod:`.auth`).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from slotq.jobs.anthropic.translate import to_count_job, to_job_request, to_message, wire_param
from slotq.jobs.anthropic.wire import CountTokensRequest, MessagesRequest, TokenCount
from slotq.jobs.gateway.auth import CallerDep, authenticate
from slotq.jobs.gateway.job_results import count_prompt, finished_result
from slotq.jobs.gateway.message_events import MessageEventRenderer
from slotq.jobs.gateway.routes_openai import gateway_of, resumed_job
from slotq.jobs.gateway.sse import ClientGone, open_stream

router = APIRouter(prefix="/v1", dependencies=[Depends(authenticate)])


@router.post("/messages")
async def messages(body: MessagesRequest, request: Request, caller: CallerDep) -> Response:
    gateway = gateway_of(request)
    if body.stream and request.headers.get("last-event-id"):
        last_id, job_id, client, record = await resumed_job(request, gateway, caller, body.idempotency_key)
        return await open_stream(request, gateway, client, job_id,
                                 MessageEventRenderer(job_id, record.model if record else body.model, after=last_id),
                                 cancel_on_disconnect=False, deadline=body.deadline,
                                 headers={"X-Slotq-Job-Id": job_id})
    job = to_job_request(body, idempotency_key=request.headers.get("idempotency-key"), tenant=caller.tenant)
    handle, record = await gateway.submit(job, body.model, "chat", wire_param)
    keep = (body.keep_on_disconnect if body.keep_on_disconnect is not None
            else gateway.settings.gateway_keep_on_disconnect)
    owner_cancels = handle.created and not keep       # only the request that created a job cancels it
    headers = {"X-Slotq-Job-Id": handle.id}
    if body.stream:
        renderer = MessageEventRenderer(handle.id, record.model)
        return await open_stream(request, gateway, handle.client, handle.id, renderer,
                                 cancel_on_disconnect=owner_cancels, deadline=job.deadline, headers=headers,
                                 first_error=renderer.first_error)
    try:
        result = await finished_result(request, gateway, handle, deadline=job.deadline, owner_cancels=owner_cancels,
                                       param=wire_param)
    except ClientGone:
        return Response(status_code=499)
    return Response(to_message(result, record.model).model_dump_json(), media_type="application/json",
                    headers=headers)


@router.post("/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request, caller: CallerDep) -> Response:
    """The conversation's prompt tokens, as a worker serving ``model`` renders and tokenizes it: a
    job that generates one token (:func:`~slotq.jobs.anthropic.translate.to_count_job`), so it
    counts against the tenant's quotas as the work it is, and is cancelled if the client leaves."""
    gateway = gateway_of(request)
    job = to_count_job(body, tenant=caller.tenant)
    return await count_prompt(request, gateway, job, body.model, wire_param,
                              lambda tokens: TokenCount(input_tokens=tokens))
