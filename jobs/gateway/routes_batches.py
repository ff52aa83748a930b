"""``/v1/batches``: OpenAI's Batch API. A batch runs its input file through the queue's ``bulk``
lane (:mod:`slotq.jobs.gateway.batch_driver`); its state lives in Redis (:mod:`slotq.jobs.gateway.batches`),
so any replica answers for it and a restarted gateway loses nothing."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Query, Request
from pydantic import ValidationError

from slotq.jobs.gateway.auth import CallerDep, authenticate
from slotq.jobs.gateway.batch_driver import BatchDriver
from slotq.jobs.gateway.batches import Batch, BatchList, BatchStore, CreateBatch
from slotq.jobs.gateway.routes_files import files_of
from slotq.jobs.openai.errors import ApiError, from_validation

router = APIRouter(prefix="/v1/batches", dependencies=[Depends(authenticate)])


def batches_of(request: Request) -> BatchStore:
    batches: BatchStore = request.app.state.batches
    return batches


@router.post("")
async def create_batch(request: Request, payload: Annotated[dict[str, Any], Body()], caller: CallerDep) -> Batch:
    try:
        body = CreateBatch.model_validate(payload)
    except ValidationError as exc:
        raise from_validation(exc) from None
    try:
        source = await files_of(request).get(body.input_file_id, caller.tenant)
    except ApiError as exc:
        raise ApiError(404, f"input_file_id: no file {body.input_file_id!r}", param="input_file_id",
                       code="file_not_found") from exc
    if source.purpose != "batch":
        raise ApiError.invalid(f"input_file_id: {source.id} has purpose {source.purpose!r}; upload the input with "
                               "purpose 'batch'", "input_file_id")
    batch = await batches_of(request).create(body, caller.tenant)
    driver: BatchDriver = request.app.state.batch_driver
    driver.kick()
    return batch


@router.get("")
async def list_batches(request: Request, caller: CallerDep, after: str | None = None,
                       limit: Annotated[int, Query(ge=1, le=100)] = 20) -> BatchList:
    return await batches_of(request).list(tenant=caller.tenant, limit=limit, after=after)


@router.get("/{batch_id}")
async def get_batch(batch_id: str, request: Request, caller: CallerDep) -> Batch:
    return await batches_of(request).get(batch_id, caller.tenant)


@router.post("/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request, caller: CallerDep) -> Batch:
    """``cancelling`` at once; the gateway driving the batch cancels its lines in flight and then
    marks it ``cancelled``, with the lines finished so far in its output file."""
    store = batches_of(request)
    batch = await store.get(batch_id, caller.tenant)
    if batch.status in ("cancelling", "cancelled"):
        return batch
    if not await store.transition(batch_id, {"validating", "in_progress"}, "cancelling"):
        batch = await store.get(batch_id)
        if batch.status not in ("cancelling", "cancelled"):
            raise ApiError(409, f"batch {batch_id} is {batch.status}: only a validating or in-progress batch can be "
                           "cancelled", param="batch_id", code="batch_not_cancellable")
        return batch
    request.app.state.batch_driver.kick()
    return await store.get(batch_id)
