"""The gateway's own records in Redis: every key name they use and every Redis command on them.

================================  ======  ===========================================================
``slotq:gateway:job:{<id>}``      STRING  a job the gateway created (:class:`JobRecord`, JSON), kept as long
                                          as its result
``slotq:gateway:models``          HASH    served model name -> unix time it was last seen live
``slotq:gateway:file:{<id>}``     STRING  a Batch API file's object and tenant (JSON)
``slotq:gateway:files[:<t>]``     ZSET    file id -> created (ms), per tenant (the default tenant's has no suffix)
``slotq:gateway:file-bytes:<t>``  STRING  bytes of the tenant's files (the cap on them; their count is the ZSET's)
``slotq:gateway:file-expiry``     ZSET    file id -> expires_at (unix s), for the sweep
``slotq:gateway:batch:{<id>}``    HASH    a batch: one JSON value per field of its object (plus queue, tenant)
``slotq:gateway:batches[:<t>]``   ZSET    batch id -> created (ms), per tenant (the default tenant's has no suffix)
``slotq:gateway:batches-active``  SET     batches not finished yet (scanned for expired leases); not under
                                          ``batches:``, where the tenants' indexes are (a tenant may be named
                                          ``active``). Gateways before it used ``slotq:gateway:batches:active``:
                                          a set there is moved into it (:meth:`BatchRecords.active_ids`)
``slotq:gateway:batch-lease:{id}``STRING  the token of the gateway driving the batch, with a TTL
``{W}:endpoint:<id>``             STRING  a webhook endpoint's object, secret and tenant (JSON);
                                          ``{W}`` is ``{slotq:gateway:webhooks}``
``{W}:endpoints:<tenant>``        ZSET    endpoint id -> created (ms)
``{W}:event:<evt id>``            STRING  an emitted event (so that emitting it again adds nothing), with a TTL
``{W}:delivery:<wh id>``          STRING  a pending delivery (JSON: its event's body, attempts so far), with a TTL
``{W}:due``                       ZSET    ``<endpoint id>/<wh id>`` -> when it is next attempted (ms; while
                                          claimed, when the claim's lease ends)
``{W}:attempts:<endpoint id>``    LIST    the endpoint's last 100 attempts (JSON), newest first
``{W}:recent``                    LIST    every endpoint's last 100 attempts, for the dashboard
``{W}:responses-watched``         ZSET    background responses' job ids -> when a gateway next looks whether
                                          the job ended (ms), to emit its ``response.*`` event
================================  ======  ===========================================================

**On a Redis Cluster** a script's keys must share a slot. A file's record, its tenant's index and
bytes and the expiry index are written by one script (the tenant's caps are checked in the step
that adds the file, and only the call that deletes a record takes its bytes off), and a batch is
listed in the same step that creates it; so every file key shares the hash tag
``{slotq:gateway:files}`` and every batch key but the lease shares ``{slotq:gateway:batches}``
(:class:`FileKeys`, :class:`BatchKeys`): ``{slotq:gateway:files}:file:<id>``, ``...:index[:<t>]``,
``...:bytes:<t>``, ``...:expiry``; ``{slotq:gateway:batches}:batch:<id>``, ``...:index[:<t>]``,
``...:active``. Two slots hold them: files and batches are few, and each request touches a handful of
keys. The job records, the models seen and the batch leases are one key per command and keep their
names. On a single Redis every name is the one in the table. The webhooks' keys are newer and have
no older names to keep: they share ``{slotq:gateway:webhooks}`` on both (:class:`WebhookKeys`).

Why here and not in :mod:`slotq.jobs.protocol`: the protocol is the contract between processes
that read what another kind of process wrote (producers, workers, the CLI, the gateway as a
producer). These records are written and read by gateway replicas only, and their shapes follow
the OpenAI API the gateway serves; keeping them in one gateway module puts every gateway key in
one place without making every producer and worker carry them. The objects' fields are the
business of the modules that own them (:mod:`~slotq.jobs.gateway.files`,
:mod:`~slotq.jobs.gateway.batches`); this module stores them. Per-object keys that are not in a
shared slot put the id in braces (one Redis Cluster slot), as the protocol's keys do.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from pydantic import BaseModel
from redis.asyncio import Redis

from slotq.jobs.protocol.connection import is_cluster
from slotq.jobs.protocol.keys import DEFAULT_TENANT
from slotq.jobs.protocol.replies import reply

MODELS_SEEN_KEY = "slotq:gateway:models"


def gateway_job_key(job_id: str) -> str:
    """The gateway's record of a job (not the queue's job record, :func:`slotq.jobs.protocol.keys.job_record_key`)."""
    return f"slotq:gateway:job:{{{job_id}}}"


def _per_tenant(index: str, tenant: str) -> str:
    """A tenant's index: the default tenant's keeps the key it had before tenants."""
    return index if tenant == DEFAULT_TENANT else f"{index}:{tenant}"


@dataclass(frozen=True)
class FileKeys:
    """The keys of the Batch API's files; ``clustered``: all in the slot of ``{slotq:gateway:files}``
    (see the module)."""

    clustered: bool = False

    def file(self, file_id: str) -> str:
        return f"{{slotq:gateway:files}}:file:{file_id}" if self.clustered else f"slotq:gateway:file:{{{file_id}}}"

    def index(self, tenant: str) -> str:
        return _per_tenant("{slotq:gateway:files}:index" if self.clustered else "slotq:gateway:files", tenant)

    def bytes(self, tenant: str) -> str:
        return f"{{slotq:gateway:files}}:bytes:{tenant}" if self.clustered else f"slotq:gateway:file-bytes:{tenant}"

    @property
    def expiry(self) -> str:
        """Not under ``files:``, where the tenants' indexes are."""
        return "{slotq:gateway:files}:expiry" if self.clustered else "slotq:gateway:file-expiry"


