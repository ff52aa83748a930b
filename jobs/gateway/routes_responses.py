"""``POST /v1/responses``: OpenAI's Responses API on the queue.

A Responses request is the same job a chat completion is (:mod:`slotq.jobs.responses.translate`),
submitted, streamed (:mod:`.response_events`), waited for and cancelled the same way
(:mod:`.routes_openai`'s pieces): the tenant's quotas, lanes, limits and idempotency keys apply
alike, and errors are in OpenAI's shape, naming the field as the Responses request spells it
(``max_output_tokens``, ``input[2].call_id``).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from slotq.jobs.gateway.auth import CallerDep, authenticate
from slotq.jobs.gateway.response_events import ResponseEventRenderer
from slotq.jobs.gateway.routes_openai import finished_result, gateway_of
from slotq.jobs.gateway.sse import ClientGone, open_stream
from slotq.jobs.responses.translate import response_shell, to_job_request, to_response, wire_param
from slotq.jobs.responses.wire import ResponsesRequest

router = APIRouter(prefix="/v1", dependencies=[Depends(authenticate)])


@router.post("/responses")
async def create_response(body: ResponsesRequest, request: Request, caller: CallerDep) -> Response:
    gateway = gateway_of(request)
    job = to_job_request(body, idempotency_key=request.headers.get("idempotency-key"), tenant=caller.tenant)
    handle, record = await gateway.submit(job, body.model, "chat", wire_param)
    keep = (body.keep_on_disconnect if body.keep_on_disconnect is not None
            else gateway.settings.gateway_keep_on_disconnect)
    owner_cancels = handle.created and not keep       # only the request that created a job cancels it
    headers = {"X-Slotq-Job-Id": handle.id}
    if body.stream:
        renderer = ResponseEventRenderer(response_shell(body, handle.id, record.model, record.created))
        return await open_stream(request, gateway, handle.client, handle.id, renderer,
                                 cancel_on_disconnect=owner_cancels, deadline=job.deadline, headers=headers,
                                 first_error=renderer.first_error)
    try:
        result = await finished_result(request, gateway, handle, deadline=job.deadline, owner_cancels=owner_cancels,
                                       param=wire_param)
    except ClientGone:
        return Response(status_code=499)
    return Response(to_response(result, body, record.model, record.created).model_dump_json(),
                    media_type="application/json", headers=headers)
