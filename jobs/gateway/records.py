"""The gateway's own records in Redis: every key name they use and every Redis command on them.

================================  ======  ===========================================================
``slotq:gateway:job:{<id>}``      STRING  a job the gateway created (:class:`JobRecord`, JSON), kept as long
                                          as its result
``slotq:gateway:models``          HASH    served model name -> unix time it was last seen live
``slotq:gateway:file:{<id>}``     STRING  a Batch API file's object and tenant (JSON)
``slotq:gateway:files[:<t>]``     ZSET    file id -> created (ms), per tenant (the default tenant's has no suffix)
``slotq:gateway:batch:{<id>}``    HASH    a batch: one JSON value per field of its object (plus queue, tenant)
``slotq:gateway:batches[:<t>]``   ZSET    batch id -> created (ms), per tenant (the default tenant's has no suffix)
``slotq:gateway:batches:active``  SET     batches not finished yet (scanned for expired leases)
``slotq:gateway:batch-lease:{id}``STRING  the token of the gateway driving the batch, with a TTL
================================  ======  ===========================================================

Why here and not in :mod:`slotq.jobs.protocol`: the protocol is the contract between processes
that read what another kind of process wrote (producers, workers, the CLI, the gateway as a
producer). These records are written and read by gateway replicas only, and their shapes follow
the OpenAI API the gateway serves; keeping them in one gateway module puts every gateway key in
one place without making every producer and worker carry them. The objects' fields are the
business of the modules that own them (:mod:`~slotq.jobs.gateway.files`,
:mod:`~slotq.jobs.gateway.batches`); this module stores them. Per-object keys put the id in
braces (one Redis Cluster slot), as the protocol's keys do.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel
from redis.asyncio import Redis

from slotq.jobs.protocol.keys import DEFAULT_TENANT

MODELS_SEEN_KEY = "slotq:gateway:models"
FILES_INDEX_KEY = "slotq:gateway:files"
BATCHES_INDEX_KEY = "slotq:gateway:batches"
ACTIVE_BATCHES_KEY = "slotq:gateway:batches:active"


def gateway_job_key(job_id: str) -> str:
    """The gateway's record of a job (not the queue's job record, :func:`slotq.jobs.protocol.keys.job_record_key`)."""
    return f"slotq:gateway:job:{{{job_id}}}"


def file_key(file_id: str) -> str:
    return f"slotq:gateway:file:{{{file_id}}}"


def files_index_key(tenant: str) -> str:
    """The default tenant's files keep the key they had before tenants."""
    return FILES_INDEX_KEY if tenant == DEFAULT_TENANT else f"{FILES_INDEX_KEY}:{tenant}"


def batch_key(batch_id: str) -> str:
    return f"slotq:gateway:batch:{{{batch_id}}}"


def batches_index_key(tenant: str) -> str:
    """The default tenant's batches keep the key they had before tenants."""
    return BATCHES_INDEX_KEY if tenant == DEFAULT_TENANT else f"{BATCHES_INDEX_KEY}:{tenant}"


def batch_lease_key(batch_id: str) -> str:
    return f"slotq:gateway:batch-lease:{{{batch_id}}}"


# ---------------------------------------------------------------------- jobs and models
class JobRecord(BaseModel):
    """What a gateway remembers of a job it created, so that any replica finds it again by id."""

    queue: str
    model: str
    kind: Literal["chat", "text"]
    created: int
    fingerprint: str | None = None      # None in records written before idempotency keys were checked


class JobRecords:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    async def put(self, job_id: str, record: JobRecord, *, ttl_s: int) -> None:
        await self.redis.set(gateway_job_key(job_id), record.model_dump_json(), ex=ttl_s)

    async def put_if_absent(self, job_id: str, record: JobRecord, *, ttl_s: int) -> JobRecord | None:
        """Write ``record`` unless the job has one; the one it had, or None."""
        old = await self.redis.set(gateway_job_key(job_id), record.model_dump_json(), ex=ttl_s, nx=True, get=True)
        return JobRecord.model_validate_json(old) if old else None

    async def get(self, job_id: str) -> JobRecord | None:
        raw = await self.redis.get(gateway_job_key(job_id))
        return JobRecord.model_validate_json(raw) if raw else None