@dataclass(frozen=True)
class BatchKeys:
    """The keys of the Batch API's batches; ``clustered``: all but the leases in the slot of
    ``{slotq:gateway:batches}`` (see the module)."""

    clustered: bool = False

    def batch(self, batch_id: str) -> str:
        if self.clustered:
            return f"{{slotq:gateway:batches}}:batch:{batch_id}"
        return f"slotq:gateway:batch:{{{batch_id}}}"

    def index(self, tenant: str) -> str:
        return _per_tenant("{slotq:gateway:batches}:index" if self.clustered else "slotq:gateway:batches", tenant)

    @property
    def active(self) -> str:
        """Not under ``batches:``, where the tenants' indexes are: a tenant named ``active`` has its own."""
        return "{slotq:gateway:batches}:active" if self.clustered else "slotq:gateway:batches-active"

    @property
    def former_active(self) -> str | None:
        """Where gateways before :attr:`active` kept the unfinished batches (on a single Redis; a
        cluster's names never collided), which is also the index of a tenant named ``active``."""
        return None if self.clustered else "slotq:gateway:batches:active"

    @staticmethod
    def lease(batch_id: str) -> str:
        """One key per command: its own slot, the same name on both."""
        return f"slotq:gateway:batch-lease:{{{batch_id}}}"


# ---------------------------------------------------------------------- jobs and models
class JobRecord(BaseModel):
    """What a gateway remembers of a job it created, so that any replica finds it again by id."""

    queue: str
    model: str
    kind: Literal["chat", "text", "embedding", "rerank"]
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
        # redis-py types hget's reply as str; this client (no decode_responses) gets bytes
        seen = await cast("Awaitable[bytes | None]", self.redis.hget(MODELS_SEEN_KEY, model))
        return None if seen is None else float(seen)

    async def remember(self, seen: Mapping[str, float]) -> None:
        await reply(self.redis.hset(MODELS_SEEN_KEY, mapping=dict(seen)))


