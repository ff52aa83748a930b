"""``/v1/files``: upload a batch input, read a file's record and contents, list and delete files
(:mod:`jobs.gateway.files` says where they are kept)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, File, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse

from jobs.gateway.auth import require_key
from jobs.gateway.batches import BatchStore
from jobs.gateway.errors import ApiError
from jobs.gateway.files import FileDeleted, FileList, FileObject, FileStore

router = APIRouter(prefix="/v1/files", dependencies=[Depends(require_key)])

MULTIPART_SLACK = 64 * 1024      # the form's other parts and boundaries around the file


def files_of(request: Request) -> FileStore:
    return request.app.state.files


@router.post("")
async def upload_file(request: Request, file: Annotated[UploadFile, File()],
                      purpose: Annotated[str, Form()]) -> FileObject:
    """Multipart, as the SDKs send it: ``file`` and ``purpose`` (``batch``: the Batch API's input)."""
    store = files_of(request)
    if purpose != "batch":
        raise ApiError.invalid(f"purpose: slotq keeps files for the Batch API only: purpose must be 'batch' "
                               f"(got {purpose!r})", "purpose")
    declared = int(request.headers.get("content-length") or 0)
    if declared > store.max_bytes + MULTIPART_SLACK:
        raise ApiError.invalid(f"file: larger than the limit of {store.max_bytes // (1 << 20)} MB "
                               "(SLOTQ_GATEWAY_MAX_FILE_MB)", "file", code="file_too_large")
    return await store.upload(file.file, file.filename or "upload.jsonl", "batch")


@router.get("")
async def list_files(request: Request, purpose: str | None = None, after: str | None = None,
                     limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
                     order: Literal["asc", "desc"] = "desc") -> FileList:
    return await files_of(request).list(purpose=purpose, limit=limit, after=after, order=order)


@router.get("/{file_id}")
async def get_file(file_id: str, request: Request) -> FileObject:
    return await files_of(request).get(file_id)


@router.get("/{file_id}/content")
async def file_content(file_id: str, request: Request) -> FileResponse:
    store = files_of(request)
    obj = await store.get(file_id)
    path = store.path(file_id)
    if not path.is_file():
        raise ApiError(404, f"the contents of {file_id} are missing from SLOTQ_GATEWAY_FILES_DIR", param="file_id",
                       code="file_not_found")
    return FileResponse(path, media_type="application/jsonl", filename=obj.filename)


@router.delete("/{file_id}")
async def delete_file(file_id: str, request: Request) -> FileDeleted:
    """Refused (409) for the input of a batch that has not finished: resuming it reads the file."""
    batches: BatchStore = request.app.state.batches
    for batch_id in await batches.active_ids():
        batch = await batches.find(batch_id)
        if batch is not None and batch.input_file_id == file_id:
            raise ApiError(409, f"file {file_id} is the input of {batch_id}, which is {batch.status}; cancel it or "
                           "wait for it to finish", param="file_id", code="file_in_use")
    return await files_of(request).delete(file_id)
