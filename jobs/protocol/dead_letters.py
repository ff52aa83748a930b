"""Dead letters: jobs that exhausted their tries or could not be read, kept for an operator.

Each record is a hash ``slotq:dlq:{job_id}`` (the original payload, the last error, whose code is
the *reason*, attempts and how many of them were interruptions, the worker deaths that ended it,
timestamps) indexed by the sorted set ``slotq:dlq``, with the records counted per reason in
``slotq:dlq:reasons`` (so ``slotq status`` reads them in O(reasons)). Records do not expire: an
operator lists, inspects, requeues or purges them (``slotq dlq ...``). On a Redis Cluster the three
are named to share one slot (:class:`~slotq.jobs.protocol.keys.DeadLetterKeys`), so recording and
removing a dead letter stay one atomic script there too.

Reasons: ``killed_its_worker`` (its attempts kept dying with their worker before any progress,
``SLOTQ_MAX_WORKER_DEATHS``), ``tries_exhausted``, ``interruptions_exhausted``, ``poison_payload``,
``invalid_payload``, ``unsupported_payload_version``, or the code of the retryable error its last
try ended with.
"""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import BaseModel, Field, computed_field
from redis.asyncio import Redis

from slotq.jobs.protocol.connection import is_cluster
from slotq.jobs.protocol.keys import DeadLetterKeys
from slotq.jobs.protocol.replies import reply
from slotq.jobs.protocol.wire import ErrorInfo

KILLED_ITS_WORKER = "killed_its_worker"

_UNCOUNT = """
local function uncount(reasons, reason)
  if reason and redis.call('HINCRBY', reasons, reason, -1) <= 0 then redis.call('HDEL', reasons, reason) end
end
"""

# KEYS: the record, the index, the reasons; ARGV: job id, now, reason, then the record's fields and values
# A job dead-lettered again (requeued, or two attempts of one job that both saw the end) is counted once.
_RECORD = _UNCOUNT + """
uncount(KEYS[3], redis.call('HGET', KEYS[1], 'reason'))
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
"""

# KEYS: the record, the index, the reasons; ARGV: job id. Returns 1 removed, 0 no such record.
_REMOVE = _UNCOUNT + """
uncount(KEYS[3], redis.call('HGET', KEYS[1], 'reason'))
redis.call('ZREM', KEYS[2], ARGV[1])
return redis.call('DEL', KEYS[1])
"""


class DeadLetter(BaseModel):
    job_id: str
    queue: str | None = Field(None, description="the queue it ran on (requeued there); None = the caller's queue")
    error: ErrorInfo
    attempts: int
    interruptions: int = Field(0, description="of the attempts, those lost after delivering new tokens (no try spent)")
    worker_deaths: int = Field(0, description="the attempts in a row that ended with their worker dying before any "
                                              "progress (reason killed_its_worker)")
    enqueued_at: float | None
    dead_at: float
    payload: dict[str, Any] | None = None

    @computed_field  # type: ignore[prop-decorator]   # pydantic's documented use on a property
    @property
    def reason(self) -> str:
        """Why it was dead-lettered: its error's code (``killed_its_worker``, ``tries_exhausted``, ...)."""
        return self.error.code


def _keys(redis: Redis) -> DeadLetterKeys:
    return DeadLetterKeys(clustered=is_cluster(redis))


async def record(redis: Redis, job_id: str, payload: Any, error: ErrorInfo, attempts: int,
                 enqueued_at: float | None, queue: str | None = None, interruptions: int = 0,
                 worker_deaths: int = 0) -> None:
    """Keep the job for an operator, its reason being ``error.code``."""
    now = time.time()
    fields: dict[str, str | int | float] = {
        "job_id": job_id,
        "queue": queue or "",
        "reason": error.code,
        "error": error.model_dump_json(),
        "attempts": attempts,
        "interruptions": interruptions,
        "worker_deaths": worker_deaths,
        "enqueued_at": "" if enqueued_at is None else enqueued_at,
        "dead_at": now,
        "payload": json.dumps(payload if isinstance(payload, dict) else None),
    }
    keys = _keys(redis)
    await redis.register_script(_RECORD)(
        keys=[keys.record(job_id), keys.index, keys.reasons],
        args=[job_id, now, error.code, *(x for item in fields.items() for x in item)])


async def get(redis: Redis, job_id: str) -> DeadLetter | None:
    raw = await reply(redis.hgetall(_keys(redis).record(job_id)))
    if not raw:
        return None
    f = {k.decode(): v.decode() for k, v in raw.items()}
    return DeadLetter(
        job_id=f["job_id"],
        queue=f.get("queue") or None,
        error=ErrorInfo.model_validate_json(f["error"]),
        attempts=int(f["attempts"]),
        interruptions=int(f.get("interruptions", 0)),
        worker_deaths=int(f.get("worker_deaths", 0)),
        enqueued_at=float(f["enqueued_at"]) if f.get("enqueued_at") else None,
        dead_at=float(f["dead_at"]),
        payload=json.loads(f["payload"]) if f.get("payload") else None,
    )


async def list_ids(redis: Redis, limit: int = 1000) -> list[str]:
    return [x.decode() for x in await redis.zrange(_keys(redis).index, 0, limit - 1)]


async def count(redis: Redis) -> int:
    return int(await redis.zcard(_keys(redis).index))


async def by_reason(redis: Redis) -> dict[str, int]:
    """How many dead letters are kept per reason (records written before reasons were counted are not)."""
    raw = await reply(redis.hgetall(_keys(redis).reasons))
    return {reason.decode(): int(n) for reason, n in sorted(raw.items())}


async def remove(redis: Redis, job_id: str) -> bool:
    keys = _keys(redis)
    return bool(await redis.register_script(_REMOVE)(keys=[keys.record(job_id), keys.index, keys.reasons],
                                                     args=[job_id]))