# ---------------------------------------------------------------------- files
# KEYS: the file, the tenant's index, the tenant's bytes, the expiry index.
# ARGV: id, record, created (ms), size, expires_at ('' = never), max files and max bytes (-1 = unchecked).
# -> 1 added, -1 the tenant keeps max files already, -2 its bytes would pass max bytes. Recording a
# file again (a batch's output after its driver was taken over) replaces it and counts the difference.
_ADD_FILE = """
local old = redis.call('GET', KEYS[1])
local grows = tonumber(ARGV[4])
if old then grows = grows - cjson.decode(old)['bytes'] end
local max_files = tonumber(ARGV[6])
if max_files >= 0 then
  if not old and redis.call('ZCARD', KEYS[2]) >= max_files then return -1 end
  if tonumber(redis.call('GET', KEYS[3]) or '0') + grows > tonumber(ARGV[7]) then return -2 end
end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], 'NX', ARGV[3], ARGV[1])
redis.call('INCRBY', KEYS[3], grows)
if ARGV[5] ~= '' then redis.call('ZADD', KEYS[4], ARGV[5], ARGV[1]) end
return 1
"""
# Same KEYS; ARGV: id, size. Only the call that deletes the record takes its bytes off (two
# replicas sweeping, or a delete racing the sweep, count it once); files recorded before bytes
# were counted could take the total below zero, so it stops at zero.
_REMOVE_FILE = """
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
if redis.call('DEL', KEYS[1]) == 0 then return 0 end
if redis.call('DECRBY', KEYS[3], ARGV[2]) < 0 then redis.call('SET', KEYS[3], 0) end
return 1
"""


class FileQuotaExceeded(Exception):
    """The tenant's files are at SLOTQ_GATEWAY_TENANT_MAX_FILES (``what="files"``) or would pass
    SLOTQ_GATEWAY_TENANT_MAX_FILES_MB (``what="bytes"``)."""

    def __init__(self, what: Literal["files", "bytes"]) -> None:
        super().__init__(what)
        self.what = what


class FileRecords:
    """Each file's object as JSON, the per-tenant index by creation (its size is the tenant's file
    count), the tenant's bytes, and the index by expiry."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.keys = FileKeys(clustered=is_cluster(redis))
        self._add = redis.register_script(_ADD_FILE)
        self._remove = redis.register_script(_REMOVE_FILE)

    def _keys(self, file_id: str, tenant: str) -> list[str]:
        return [self.keys.file(file_id), self.keys.index(tenant), self.keys.bytes(tenant), self.keys.expiry]

    async def add(self, file_id: str, tenant: str, record: str, *, created_ms: int, size: int,
                  expires_at: int | None, caps: tuple[int, int] | None) -> None:
        """Record the file; with ``caps`` (max files, max bytes), only if the tenant stays within
        them, checked in the same script that adds it (FileQuotaExceeded otherwise)."""
        max_files, max_bytes = caps or (-1, -1)
        added = await self._add(keys=self._keys(file_id, tenant), args=[
            file_id, record, created_ms, size, "" if expires_at is None else expires_at, max_files, max_bytes])
        if added == -1:
            raise FileQuotaExceeded("files")
        if added == -2:
            raise FileQuotaExceeded("bytes")

    async def usage(self, tenant: str) -> tuple[int, int]:
        """The tenant's files and their bytes."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zcard(self.keys.index(tenant))
            pipe.get(self.keys.bytes(tenant))
            count, size = await pipe.execute()
        return int(count), int(size or 0)

    async def get(self, file_id: str) -> bytes | None:
        record: bytes | None = await self.redis.get(self.keys.file(file_id))
        return record

    async def get_many(self, file_ids: Sequence[str]) -> list[bytes | None]:
        """One MGET (on a cluster too: the records share a slot)."""
        records: list[bytes | None] = await self.redis.mget([self.keys.file(file_id) for file_id in file_ids])
        return records

    async def rank(self, tenant: str, file_id: str, *, newest_first: bool) -> int | None:
        """The file's place in the tenant's index; None when it is not there."""
        index = self.keys.index(tenant)
        place: int | None = await (self.redis.zrevrank if newest_first else self.redis.zrank)(index, file_id)
        return place

    async def page(self, tenant: str, start: int, count: int, *, newest_first: bool) -> list[str]:
        """``count`` file ids of the tenant's index from place ``start``."""
        ids = await self.redis.zrange(self.keys.index(tenant), start, start + count - 1, desc=newest_first)
        return [i.decode() for i in ids]

    async def expired(self, now: float, count: int) -> list[str]:
        """Up to ``count`` ids of files whose expires_at has passed, oldest first."""
        ids = await self.redis.zrangebyscore(self.keys.expiry, "-inf", now, start=0, num=count)
        return [i.decode() for i in ids]

    async def forget_expiry(self, file_id: str) -> None:
        """For an id in the expiry index whose record is gone."""
        await self.redis.zrem(self.keys.expiry, file_id)

    async def remove(self, file_id: str, tenant: str, size: int) -> bool:
        """Forget the file; False when another call did first."""
        return bool(await self._remove(keys=self._keys(file_id, tenant), args=[file_id, size]) == 1)


