"""The worker registry: each live worker's heartbeat, and the fleet as producers see it.

A worker writes its :class:`~slotq.jobs.protocol.schemas.WorkerInfo` into its own hash
``slotq:worker:<id>`` every beat; the hash expires three beats after the last one, so a worker
that died leaves no stale entry for long. The index ``slotq:workers`` (worker id -> time of its
last beat) lets a reader list the fleet in O(workers) without a scan of the keyspace; entries
silent for an hour are pruned by the beats of the others. Readers: the producer client (its
limit checks and ``workers()``), and through it the gateway's routing, ``slotq status`` and the
dashboard.

A worker also holds an entry in its queue's serving record (:class:`QueueMembership`), the one
place that decides which model and kind a queue serves: a worker of another model or kind is
refused there, atomically, before it can claim anything.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from redis.asyncio import Redis

from slotq.jobs.protocol.keys import WORKER_INDEX, QueueKeys, worker_key
from slotq.jobs.protocol.replies import reply
from slotq.jobs.protocol.schemas import JobKind, WorkerInfo
from slotq.jobs.protocol.scripts.layout import ScriptRunner
from slotq.jobs.protocol.scripts.serving import JoinQueue

RECENT_S = 120.0        # the index is read this far back (heartbeats come every few seconds)
INDEX_KEEP_S = 3600     # a worker silent this long leaves the index


async def beat(redis: Redis, worker: WorkerInfo, *, interval_s: float) -> None:
    """Advertise ``worker`` (the fields it was built with, not those derived from them) until three
    beats of ``interval_s`` from now, and note the beat (``worker.updated_at``) in the index."""
    key = worker_key(worker.id)
    declared = worker.model_dump(exclude_unset=True, exclude=set(WorkerInfo.model_computed_fields))
    fields = {name: int(value) if isinstance(value, bool) else ",".join(value) if isinstance(value, list) else value
              for name, value in declared.items()}      # a hash holds strings: a list of names, comma-separated
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hset(key, mapping=fields)
        pipe.expire(key, max(3, int(interval_s * 3)))
        pipe.zadd(WORKER_INDEX, {worker.id: int(worker.updated_at * 1000)})
        pipe.zremrangebyscore(WORKER_INDEX, "-inf", int((worker.updated_at - INDEX_KEEP_S) * 1000))   # long gone
        await pipe.execute()


async def leave(redis: Redis, worker_id: str) -> None:
    """A worker stopping: it is gone from the fleet at once, not when its heartbeat expires."""
    await redis.delete(worker_key(worker_id))
    await redis.zrem(WORKER_INDEX, worker_id)


async def live_workers(redis: Redis) -> list[WorkerInfo]:
    """Every live worker on this Redis (all queues), by id: the index names those heard from in
    the last RECENT_S, and a worker's own hash, still there, says it is alive."""
    ids = await redis.zrangebyscore(WORKER_INDEX, (time.time() - RECENT_S) * 1000, "+inf")
    async with redis.pipeline(transaction=False) as pipe:
        for worker_id in ids:
            pipe.hgetall(worker_key(worker_id.decode()))
        hashes = await pipe.execute()
    workers = [WorkerInfo.model_validate({k.decode(): v.decode() for k, v in raw.items()}) for raw in hashes if raw]
    return sorted(workers, key=lambda w: w.id)


@dataclass(frozen=True)
class QueueServer:
    """A worker serving a queue, and what it serves."""

    worker: str
    kind: JobKind
    model: str
    partitions: int = 1     # SLOTQ_QUEUE_PARTITIONS: how it splits the queue


class QueueMembership:
    """One worker's entry in its queue's serving record (``Q:serving``, :class:`JoinQueue`): the
    model and kind it serves there, renewed with every heartbeat, gone three beats after the last."""

    def __init__(self, redis: Redis, keys: QueueKeys, server: QueueServer) -> None:
        self.redis = redis
        self.keys = keys
        self.server = server
        self._scripts = ScriptRunner(redis)

    async def join(self, *, ttl_s: float) -> QueueServer | None:
        """Join (or stay in) the queue for ``ttl_s`` more; None when done, else the live worker of
        another model, kind or partition count that holds the queue (and this worker is not in it)."""
        other = await self._scripts.run(JoinQueue(
            serving=self.keys.serving, worker=self.server.worker, kind=self.server.kind.value,
            model=self.server.model, ttl_ms=int(ttl_s * 1000), partitions=self.server.partitions))
        if not other:
            return None
        worker, kind, model, partitions = (part.decode() for part in other)
        return QueueServer(worker=worker, kind=JobKind(kind), model=model, partitions=int(partitions))

    async def leave(self) -> None:
        """A worker stopping: the queue is free for another model at once once its last worker left."""
        await reply(self.redis.hdel(self.keys.serving, self.server.worker))
