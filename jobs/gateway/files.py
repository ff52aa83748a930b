"""Files for the Batch API: metadata in Redis, contents in a directory every replica shares.

Contents are not put in Redis: a batch input of 100,000 lines is hundreds of megabytes, and a Redis
that fills up (``noeviction``) stops the whole fleet. A directory (``SLOTQ_GATEWAY_FILES_DIR``, a
volume shared by the replicas) holds them instead, and the bulk runner reads and appends them in
place, as ``slotq bulk`` does with local files. Redis holds a small record per file (what
``GET /v1/files/{id}`` returns, plus its tenant) and an index per tenant by creation for listing,
so any replica can answer (:class:`~slotq.jobs.gateway.records.FileRecords`). A file of another
tenant is looked up as one that does not exist.

Bounded per tenant: at most ``SLOTQ_GATEWAY_TENANT_MAX_FILES`` files and
``SLOTQ_GATEWAY_TENANT_MAX_FILES_MB`` of them (uploads are refused past either, checked in the
script that records the file, so concurrent uploads cannot both take the last place; batch outputs
count but are never refused: the batch has run). Every file expires: OpenAI's ``expires_after``
(``{"anchor": "created_at", "seconds": N}``, 1 hour to 30 days) or ``SLOTQ_GATEWAY_FILE_EXPIRY_S``.
An expired file is gone at once for its tenant, and a sweep every ``SWEEP_S`` on each replica
removes its record and contents, except a batch input while its batch runs (the next sweep after).

Disk work (copying an upload, stat, unlink) runs in threads: a shared volume can be slow, and the
event loop serves every other request meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, Literal

from pydantic import BaseModel, Field, ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from slotq.jobs.gateway.records import FileQuotaExceeded, FileRecords
from slotq.jobs.openai.errors import ApiError
from slotq.jobs.protocol.keys import DEFAULT_TENANT

log = logging.getLogger(__name__)

FILE_ID_RE = re.compile(r"file-[0-9A-Za-z_-]{1,100}")
EXPIRES_AFTER_S = (3600, 30 * 86_400)      # OpenAI's bounds on expires_after.seconds
SWEEP_S = 60.0
SWEEP_BATCH = 100

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


def expiry_seconds(anchor: str | None, seconds: int | None) -> int | None:
    """OpenAI's ``expires_after`` of an upload as seconds after its creation (None: not given), or
    a 400 naming the part that is wrong."""
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise ApiError.invalid(f"expires_after.anchor: must be 'created_at' (got {anchor!r})", "expires_after.anchor")
    low, high = EXPIRES_AFTER_S
    if seconds is None or not low <= seconds <= high:
        raise ApiError.invalid(f"expires_after.seconds: must be {low} to {high} (got {seconds})",
                               "expires_after.seconds")
    return seconds


class FileStore:
    def __init__(self, redis: Redis, directory: Path, *, max_bytes: int, tenant_max_files: int,
                 tenant_max_bytes: int, default_expiry_s: int, clock: Callable[[], float] = time.time) -> None:
        self.records = FileRecords(redis)
        self.directory = directory
        self.max_bytes = max_bytes
        self.tenant_max_files = tenant_max_files
        self.tenant_max_bytes = tenant_max_bytes
        self.default_expiry_s = default_expiry_s
        self.clock = clock
        self.in_use: Callable[[], Awaitable[set[str]]] = _nothing_in_use
        self._sweeper: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ the sweep
    def start(self, in_use: Callable[[], Awaitable[set[str]]]) -> None:
        """Sweep expired files every SWEEP_S, keeping those ``in_use`` names (inputs of running batches)."""
        self.in_use = in_use
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever(), name="slotq-file-sweep")

    @property
    def running(self) -> bool:
        return self._sweeper is not None and not self._sweeper.done()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)

    async def _sweep_forever(self) -> None:
        while True:
            try:
                await self.sweep()
            except (RedisError, OSError) as exc:
                log.warning("file sweep failed (%s: %s); retrying in %g s", type(exc).__name__, exc, SWEEP_S)
            await asyncio.sleep(SWEEP_S)

    async def sweep(self) -> int:
        """Remove every expired file but those in use; how many were removed. A record that cannot be
        read (written by hand, or by a version that stored another shape) is skipped with an error
        naming its key, and stays for an operator: it never stops the sweep of the others."""
        if not await self.records.expired(self.clock(), 1):
            return 0                  # the common case: nothing expired, so no batch needs reading either
        keep = set(await self.in_use())           # and the records that cannot be read
        removed = 0
        while ids := [i for i in await self.records.expired(self.clock(), SWEEP_BATCH + len(keep)) if i not in keep]:
            chunk = ids[:SWEEP_BATCH]
            for file_id, raw in zip(chunk, await self.records.get_many(chunk)):
                if raw is None:
                    await self.records.forget_expiry(file_id)
                    continue
                try:
                    obj = FileObject.model_validate_json(raw)
                except ValidationError as exc:
                    log.error("file record %s cannot be read (%s); skipped by the sweep, left for an operator "
                              "to delete", self.records.keys.file(file_id), exc.errors()[0]["msg"])
                    keep.add(file_id)
                    continue
                removed += await self._remove(obj)
        if removed:
            log.info("removed %d expired files", removed)
        return removed

    async def _remove(self, obj: FileObject) -> bool:
        removed = await self.records.remove(obj.id, obj.tenant, obj.bytes)
        if removed:
            await asyncio.to_thread(self.path(obj.id).unlink, missing_ok=True)
        return removed

    # ------------------------------------------------------------------ the files

    def path(self, file_id: str) -> Path:
        if not FILE_ID_RE.fullmatch(file_id):           # never a path outside the directory
            raise file_not_found(file_id)
        return self.directory / file_id

    async def size(self, file_id: str) -> int:
        """Bytes in the file's contents; 0 when there are none."""
        try:
            return (await asyncio.to_thread(self.path(file_id).stat)).st_size
        except FileNotFoundError:
            return 0

    async def exists(self, file_id: str) -> bool:
        return await asyncio.to_thread(self.path(file_id).is_file)

    def _quota_error(self, what: Literal["files", "bytes"]) -> ApiError:
        if what == "files":
            return ApiError.invalid(f"file: this tenant keeps {self.tenant_max_files} files already, the limit "
                                    "(SLOTQ_GATEWAY_TENANT_MAX_FILES); delete some, or let them expire", "file",
                                    code="tenant_files_limit_exceeded")
        return ApiError.invalid(f"file: this tenant's files would pass the limit of {self.tenant_max_bytes >> 20} MB "
                                "in all (SLOTQ_GATEWAY_TENANT_MAX_FILES_MB); delete some, or let them expire", "file",
                                code="tenant_file_bytes_limit_exceeded")

    async def upload(self, source: IO[bytes], filename: str, purpose: Purpose, tenant: str,
                     expires_after_s: int | None = None) -> FileObject:
        """Copy an upload into the directory (refusing it past ``max_bytes`` or the tenant's caps)
        and record it, expiring ``expires_after_s`` (default: SLOTQ_GATEWAY_FILE_EXPIRY_S) after now."""
        count, used = await self.records.usage(tenant)
        if count >= self.tenant_max_files:
            raise self._quota_error("files")
        file_id = new_file_id()
        size = await asyncio.to_thread(self._copy, source, file_id, self.tenant_max_bytes - used)
        try:
            return await self._record(file_id, filename, purpose, tenant, size, expires_after_s,
                                      caps=(self.tenant_max_files, self.tenant_max_bytes))
        except Exception as exc:          # not recorded: its contents must not stay behind
            await asyncio.to_thread(self.path(file_id).unlink, missing_ok=True)
            if isinstance(exc, FileQuotaExceeded):             # another upload took the room meanwhile
                raise self._quota_error(exc.what) from None
            raise

    def _copy(self, source: IO[bytes], file_id: str, room: int) -> int:
        """The upload into the directory; ``room``: the bytes the tenant has left."""
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
                    if size > room:
                        raise self._quota_error("bytes")
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            partial.rename(self.path(file_id))
        finally:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()
        return size

    async def register(self, file_id: str, filename: str, purpose: Purpose, tenant: str, size: int) -> FileObject:
        """Record a file already in the directory (a batch's output, of ``size`` bytes: the caller has
        measured it) as the tenant's. It counts toward the tenant's caps but is never refused by them:
        the batch has run."""
        return await self._record(file_id, filename, purpose, tenant, size, None, caps=None)

    async def _record(self, file_id: str, filename: str, purpose: Purpose, tenant: str, size: int,
                      expires_after_s: int | None, caps: tuple[int, int] | None) -> FileObject:
        now = self.clock()
        created = int(now)
        obj = FileObject(id=file_id, bytes=size, created_at=created, filename=filename, purpose=purpose, tenant=tenant,
                         expires_at=created + (expires_after_s or self.default_expiry_s))
        await self.records.add(file_id, tenant, json.dumps(obj.model_dump(mode="json") | {"tenant": tenant}),
                               created_ms=int(now * 1000), size=size, expires_at=obj.expires_at, caps=caps)
        return obj

    def _live(self, obj: FileObject) -> bool:
        """Not expired (files recorded before expiry existed have no expires_at and stay)."""
        return obj.expires_at is None or obj.expires_at > self.clock()

    async def get(self, file_id: str, tenant: str) -> FileObject:
        """The tenant's file; 404 for another tenant's, as for none, and for an expired one."""
        raw = await self.records.get(file_id)
        obj = None if raw is None else FileObject.model_validate_json(raw)
        if obj is None or obj.tenant != tenant or not self._live(obj):
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
                    if (purpose is None or obj.purpose == purpose) and self._live(obj):
                        found.append(obj)
        data = found[:limit]
        return FileList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                        has_more=len(found) > limit)

    async def delete(self, file_id: str, tenant: str) -> FileDeleted:
        await self._remove(await self.get(file_id, tenant))
        return FileDeleted(id=file_id)


async def _nothing_in_use() -> set[str]:
    return set()
