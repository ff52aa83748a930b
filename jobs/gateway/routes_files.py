"""``/v1/files``: upload a batch input, read a file's record and contents, list and delete files
(:mod:`slotq.jobs.gateway.files` says where they are kept)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, File, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse

from slotq.jobs.gateway.auth import CallerDep, authenticate
from slotq.jobs.gateway.batches import BatchStore
from slotq.jobs.gateway.files import FileDeleted, FileList, FileObject, FileStore, expiry_seconds
from slotq.jobs.openai.errors import ApiError

router = APIRouter(prefix="/v1/files", dependencies=[Depends(authenticate)])


def files_of(request: Request) -> FileStore:
    files: FileStore = request.app.state.files
    return files


ExpiresAnchor = Annotated[str | None, Form(alias="expires_after[anchor]")]
ExpiresSeconds = Annotated[int | None, Form(alias="expires_after[seconds]")]


@router.post("")
async def upload_file(request: Request, file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()],
                      caller: CallerDep, expires_anchor: ExpiresAnchor = None,
                      expires_seconds: ExpiresSeconds = None) -> FileObject:
    """Multipart, as the SDKs send it: ``file``, ``purpose`` (``batch``: the Batch API's input) and
    optionally ``expires_after`` (the SDKs send ``expires_after[anchor]`` and ``expires_after[seconds]``).
    A body declared larger than the limit was refused before it was read (slotq.jobs.gateway.limits)."""
    if purpose != "batch":
        raise ApiError.invalid(f"purpose: slotq keeps files for the Batch API only: purpose must be 'batch' "
                               f"(got {purpose!r})", "purpose")
    return await files_of(request).upload(file.file, file.filename or "upload.jsonl", "batch", caller.tenant,
                                          expiry_seconds(expires_anchor, expires_seconds))


@router.get("")
async def list_files(request: Request, caller: CallerDep, purpose: str | None = None, after: str | None = None,
                     limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
                     order: Literal["asc", "desc"] = "desc") -> FileList:
    return await files_of(request).list(tenant=caller.tenant, purpose=purpose, limit=limit, after=after, order=order)


@router.get("/{file_id}")
async def get_file(file_id: str, request: Request, caller: CallerDep) -> FileObject:
    return await files_of(request).get(file_id, caller.tenant)


@router.get("/{file_id}/content")
async def file_content(file_id: str, request: Request, caller: CallerDep) -> FileResponse:
    store = files_of(request)
    obj = await store.get(file_id, caller.tenant)
    if not await store.exists(file_id):
        raise ApiError(404, f"the contents of {file_id} are missing from SLOTQ_GATEWAY_FILES_DIR", param="file_id",
                       code="file_not_found")
    return FileResponse(store.path(file_id), media_type="application/jsonl", filename=obj.filename)


@router.delete("/{file_id}")
async def delete_file(file_id: str, request: Request, caller: CallerDep) -> FileDeleted:
    """Refused (409) for the input of a batch that has not finished: resuming it reads the file."""
    await files_of(request).get(file_id, caller.tenant)          # another tenant's file is not found
    batches: BatchStore = request.app.state.batches
    batch = (await batches.active_inputs()).get(file_id)
    if batch is not None:
        raise ApiError(409, f"file {file_id} is the input of {batch.id}, which is {batch.status}; cancel it or "
                       "wait for it to finish", param="file_id", code="file_in_use")
    return await files_of(request).delete(file_id, caller.tenant)
