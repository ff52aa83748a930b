"""Batch API state: the batch objects, listing, status changes and the per-batch lease, stored
through :class:`~slotq.jobs.gateway.records.BatchRecords` (which holds the keys and commands).

A batch is a hash (one JSON value per field of OpenAI's batch object, plus the queue it runs on),
so that the driver's progress writes and a cancel from any replica touch different fields and never
overwrite each other. A batch belongs to the tenant that created it: the index for listing is per
tenant, and another tenant's batch is looked up as one that does not exist. Status changes go
through one script that checks the current status first (``transition``): a batch being cancelled
cannot be marked completed by a driver that had not noticed yet, and the other way round.

The lease (a token with a TTL) says which gateway drives a
batch; the driver renews it while it runs (:mod:`slotq.jobs.gateway.batch_driver`). Batches not yet
finished are also in a set, which every gateway scans for batches whose lease has expired.
"""

from __future__ import annotations

import builtins
import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from redis.asyncio import Redis

from slotq.jobs.bulk.openai_batch import Endpoint
from slotq.jobs.gateway.records import BatchRecords
from slotq.jobs.openai.errors import ApiError
from slotq.jobs.protocol.keys import DEFAULT_TENANT
from slotq.jobs.protocol.wire import Usage

COMPLETION_WINDOW_S = 24 * 3600

BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                      "cancelled"]
FINAL_STATUSES = frozenset({"failed", "completed", "expired", "cancelled"})


def output_file_id(batch_id: str) -> str:
    return f"file-{batch_id.removeprefix('batch_')}-output"


def error_file_id(batch_id: str) -> str:
    return f"file-{batch_id.removeprefix('batch_')}-errors"


class CreateBatch(BaseModel):
    """The body of ``POST /v1/batches``."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1)
    endpoint: Endpoint
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(None, max_length=16)

    @field_validator("metadata")
    @classmethod
    def _metadata_sizes(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key, item in (value or {}).items():
            if len(key) > 64 or len(item) > 512:
                raise ValueError(f"key {key[:70]!r}: keys are at most 64 characters, values at most 512")
        return value


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(BaseModel):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    """OpenAI's batch ``usage``: the tokens of the batch's requests that ran (cached = prompt
    tokens whose KV cache was reused)."""

    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0

    def plus(self, usage: Usage) -> BatchUsage:
        return BatchUsage(
            input_tokens=self.input_tokens + usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(
                cached_tokens=self.input_tokens_details.cached_tokens + usage.cached_prompt_tokens),
            output_tokens=self.output_tokens + usage.completion_tokens,
            total_tokens=self.total_tokens + usage.prompt_tokens + usage.completion_tokens)


class Batch(BaseModel):
    """OpenAI's batch object (``queue`` and ``tenant``, slotq's own, are kept in Redis but not sent)."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: Endpoint
    model: str | None = None
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str = "24h"
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    usage: BatchUsage | None = None
    metadata: dict[str, str] | None = None
    queue: str | None = Field(None, exclude=True)
    tenant: str = Field(DEFAULT_TENANT, exclude=True)


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


class BatchStore:
    def __init__(self, redis: Redis, *, lease_s: float) -> None:
        self.records = BatchRecords(redis, lease_ms=int(lease_s * 1000))

    # ------------------------------------------------------------------ the objects
    async def create(self, request: CreateBatch, tenant: str) -> Batch:
        now = int(time.time())
        batch = Batch(id="batch_" + secrets.token_hex(12), endpoint=request.endpoint,
                      input_file_id=request.input_file_id,
                      status="validating", created_at=now, expires_at=now + COMPLETION_WINDOW_S,
                      metadata=request.metadata, tenant=tenant)
        await self.records.add(batch.id, tenant, {name: getattr(batch, name) for name in Batch.model_fields},
                               created_ms=now * 1000)
        return batch

    async def find(self, batch_id: str) -> Batch | None:
        fields = await self.records.get(batch_id)
        return Batch.model_validate(fields) if fields else None

    async def get(self, batch_id: str, tenant: str | None = None) -> Batch:
        """The batch; with ``tenant``, only if it is that tenant's (404 for another's, as for none)."""
        batch = await self.find(batch_id)
        if batch is None or tenant not in (None, batch.tenant):
            raise ApiError(404, f"no batch {batch_id!r}", param="batch_id", code="batch_not_found")
        return batch

    async def status(self, batch_id: str) -> BatchStatus | None:
        status: BatchStatus | None = await self.records.get_field(batch_id, "status")
        return status

    async def list(self, *, tenant: str, limit: int, after: str | None) -> BatchList:
        """The tenant's batches, newest first, after the batch ``after``."""
        start = 0
        if after is not None:
            rank = await self.records.rank(tenant, after)
            if rank is None:
                raise ApiError.invalid(f"after: no batch {after!r}", "after")
            start = rank + 1
        ids = await self.records.page(tenant, start, start + limit)
        found = [b for b in [await self.find(i) for i in ids] if b is not None]
        data = found[:limit]
        return BatchList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                         has_more=len(ids) > limit)

    async def update(self, batch_id: str, **fields: Any) -> None:
        """Fields only the batch's driver writes (progress, model, queue)."""
        await self.records.update(batch_id, fields)

    async def transition(self, batch_id: str, leaving: set[str], status: BatchStatus, **fields: Any) -> bool:
        """Set ``status`` (and ``<status>_at`` and ``fields``) if the batch's status is one of ``leaving``."""
        return await self.records.transition(batch_id, leaving,
                                             {"status": status, f"{status}_at": int(time.time()), **fields})

    # ------------------------------------------------------------------ who drives it
    async def active_ids(self) -> builtins.list[str]:      # builtins: this class has a list()
        return await self.records.active_ids()

    async def active_inputs(self) -> dict[str, Batch]:
        """The unfinished batches by their input file (a file they may still read)."""
        batches = [await self.find(batch_id) for batch_id in await self.records.active_ids()]
        return {b.input_file_id: b for b in batches if b is not None and b.status not in FINAL_STATUSES}

    async def active_input_ids(self) -> set[str]:
        return set(await self.active_inputs())

    async def retire(self, batch_id: str) -> None:
        """The batch is finished: no gateway needs to look at it again."""
        await self.records.retire(batch_id)

    async def acquire(self, batch_id: str, token: str) -> bool:
        return await self.records.acquire(batch_id, token)

    async def renew(self, batch_id: str, token: str) -> bool:
        return await self.records.renew(batch_id, token)

    async def release(self, batch_id: str, token: str) -> None:
        await self.records.release(batch_id, token)
