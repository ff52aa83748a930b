"""The per-job output stream ``slotq:stream:{job_id}``: writing it in batches, reading it resumably.

Writers coalesce chunks for a few milliseconds and send every job's pending entries in one
pipelined round trip, so Redis traffic grows with time, not with tokens. Readers use plain XREAD
from their last id (no consumer groups): any number of readers, each can drop and resume without
gaps or repeats, and an HTTP gateway can use the entry id as the SSE event id.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from engine import ErrorInfo, FinishReason, Timings, Usage
from jobs.keys import stream_key
from jobs.lease import FENCED_XADD_SCRIPT, Lease
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


class StreamWriter:
    """Buffers entries per job and flushes all jobs together every ``flush_ms``.

    If Redis is unreachable, entries stay buffered (bounded by slots x max_tokens) and are
    written, in order, once it is back; generation does not stop for a Redis blip. With a
    ``lease``, each job's entries are written only while this worker holds the job's lease (one
    atomic script per job); a refused job's entries are dropped and ``on_fenced`` is told.
    """

    def __init__(self, redis: Redis, *, flush_ms: float, maxlen: int, ttl_s: int, lease: Lease | None = None,
                 on_fenced: Callable[[str], None] | None = None) -> None:
        self.redis = redis
        self.flush_s = flush_ms / 1000
        self.maxlen = maxlen
        self.ttl_s = ttl_s
        self.lease = lease
        self.on_fenced = on_fenced
        self._script = redis.register_script(FENCED_XADD_SCRIPT)
        self._pending: dict[str, list[StreamEntry]] = {}
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
        await self.flush()

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

    async def flush(self) -> bool:
        """Write everything buffered in one pipeline. Returns False if Redis was unreachable."""
        async with self._lock:
            if not self._pending:
                return True
            batch, self._pending = self._pending, {}
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for job_id, entries in batch.items():
                        await self._script(keys=self._keys(job_id), args=self._args(job_id, entries), client=pipe)
                    written = await pipe.execute()
            except (RedisConnectionError, RedisTimeoutError, OSError, RedisError) as exc:
                for job_id, entries in batch.items():        # put back in front of anything newer
                    self._pending[job_id] = entries + self._pending.get(job_id, [])
                log.warning("stream flush failed (%s); %d jobs buffered", type(exc).__name__, len(self._pending))
                return False
            self.round_trips += 1
            for (job_id, entries), ok in zip(batch.items(), written):
                if ok:
                    self.entries_written += len(entries)
                else:
                    self._pending.pop(job_id, None)
                    log.warning("job %s: lease held by another worker; abandoning it", job_id)
                    if self.on_fenced is not None:
                        self.on_fenced(job_id)
            return True

    def _keys(self, job_id: str) -> list[str]:
        queue = self.lease.queue_name if self.lease else ""
        return [Lease.lock_key(job_id), queue, stream_key(job_id)]

    def _args(self, job_id: str, entries: list[StreamEntry]) -> list[str | int]:
        lease = self.lease
        args: list[str | int] = [lease.token if lease else "", job_id, lease.ttl_ms if lease else 0,
                                 self.maxlen, self.ttl_s]
        for entry in entries:
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
