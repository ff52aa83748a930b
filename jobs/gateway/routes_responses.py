"""``/v1/responses``: OpenAI's Responses API on the queue.

A Responses request is the same job a chat completion is (:mod:`slotq.jobs.responses.translate`),
submitted, streamed (:mod:`.response_events`), waited for and cancelled the same way
(:mod:`.routes_openai`'s pieces): the tenant's quotas, lanes, limits and idempotency keys apply
alike, and errors are in OpenAI's shape, naming the field as the Responses request spells it
(``max_output_tokens``, ``input[2].call_id``). Stored responses (``store``, the default, and
``previous_response_id``) are :mod:`.response_store`'s records, scoped to the caller's tenant.
"""

from __future__ import annotations

import contextlib
from typing import Literal

from fastapi import APIRouter, Depends, Query, Request, Response

from slotq.jobs.gateway.auth import CallerDep, authenticate
from slotq.jobs.gateway.job_results import count_prompt, finished_result
from slotq.jobs.gateway.response_events import ResponseEventRenderer
from slotq.jobs.gateway.response_store import ResponseStore, Stored
from slotq.jobs.gateway.response_watch import ResponseWatcher
from slotq.jobs.gateway.routes_openai import gateway_of
from slotq.jobs.gateway.sse import ClientGone, open_stream
from slotq.jobs.openai.errors import ApiError
from slotq.jobs.openai.translate import unfinished_error
from slotq.jobs.producer.client import JobNotFound, JobTimeout
from slotq.jobs.protocol.schemas import JobStatus
from slotq.jobs.responses.translate import (
    counting_request,
    listed_items,
    response_error,
    response_shell,
    to_job_request,
    to_response,
    wire_param,
)
from slotq.jobs.responses.wire import InputTokens, ItemList, ResponsesRequest
from slotq.jobs.responses.wire import Response as ResponseObject

router = APIRouter(prefix="/v1", dependencies=[Depends(authenticate)])
CANCEL_WAIT_S = 5.0      # how long a cancel waits for the job's cancelled result before answering as it stands


def store_of(request: Request) -> ResponseStore:
    return ResponseStore(gateway_of(request))


def watcher_of(request: Request) -> ResponseWatcher:
    watcher: ResponseWatcher = request.app.state.response_watcher
    return watcher


@router.post("/responses/input_tokens")
async def input_tokens(body: ResponsesRequest, request: Request, caller: CallerDep) -> Response:
    """The conversation's input tokens (``previous_response_id`` included), as a worker serving
    ``model`` renders and tokenizes it: a job that generates one token
    (:func:`~slotq.jobs.responses.translate.counting_request`), so it counts against the tenant's
    quotas as the work it is, and is cancelled if the client leaves."""
    gateway = gateway_of(request)
    if body.previous_response_id:
        store = store_of(request)
        body = store.continued(await store.get(caller.tenant, body.previous_response_id,
                                               param="previous_response_id"), body)
    job = to_job_request(counting_request(body), tenant=caller.tenant)
    return await count_prompt(request, gateway, job, body.model, wire_param,
                              lambda tokens: InputTokens(input_tokens=tokens))


@router.post("/responses")
async def create_response(body: ResponsesRequest, request: Request, caller: CallerDep) -> Response:
    gateway = gateway_of(request)
    store = store_of(request)
    if body.previous_response_id:
        previous = await store.get(caller.tenant, body.previous_response_id, param="previous_response_id")
        body = store.continued(previous, body)
    job = to_job_request(body, idempotency_key=request.headers.get("idempotency-key"), tenant=caller.tenant)
    handle, record = await gateway.submit(job, body.model, "chat", wire_param)
    if body.store:
        await store.put(handle.id, body, record)
    if body.background:                 # its webhook event, once its job ends
        await watcher_of(request).watch(handle.id)
    keep = (body.keep_on_disconnect if body.keep_on_disconnect is not None
            else gateway.settings.gateway_keep_on_disconnect)
    # only the request that created a job cancels it, and a background response only on request
    owner_cancels = handle.created and not keep and not body.background
    headers = {"X-Slotq-Job-Id": handle.id}
    if body.background and not body.stream:
        queued = response_shell(body, handle.id, record.model, record.created)
        queued.status = "queued"
        return Response(queued.model_dump_json(), media_type="application/json", headers=headers)
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