# ---------------------------------------------------------------------- batches
def _encode(fields: Mapping[str, Any]) -> dict[str, str]:
    return {name: json.dumps(value.model_dump(mode="json") if isinstance(value, BaseModel) else value)
            for name, value in fields.items()}


def _encoded_pairs(fields: Mapping[str, Any]) -> list[str]:
    """``fields`` encoded as a script's trailing ARGV: field, value, ..."""
    return [item for pair in _encode(fields).items() for item in pair]


# KEYS: the batch, the tenant's index, the unfinished batches; ARGV: id, created (ms), then field, value, ...
_ADD_BATCH = """
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[1])
"""
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
# KEYS: the unfinished batches, where older gateways kept them. A set at the older name (a tenant
# named ``active`` keeps a ZSET there) is moved into the first, so a batch an older gateway started
# during a rolling upgrade is driven too; then the first's members.
_ACTIVE_IDS = """
if redis.call('TYPE', KEYS[2]).ok == 'set' then
  redis.call('SUNIONSTORE', KEYS[1], KEYS[1], KEYS[2])
  redis.call('DEL', KEYS[2])
end
return redis.call('SMEMBERS', KEYS[1])
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
        self.keys = BatchKeys(clustered=is_cluster(redis))
        self._add = redis.register_script(_ADD_BATCH)
        self._transition = redis.register_script(_TRANSITION)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)
        self._active_ids = redis.register_script(_ACTIVE_IDS)

    async def add(self, batch_id: str, tenant: str, fields: Mapping[str, Any], *, created_ms: int) -> None:
        """A new batch, listed in its tenant's index and among the unfinished ones in the same step
        (after taking over an older gateway's unfinished ones, whose set is a tenant's index now)."""
        if self.keys.index(tenant) == self.keys.former_active:
            await self.active_ids()
        await self._add(keys=[self.keys.batch(batch_id), self.keys.index(tenant), self.keys.active],
                        args=[batch_id, created_ms, *_encoded_pairs(fields)])

    async def get(self, batch_id: str) -> dict[str, Any]:
        """The batch's fields, decoded; empty when there is no such batch."""
        raw = await reply(self.redis.hgetall(self.keys.batch(batch_id)))
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    async def get_field(self, batch_id: str, name: str) -> Any | None:
        # bytes, as above
        raw = await cast("Awaitable[bytes | None]", self.redis.hget(self.keys.batch(batch_id), name))
        return json.loads(raw) if raw else None

    async def rank(self, tenant: str, batch_id: str) -> int | None:
        """The batch's place in the tenant's index, newest first; None when it is not there."""
        place: int | None = await self.redis.zrevrank(self.keys.index(tenant), batch_id)
        return place

    async def page(self, tenant: str, start: int, stop: int) -> list[str]:
        """The batch ids at places ``start``..``stop`` (inclusive) of the tenant's index, newest first."""
        return [i.decode() for i in await self.redis.zrange(self.keys.index(tenant), start, stop, desc=True)]

    async def update(self, batch_id: str, fields: Mapping[str, Any]) -> None:
        await reply(self.redis.hset(self.keys.batch(batch_id), mapping=_encode(fields)))

    async def transition(self, batch_id: str, leaving: Iterable[str], fields: Mapping[str, Any]) -> bool:
        """Write ``fields`` if the batch's status is one of ``leaving`` (checked in the same script)."""
        statuses = [json.dumps(s) for s in leaving]
        return bool(await self._transition(keys=[self.keys.batch(batch_id)],
                                           args=[len(statuses), *statuses, *_encoded_pairs(fields)]) == 1)

    async def active_ids(self) -> list[str]:
        """The unfinished batches (taking over those an older gateway listed under the former name)."""
        former = self.keys.former_active
        ids = (await self._active_ids(keys=[self.keys.active, former]) if former is not None
               else await reply(self.redis.smembers(self.keys.active)))
        return sorted(i.decode() for i in ids)

    async def retire(self, batch_id: str) -> None:
        await reply(self.redis.srem(self.keys.active, batch_id))

    async def acquire(self, batch_id: str, token: str) -> bool:
        return bool(await self.redis.set(self.keys.lease(batch_id), token, px=self.lease_ms, nx=True))

    async def renew(self, batch_id: str, token: str) -> bool:
        return bool(await self._renew(keys=[self.keys.lease(batch_id)], args=[token, self.lease_ms]) == 1)

    async def release(self, batch_id: str, token: str) -> None:
        await self._release(keys=[self.keys.lease(batch_id)], args=[token])


