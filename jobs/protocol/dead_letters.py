"""Dead letters: jobs that exhausted their tries or could not be read, kept for an operator.

Each record is a hash ``slotq:dlq:{job_id}`` (the original payload, the last error, attempts and
how many of them were interruptions, timestamps) indexed by the sorted set ``slotq:dlq``. Records
do not expire: an operator lists, inspects, requeues or purges them (``slotq dlq ...``).
"""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import BaseModel, Field
from redis.asyncio import Redis

from slotq.engine import ErrorInfo
from slotq.jobs.protocol.keys import DEAD_LETTER_INDEX, dead_letter_key
from slotq.jobs.protocol.replies import reply


class DeadLetter(BaseModel):
    job_id: str
    queue: str | None = Field(None, description="the queue it ran on (requeued there); None = the caller's queue")
    error: ErrorInfo
    attempts: int
    interruptions: int = Field(0, description="of the attempts, those lost after delivering new tokens (no try spent)")
    enqueued_at: float | None
    dead_at: float
    payload: dict[str, Any] | None = None


async def record(redis: Redis, job_id: str, payload: Any, error: ErrorInfo, attempts: int,
                 enqueued_at: float | None, queue: str | None = None, interruptions: int = 0) -> None:
    now = time.time()
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(dead_letter_key(job_id), mapping={
            "job_id": job_id,
            "queue": queue or "",
            "error": error.model_dump_json(),
            "attempts": attempts,
            "interruptions": interruptions,
            "enqueued_at": "" if enqueued_at is None else enqueued_at,
            "dead_at": now,
            "payload": json.dumps(payload if isinstance(payload, dict) else None),
        })
        pipe.zadd(DEAD_LETTER_INDEX, {job_id: now})
        await pipe.execute()


async def get(redis: Redis, job_id: str) -> DeadLetter | None:
    raw = await reply(redis.hgetall(dead_letter_key(job_id)))
    if not raw:
        return None
    f = {k.decode(): v.decode() for k, v in raw.items()}
    return DeadLetter(
        job_id=f["job_id"],
        queue=f.get("queue") or None,
        error=ErrorInfo.model_validate_json(f["error"]),
        attempts=int(f["attempts"]),
        interruptions=int(f.get("interruptions", 0)),
        enqueued_at=float(f["enqueued_at"]) if f.get("enqueued_at") else None,
        dead_at=float(f["dead_at"]),
        payload=json.loads(f["payload"]) if f.get("payload") else None,
    )


async def list_ids(redis: Redis, limit: int = 1000) -> list[str]:
    return [x.decode() for x in await redis.zrange(DEAD_LETTER_INDEX, 0, limit - 1)]


async def count(redis: Redis) -> int:
    return int(await redis.zcard(DEAD_LETTER_INDEX))


async def remove(redis: Redis, job_id: str) -> bool:
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(dead_letter_key(job_id))
        pipe.zrem(DEAD_LETTER_INDEX, job_id)
        deleted, _ = await pipe.execute()
    return bool(deleted)