def stored_response(stored: Stored) -> ResponseObject:
    """A stored response as it stands: in progress (queued or running), or its job's outcome, a job
    that did not finish its reply reading ``failed`` or ``cancelled`` with the error."""
    request, model, created = stored.stored.request, stored.stored.model, stored.stored.created
    result = stored.result
    if result is None:
        shell = response_shell(request, stored.job_id, model, created)
        shell.status = "queued" if stored.status == JobStatus.QUEUED else "in_progress"
        return shell
    error = unfinished_error(result, wire_param)
    if error is None:
        return to_response(result, request, model, created)
    shell = response_shell(request, stored.job_id, model, created)
    cancelled = result.status == JobStatus.CANCELLED
    shell.status = "cancelled" if cancelled else "failed"
    shell.error = None if cancelled else response_error(error)     # a cancel is no failure: the status says it
    return shell


@router.get("/responses/{response_id}")
async def get_response(response_id: str, request: Request, caller: CallerDep, stream: bool = False,
                       starting_after: int | None = Query(None, ge=-1)) -> Response:
    """The Response as it stands, or (``stream=true``) its events from the job's stream, those
    after ``starting_after`` only: a client that lost a stream resumes it exactly once, from any
    gateway, while the job's stream lives (``SLOTQ_STREAM_TTL_S`` after it ends; then 410, and the
    Response itself still answers). Reading never cancels the job."""
    stored = await store_of(request).get(caller.tenant, response_id)
    headers = {"X-Slotq-Job-Id": stored.job_id}
    if stream:
        shell = response_shell(stored.stored.request, stored.job_id, stored.stored.model, stored.stored.created)
        renderer = ResponseEventRenderer(shell, starting_after=starting_after)
        return await open_stream(request, gateway_of(request), stored.client, stored.job_id, renderer,
                                 cancel_on_disconnect=False, deadline=None, headers=headers,
                                 first_error=renderer.first_error)
    return Response(stored_response(stored).model_dump_json(), media_type="application/json", headers=headers)


@router.delete("/responses/{response_id}")
async def delete_response(response_id: str, request: Request, caller: CallerDep) -> dict[str, object]:
    """Forget the stored response (its job's result expires on its own, ``SLOTQ_KEEP_RESULT_S``)."""
    deleted = await store_of(request).delete(caller.tenant, response_id)
    return {"id": deleted, "object": "response", "deleted": True}


@router.get("/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, caller: CallerDep,
                           order: Literal["asc", "desc"] = "desc", limit: int = Query(20, ge=1, le=100),
                           after: str | None = None) -> ItemList:
    """The stored response's input items (the whole conversation it ran, a ``previous_response_id``
    chain included), newest first unless ``order=asc``, ``limit`` a page, ``after`` an item's id."""
    stored = await store_of(request).get(caller.tenant, response_id)
    items = listed_items(stored.stored.request, stored.job_id)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise ApiError.invalid(f"after: no input item {after!r} in {response_id}", "after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return ItemList(data=page, first_id=page[0]["id"] if page else None, last_id=page[-1]["id"] if page else None,
                    has_more=len(items) > limit)


@router.post("/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request, caller: CallerDep) -> Response:
    """Cancel a background response's job and answer the Response as it then stands (``cancelled``,
    or its outcome when it had finished already). A response that is not a background one is
    cancelled by its own request leaving, as on OpenAI: a 400."""
    store = store_of(request)
    stored = await store.get(caller.tenant, response_id)
    if not stored.stored.request.background:
        raise ApiError.invalid(f"{response_id} is not a background response: only those are cancelled by id",
                               "response_id")
    if stored.result is None:
        await stored.client.cancel(stored.job_id)
        with contextlib.suppress(JobTimeout, JobNotFound):
            await stored.client.result(stored.job_id, timeout=CANCEL_WAIT_S)   # a running job stops at its next step
        stored = await store.get(caller.tenant, response_id)
    return Response(stored_response(stored).model_dump_json(), media_type="application/json",
                    headers={"X-Slotq-Job-Id": stored.job_id})
