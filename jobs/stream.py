"""The per-job output stream ``slotq:stream:{job_id}``: writing it in batches, reading it resumably.

Writers coalesce chunks for a few milliseconds and send every job's pending entries in one
pipelined round trip, so Redis traffic grows with time, not with tokens. Readers use plain XREAD
from their last id (no consumer groups): any number of readers, each can drop and resume without
gaps or repeats, and an HTTP gateway can use the entry id as the SSE event id.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from engine import ErrorInfo, FinishReason, Timings, Usage
from jobs.keys import stream_key, write_mark_key
from jobs.queue.scripts import FENCED_XADD
from jobs.schemas import EntryKind, StreamEntry

log = logging.getLogger(__name__)


def encode_entry(entry: StreamEntry) -> dict[str, str]:
    """Flat string fields, readable with redis-cli."""
    fields = {"k": entry.kind.value, "a": str(entry.attempt), "c": str(entry.choice)}
    if entry.kind == EntryKind.CHUNK:
        fields |= {"t": entry.text, "ids": " ".join(map(str, entry.token_ids)), "n": str(entry.n_tokens)}
    if entry.finish_reason is not None:
        fields["fr"] = entry.finish_reason.value
    if entry.usage is not None:
        fields["u"] = entry.usage.model_dump_json()
    if entry.timings is not None:
        fields["tm"] = entry.timings.model_dump_json()
    if entry.error is not None:
        fields["e"] = entry.error.model_dump_json()
    if entry.final:
        fields["f"] = "1"
    return fields


def decode_entry(entry_id: bytes | str, raw: dict) -> StreamEntry:
    f = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v) for k, v in raw.items()}
    ids = f.get("ids", "")
    return StreamEntry(
        id=entry_id.decode() if isinstance(entry_id, bytes) else entry_id,
        kind=EntryKind(f["k"]),
        attempt=int(f.get("a", 1)),
        choice=int(f.get("c", 0)),
        text=f.get("t", ""),
        token_ids=[int(x) for x in ids.split()] if ids else [],
        n_tokens=int(f.get("n", 0)),
        finish_reason=FinishReason(f["fr"]) if "fr" in f else None,
        usage=Usage.model_validate_json(f["u"]) if "u" in f else None,
        timings=Timings.model_validate_json(f["tm"]) if "tm" in f else None,
        error=ErrorInfo.model_validate_json(f["e"]) if "e" in f else None,
        final=f.get("f") == "1",
    )


@dataclass(frozen=True)
class Fence:
    """Write a job's entries only while ``token`` owns the job in the queue's ``owners`` hash."""

    owners_key: str
    token: str


@dataclass
class _Batch:
    id: str
    entries: list[StreamEntry]


class StreamWriter:
    """Buffers entries per job and flushes all jobs together every ``flush_ms``.

    If Redis is unreachable, entries stay buffered (bounded by slots x max_tokens) and are
    written, in order, once it is back; generation does not stop for a Redis blip. A batch that
    was sent is re-sent unchanged, under the same id, until it is acknowledged, and Redis ignores
    an id it has already applied: a write whose reply was lost is never appended twice. With a
    ``fence``, each job's entries are written only while this worker owns the job (one atomic
    script per job); a refused job's entries are dropped and ``on_fenced`` is told.
    """

    def __init__(self, redis: Redis, *, flush_ms: float, maxlen: int, ttl_s: int, fence: Fence | None = None,
                 on_fenced: Callable[[str], None] | None = None) -> None:
        self.redis = redis
        self.flush_s = flush_ms / 1000
        self.maxlen = maxlen
        self.ttl_s = ttl_s
        self.fence = fence
        self.on_fenced = on_fenced
        self._script = redis.register_script(FENCED_XADD)
        self._writer_id = fence.token if fence else uuid.uuid4().hex
        self._batch_numbers = itertools.count()
        self._pending: dict[str, list[StreamEntry]] = {}    # not yet sent
        self._inflight: dict[str, _Batch] = {}             # sent, not yet acknowledged
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self.round_trips = 0
        self.entries_written = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._flush_loop(), name="slotq-stream-writer")

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for _ in range(3):
            if not (self._pending or self._inflight) or not await self.flush():
                break

    def add(self, job_id: str, entry: StreamEntry) -> None:
        """Queue an entry; consecutive chunks of one choice and attempt are merged."""
        entries = self._pending.setdefault(job_id, [])
        last = entries[-1] if entries else None
        if (entry.kind == EntryKind.CHUNK and last is not None and last.kind == EntryKind.CHUNK
                and last.choice == entry.choice and last.attempt == entry.attempt):
            last.text += entry.text
            last.token_ids.extend(entry.token_ids)
            last.n_tokens = entry.n_tokens
        else:
            entries.append(entry.model_copy(deep=True))

    def drop(self, job_id: str) -> None:
        """Forget a job's unwritten entries (its lease was lost)."""
        self._pending.pop(job_id, None)
        self._inflight.pop(job_id, None)

    async def write_all(self, job_id: str) -> None:
        """Return once every entry of ``job_id`` added so far is in Redis (or was fenced off)."""
        while job_id in self._pending or job_id in self._inflight:
            if not await self.flush():
                await asyncio.sleep(0.2)

    async def flush(self) -> bool:
        """Send one batch per job in one pipeline. Returns False if Redis was unreachable."""
        async with self._lock:
            for job_id in [j for j in self._pending if j not in self._inflight]:
                self._inflight[job_id] = _Batch(f"{self._writer_id}:{next(self._batch_numbers)}",
                                                self._pending.pop(job_id))
            batch = dict(self._inflight)
            if not batch:
                return True
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for job_id, sent in batch.items():
                        await self._script(keys=self._keys(job_id), args=self._args(job_id, sent), client=pipe)
                    written = await pipe.execute()
            except (RedisConnectionError, RedisTimeoutError, OSError, RedisError) as exc:
                log.warning("stream flush failed (%s); %d jobs buffered", type(exc).__name__, len(self._inflight))
                return False
            self.round_trips += 1
            for (job_id, sent), ok in zip(batch.items(), written):
                self._inflight.pop(job_id, None)
                if ok:
                    self.entries_written += len(sent.entries)
                else:
                    self._pending.pop(job_id, None)
                    log.warning("job %s: lease held by another worker; abandoning it", job_id)
                    if self.on_fenced is not None:
                        self.on_fenced(job_id)
            return True

    def _keys(self, job_id: str) -> list[str]:
        return [self.fence.owners_key if self.fence else "", stream_key(job_id), write_mark_key(job_id)]

    def _args(self, job_id: str, sent: _Batch) -> list[str | int]:
        args: list[str | int] = [self.fence.token if self.fence else "", job_id, self.maxlen, self.ttl_s, sent.id]
        for entry in sent.entries:
            fields = encode_entry(entry)
            args.append(2 * len(fields))
            for name, value in fields.items():
                args += [name, value]
        return args

    async def _flush_loop(self) -> None:
        backoff = self.flush_s
        while True:
            await asyncio.sleep(backoff)
            ok = await self.flush()
            backoff = self.flush_s if ok else min(max(backoff * 2, 0.1), 2.0)


async def read_stream(redis: Redis, job_id: str, *, last_id: str = "0-0", block_ms: int = 1000,
                      idle_check: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator[StreamEntry]:
    """Yield the job's entries after ``last_id`` until its final entry.

    ``idle_check`` is awaited whenever nothing arrives for ``block_ms``; returning True ends the
    iteration (e.g. the job is gone and will never write again).
    """
    key = stream_key(job_id)
    while True:
        response = await redis.xread({key: last_id}, count=512, block=block_ms)
        if not response:
            if idle_check is not None and await idle_check():
                return
            continue
        for _key, entries in response:
            for entry_id, raw in entries:
                entry = decode_entry(entry_id, raw)
                last_id = entry.id
                yield entry
                if entry.final:
                    return