# ---------------------------------------------------------------------- webhooks
WEBHOOKS_TAG = "{slotq:gateway:webhooks}"
ATTEMPTS_KEPT = 100          # recent attempts listed per endpoint


@dataclass(frozen=True)
class WebhookKeys:
    """The webhooks' keys, all in the slot of ``{slotq:gateway:webhooks}`` on a single Redis as on a
    cluster (new keys, no older names to keep): the scripts that emit an event and that claim and
    finish deliveries touch several of them at once."""

    @staticmethod
    def endpoint(endpoint_id: str) -> str:
        return f"{WEBHOOKS_TAG}:endpoint:{endpoint_id}"

    @staticmethod
    def index(tenant: str) -> str:
        return f"{WEBHOOKS_TAG}:endpoints:{tenant}"

    @staticmethod
    def event(event_id: str) -> str:
        return f"{WEBHOOKS_TAG}:event:{event_id}"

    @staticmethod
    def delivery(delivery_id: str) -> str:
        return f"{WEBHOOKS_TAG}:delivery:{delivery_id}"

    @staticmethod
    def attempts(endpoint_id: str) -> str:
        return f"{WEBHOOKS_TAG}:attempts:{endpoint_id}"

    due = f"{WEBHOOKS_TAG}:due"
    recent = f"{WEBHOOKS_TAG}:recent"
    watched = f"{WEBHOOKS_TAG}:responses-watched"


def due_member(endpoint_id: str, delivery_id: str) -> str:
    """A pending delivery in the due set: its endpoint first, so that the claim can pass over the
    deliveries of an endpoint already at its concurrency without reading their records."""
    return f"{endpoint_id}/{delivery_id}"


# KEYS: the event marker, the due set, then one delivery key per endpoint.
# ARGV: keep (s), due (ms), then member, record for each delivery key.
# -> 0 when the event was emitted before (its marker is set): nothing is added twice.
_EMIT = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then return 0 end
for i = 3, #KEYS do
  redis.call('SET', KEYS[i], ARGV[2 * i - 2], 'EX', ARGV[1])
  redis.call('ZADD', KEYS[2], ARGV[2], ARGV[2 * i - 3])
