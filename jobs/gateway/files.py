"""Files for the Batch API: metadata in Redis, contents in a directory every replica shares.

Contents are not put in Redis: a batch input of 100,000 lines is hundreds of megabytes, and a Redis
that fills up (``noeviction``) stops the whole fleet. A directory (``SLOTQ_GATEWAY_FILES_DIR``, a
volume shared by the replicas) holds them instead, and the bulk runner reads and appends them in
place, as ``slotq bulk`` does with local files. Redis holds a small record per file (what
``GET /v1/files/{id}`` returns, plus its tenant) and an index per tenant by creation for listing,
so any replica can answer (:class:`~slotq.jobs.gateway.records.FileRecords`). A file of another
tenant is looked up as one that does not exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import IO, Literal

from pydantic import BaseModel, Field
from redis.asyncio import Redis

from slotq.jobs.gateway.errors import ApiError
from slotq.jobs.gateway.records import FileRecords
from slotq.jobs.protocol.schemas import DEFAULT_TENANT

FILE_ID_RE = re.compile(r"file-[0-9A-Za-z_-]{1,100}")

Purpose = Literal["batch", "batch_output"]


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def file_not_found(file_id: str) -> ApiError:
    return ApiError(404, f"no file {file_id!r}", param="file_id", code="file_not_found")


class FileObject(BaseModel):
    """OpenAI's file object."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Purpose
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None
    tenant: str = Field(DEFAULT_TENANT, exclude=True)      # kept in Redis, never sent


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class FileStore:
    def __init__(self, redis: Redis, directory: Path, *, max_bytes: int) -> None:
        self.records = FileRecords(redis)
        self.directory = directory
        self.max_bytes = max_bytes

    def path(self, file_id: str) -> Path:
        if not FILE_ID_RE.fullmatch(file_id):           # never a path outside the directory
            raise file_not_found(file_id)
        return self.directory / file_id

    def size(self, file_id: str) -> int:
        """Bytes in the file's contents; 0 when there are none."""
        try:
            return self.path(file_id).stat().st_size
        except FileNotFoundError:
            return 0

    async def upload(self, source: IO[bytes], filename: str, purpose: Purpose, tenant: str) -> FileObject:
        """Copy an upload into the directory (refusing it past ``max_bytes``) and record it."""
        file_id = new_file_id()
        size = await asyncio.to_thread(self._copy, source, file_id)
        return await self.register(file_id, filename, purpose, tenant, size)

    def _copy(self, source: IO[bytes], file_id: str) -> int:
        self.directory.mkdir(parents=True, exist_ok=True)
        partial = self.directory / f".upload-{file_id}"
        size = 0
        try:
            with open(partial, "wb") as out:
                while chunk := source.read(1 << 20):
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise ApiError.invalid(f"file: larger than the limit of {self.max_bytes // (1 << 20)} MB "
                                               "(SLOTQ_GATEWAY_MAX_FILE_MB)", "file", code="file_too_large")
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            partial.rename(self.path(file_id))
        finally:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()
        return size

    async def register(self, file_id: str, filename: str, purpose: Purpose, tenant: str,
                       size: int | None = None) -> FileObject:
        """Record a file already in the directory (an upload, or a batch's output) as the tenant's."""
        if size is None:
            size = self.path(file_id).stat().st_size
        now = time.time()
        obj = FileObject(id=file_id, bytes=size, created_at=int(now), filename=filename, purpose=purpose, tenant=tenant)
        await self.records.add(file_id, tenant, json.dumps(obj.model_dump(mode="json") | {"tenant": tenant}),
                               created_ms=int(now * 1000))
        return obj

    async def get(self, file_id: str, tenant: str) -> FileObject:
        """The tenant's file; 404 for another tenant's, as for none."""
        raw = await self.records.get(file_id)
        obj = None if raw is None else FileObject.model_validate_json(raw)
        if obj is None or obj.tenant != tenant:
            raise file_not_found(file_id)
        return obj

    async def list(self, *, tenant: str, purpose: str | None, limit: int, after: str | None, order: str) -> FileList:
        """The tenant's files, newest first (``order=desc``, OpenAI's default) or oldest first,
        after the file ``after``."""
        start = 0
        if after is not None:
            rank = await self.records.rank(tenant, after, newest_first=order == "desc")
            if rank is None:
                raise ApiError.invalid(f"after: no file {after!r}", "after")
            start = rank + 1
        found: list[FileObject] = []
        page = max(limit, 100)
        while len(found) <= limit:
            ids = await self.records.page(tenant, start, page, newest_first=order == "desc")
            if not ids:
                break
            start += len(ids)
            for raw in await self.records.get_many(ids):
                if raw is not None:
                    obj = FileObject.model_validate_json(raw)
                    if purpose is None or obj.purpose == purpose:
                        found.append(obj)
        data = found[:limit]
        return FileList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                        has_more=len(found) > limit)

    async def delete(self, file_id: str, tenant: str) -> FileDeleted:
        await self.get(file_id, tenant)
        await self.records.remove(file_id, tenant)
        await asyncio.to_thread(self.path(file_id).unlink, missing_ok=True)
        return FileDeleted(id=file_id)