class ModelsSeen:
    """When each model was last served by a live worker, shared by the replicas."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    async def last_seen(self, model: str) -> float | None:
        seen = await self.redis.hget(MODELS_SEEN_KEY, model)
        return None if seen is None else float(seen)

    async def remember(self, seen: Mapping[str, float]) -> None:
        await self.redis.hset(MODELS_SEEN_KEY, mapping=dict(seen))


# ---------------------------------------------------------------------- files
class FileRecords:
    """Each file's object as JSON, and the per-tenant index by creation."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    async def add(self, file_id: str, tenant: str, record: str, *, created_ms: int) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(file_key(file_id), record)
            pipe.zadd(files_index_key(tenant), {file_id: created_ms})
            await pipe.execute()

    async def get(self, file_id: str) -> bytes | None:
        return await self.redis.get(file_key(file_id))

    async def get_many(self, file_ids: Sequence[str]) -> list[bytes | None]:
        return await self.redis.mget([file_key(file_id) for file_id in file_ids])

    async def rank(self, tenant: str, file_id: str, *, newest_first: bool) -> int | None:
        """The file's place in the tenant's index; None when it is not there."""
        index = files_index_key(tenant)
        return await (self.redis.zrevrank if newest_first else self.redis.zrank)(index, file_id)

    async def page(self, tenant: str, start: int, count: int, *, newest_first: bool) -> list[str]:
        """``count`` file ids of the tenant's index from place ``start``."""
        ids = await self.redis.zrange(files_index_key(tenant), start, start + count - 1, desc=newest_first)
        return [i.decode() for i in ids]

    async def remove(self, file_id: str, tenant: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(file_key(file_id))
            pipe.zrem(files_index_key(tenant), file_id)
            await pipe.execute()


# ---------------------------------------------------------------------- batches
def _encode(fields: Mapping[str, Any]) -> dict[str, str]:
    return {name: json.dumps(value.model_dump(mode="json") if isinstance(value, BaseModel) else value)
            for name, value in fields.items()}


# KEYS[1] the batch; ARGV[1] n, ARGV[2..n+1] the statuses (JSON) it may leave, then field, value, ...
_TRANSITION = """
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return -1 end
local n = tonumber(ARGV[1])
for i = 2, n + 1 do
  if ARGV[i] == current then
    redis.call('HSET', KEYS[1], unpack(ARGV, n + 2))
    return 1
  end
end
return 0
"""
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class BatchRecords:
    """Each batch as a hash of JSON values (so that a driver's progress and a cancel from another
    replica write different fields), the per-tenant index, the set of unfinished batches, and the
    lease that says which gateway drives a batch."""

    def __init__(self, redis: Redis, *, lease_ms: int) -> None:
        self.redis = redis
        self.lease_ms = lease_ms
        self._transition = redis.register_script(_TRANSITION)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)

    async def add(self, batch_id: str, tenant: str, fields: Mapping[str, Any], *, created_ms: int) -> None:
        """A new batch, listed in its tenant's index and among the unfinished ones."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(batch_key(batch_id), mapping=_encode(fields))
            pipe.zadd(batches_index_key(tenant), {batch_id: created_ms})
            pipe.sadd(ACTIVE_BATCHES_KEY, batch_id)
            await pipe.execute()

    async def get(self, batch_id: str) -> dict[str, Any]:
        """The batch's fields, decoded; empty when there is no such batch."""
        raw = await self.redis.hgetall(batch_key(batch_id))
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    async def get_field(self, batch_id: str, name: str) -> Any | None:
        raw = await self.redis.hget(batch_key(batch_id), name)
        return json.loads(raw) if raw else None

    async def rank(self, tenant: str, batch_id: str) -> int | None:
        """The batch's place in the tenant's index, newest first; None when it is not there."""
        return await self.redis.zrevrank(batches_index_key(tenant), batch_id)

    async def page(self, tenant: str, start: int, stop: int) -> list[str]:
        """The batch ids at places ``start``..``stop`` (inclusive) of the tenant's index, newest first."""
        return [i.decode() for i in await self.redis.zrange(batches_index_key(tenant), start, stop, desc=True)]

    async def update(self, batch_id: str, fields: Mapping[str, Any]) -> None:
        await self.redis.hset(batch_key(batch_id), mapping=_encode(fields))

    async def transition(self, batch_id: str, leaving: Iterable[str], fields: Mapping[str, Any]) -> bool:
        """Write ``fields`` if the batch's status is one of ``leaving`` (checked in the same script)."""
        statuses = [json.dumps(s) for s in leaving]
        args: list[str | int] = [len(statuses), *statuses]
        for name, value in _encode(fields).items():
            args += [name, value]
        return await self._transition(keys=[batch_key(batch_id)], args=args) == 1

    async def active_ids(self) -> list[str]:
        return sorted(i.decode() for i in await self.redis.smembers(ACTIVE_BATCHES_KEY))

    async def retire(self, batch_id: str) -> None:
        await self.redis.srem(ACTIVE_BATCHES_KEY, batch_id)

    async def acquire(self, batch_id: str, token: str) -> bool:
        return bool(await self.redis.set(batch_lease_key(batch_id), token, px=self.lease_ms, nx=True))

    async def renew(self, batch_id: str, token: str) -> bool:
        return await self._renew(keys=[batch_lease_key(batch_id)], args=[token, self.lease_ms]) == 1

    async def release(self, batch_id: str, token: str) -> None:
        await self._release(keys=[batch_lease_key(batch_id)], args=[token])