end
return 1
"""
# KEYS: the due set. ARGV: now (ms), lease until (ms), how many to claim, how many to look at, an
# endpoint's room (deliveries at once), then endpoint, room for the endpoints this gateway has
# deliveries in flight to. A claimed member's due time becomes its lease's end: no other gateway
# sees it before then, and that time is the claim's token (finish checks it). Due members of an
# endpoint with no room left are passed over; when they filled the whole look (others may wait
# behind them), they move to ``now``, behind every delivery that fell due before: still due, and
# a dead endpoint's backlog never sits in front of the others' deliveries.
_CLAIM = """
local room = {}
for i = 6, #ARGV, 2 do room[ARGV[i]] = tonumber(ARGV[i + 1]) end
local claimed, passed = {}, {}
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[4]))
for _, member in ipairs(due) do
  if #claimed >= tonumber(ARGV[3]) then break end
  local endpoint = string.match(member, '^([^/]+)/')
  local left = room[endpoint] or tonumber(ARGV[5])
  if left <= 0 then
    passed[#passed + 1] = member
  else
    room[endpoint] = left - 1
    redis.call('ZADD', KEYS[1], ARGV[2], member)
    claimed[#claimed + 1] = member
  end
end
if #due == tonumber(ARGV[4]) and #claimed < tonumber(ARGV[3]) then
  for _, member in ipairs(passed) do redis.call('ZADD', KEYS[1], ARGV[1], member) end
end
return claimed
"""
# KEYS: the watched responses. ARGV: now (ms), look again at (ms), how many. The members due now,
# moved to the next look: another gateway passes over them until then, and one that dies while
# looking leaves them to be looked at again.
_CLAIM_WATCHED = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
for _, member in ipairs(due) do redis.call('ZADD', KEYS[1], ARGV[2], member) end
return due
"""
# KEYS: the due set, the delivery, the endpoint's attempts, every tenant's recent attempts. ARGV:
# member, the claim's lease end (ms), next due (ms, '' = no more attempts), the attempt (JSON), the
# delivery's record, keep (s), attempts kept. The attempt is always recorded (it happened); the
# delivery moves on only while this gateway's claim holds (0 otherwise: its lease ran out and
# another gateway may have it).
_FINISH = """
redis.call('LPUSH', KEYS[3], ARGV[4])
redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[7]) - 1)
redis.call('EXPIRE', KEYS[3], ARGV[6])
redis.call('LPUSH', KEYS[4], ARGV[4])
redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[7]) - 1)
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) ~= tonumber(ARGV[2]) then return 0 end
if ARGV[3] == '' then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('DEL', KEYS[2])
else
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
  redis.call('SET', KEYS[2], ARGV[5], 'KEEPTTL')
end
return 1
"""


@dataclass(frozen=True)
class Claim:
    """A pending delivery this gateway may attempt until ``lease_until_ms``."""

    endpoint_id: str
    delivery_id: str
    lease_until_ms: int


class WebhookRecords:
    """Endpoints (a JSON string each, indexed per tenant), emitted events' markers (so an event
    emitted twice is delivered once), pending deliveries (a JSON string each, and the due set that
    says when each is attempted next), and each endpoint's recent attempts (a capped list)."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.keys = WebhookKeys()
        self._emit = redis.register_script(_EMIT)
        self._claim = redis.register_script(_CLAIM)
        self._finish = redis.register_script(_FINISH)
        self._claim_watched = redis.register_script(_CLAIM_WATCHED)

    # ------------------------------------------------------------------ endpoints
    async def put_endpoint(self, endpoint_id: str, tenant: str, record: str, *, created_ms: int | None) -> None:
        """Write the endpoint; with ``created_ms``, a new one, listed in its tenant's index."""
        async with self.redis.pipeline(transaction=not is_cluster(self.redis)) as pipe:
            pipe.set(self.keys.endpoint(endpoint_id), record)
            if created_ms is not None:
                pipe.zadd(self.keys.index(tenant), {endpoint_id: created_ms})
            await pipe.execute()

    async def get_endpoint(self, endpoint_id: str) -> bytes | None:
        record: bytes | None = await self.redis.get(self.keys.endpoint(endpoint_id))
        return record

    async def endpoint_ids(self, tenant: str) -> list[str]:
        """The tenant's endpoints, newest first."""
        return [i.decode() for i in await self.redis.zrange(self.keys.index(tenant), 0, -1, desc=True)]

    async def get_endpoints(self, endpoint_ids: Sequence[str]) -> list[bytes | None]:
        if not endpoint_ids:
            return []
        records: list[bytes | None] = await self.redis.mget([self.keys.endpoint(i) for i in endpoint_ids])
        return records

    async def remove_endpoint(self, endpoint_id: str, tenant: str) -> None:
        """Its pending deliveries stay in the due set; the delivery loop drops each when it finds the
        endpoint gone."""
        async with self.redis.pipeline(transaction=not is_cluster(self.redis)) as pipe:
            pipe.zrem(self.keys.index(tenant), endpoint_id)
            pipe.delete(self.keys.endpoint(endpoint_id), self.keys.attempts(endpoint_id))
            await pipe.execute()

    # ------------------------------------------------------------------ events and deliveries
    async def emit(self, event_id: str, deliveries: Mapping[tuple[str, str], str], *, due_ms: int,
                   keep_s: int) -> bool:
        """Add a delivery per (endpoint id, delivery id) -> record, unless the event was emitted before."""
        members = list(deliveries)
        keys = [self.keys.event(event_id), self.keys.due, *(self.keys.delivery(d) for _, d in members)]
        args: list[str | int] = [keep_s, due_ms]
        for (endpoint_id, delivery_id), record in deliveries.items():
            args += [due_member(endpoint_id, delivery_id), record]
        return bool(await self._emit(keys=keys, args=args) == 1)

    async def claim(self, *, now_ms: int, lease_ms: int, count: int, endpoint_room: int,
                    rooms: Mapping[str, int]) -> list[Claim]:
        """Up to ``count`` due deliveries, leased to this gateway for ``lease_ms``: at most
        ``endpoint_room`` per endpoint, or ``rooms[endpoint]`` for those listed."""
        lease_until = now_ms + lease_ms
        members = await self._claim(keys=[self.keys.due], args=[
            now_ms, lease_until, count, count * 4, endpoint_room,
            *(item for pair in rooms.items() for item in pair)])
        claims = []
        for member in members:
            endpoint_id, _, delivery_id = member.decode().partition("/")
            claims.append(Claim(endpoint_id, delivery_id, lease_until))
        return claims

    async def get_delivery(self, delivery_id: str) -> bytes | None:
        record: bytes | None = await self.redis.get(self.keys.delivery(delivery_id))
        return record

    async def finish(self, claim: Claim, *, attempt: str, next_due_ms: int | None, record: str,
                     keep_s: int) -> bool:
        """Record the attempt, and retire the delivery (``next_due_ms`` None) or schedule it again;
        False when this gateway's lease on it had run out (the delivery was left as it was)."""
        keys = [self.keys.due, self.keys.delivery(claim.delivery_id), self.keys.attempts(claim.endpoint_id),
                self.keys.recent]
        return bool(await self._finish(keys=keys, args=[
            due_member(claim.endpoint_id, claim.delivery_id), claim.lease_until_ms,
            "" if next_due_ms is None else next_due_ms, attempt, record, keep_s, ATTEMPTS_KEPT]) == 1)

    async def drop(self, claim: Claim) -> None:
        """A delivery whose endpoint or record is gone."""
        await reply(self.redis.zrem(self.keys.due, due_member(claim.endpoint_id, claim.delivery_id)))
        await self.redis.delete(self.keys.delivery(claim.delivery_id))

    async def attempts(self, endpoint_id: str | None, limit: int) -> list[bytes]:
        """The endpoint's most recent attempts (every tenant's with None: the fleet view), newest first."""
        key = self.keys.recent if endpoint_id is None else self.keys.attempts(endpoint_id)
        return list(await reply(self.redis.lrange(key, 0, limit - 1)))

    # ------------------------------------------------------------------ background responses watched
    async def watch(self, job_id: str, *, look_at_ms: int) -> None:
        """Look at the job at ``look_at_ms`` (and after, until :meth:`unwatch`)."""
        await reply(self.redis.zadd(self.keys.watched, {job_id: look_at_ms}))

    async def claim_watched(self, *, now_ms: int, next_look_ms: int, count: int) -> list[str]:
        """Up to ``count`` watched jobs due a look, each not due again before ``next_look_ms``."""
        return [m.decode() for m in await self._claim_watched(keys=[self.keys.watched],
                                                              args=[now_ms, next_look_ms, count])]

    async def unwatch(self, job_ids: Sequence[str]) -> None:
        if job_ids:
            await reply(self.redis.zrem(self.keys.watched, *job_ids))
