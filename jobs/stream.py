"""The per-job output stream ``slotq:stream:{job_id}``: writing it in batches, reading it resumably.

Writers coalesce chunks for ``stream_flush_ms`` and send every job's pending entries in one
script, so Redis traffic grows with time, not with tokens. Readers use plain XREAD
from their last id (no consumer groups): any number of readers, each can drop and resume without
gaps or repeats, and an HTTP gateway can use the entry id as the SSE event id.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from enum import IntEnum

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from engine import ErrorInfo, FinishReason, Timings, Usage
from jobs.keys import stream_key, write_mark_key
from jobs.queue.scripts import STREAM_FLUSH
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


class TTL(IntEnum):
    """What a flush does to a job's stream expiry (only where it changes: not on every chunk)."""

    KEEP = 0
    LIVE = 1      # the first write of this writer: the stream outlives any attempt (ttl_live_s)
    FINAL = 2     # the final entry: the stream now lives ttl_s


@dataclass
class _JobBatch:
    entries: list[StreamEntry] = field(default_factory=list)
    ttl: TTL = TTL.KEEP


@dataclass
class _Flush:
    id: str
    jobs: list[tuple[str, _JobBatch]]


class StreamWriter:
    """Buffers entries per job and writes every job's entries in ONE script per flush.

    A flush goes out every ``flush_ms``, or at once when a job's first entry or a final entry is
    waiting (time to first token and to the result are not delayed). The script checks each job's
    fence, appends its entries and touches its expiry only on the first and the final write, so a
    flush costs one round trip and about two commands per job.

    If Redis is unreachable, entries stay buffered (bounded by slots x max_tokens) and are written,
    in order, once it is back; generation does not stop for a Redis blip. A flush that was sent is
    re-sent unchanged, under the same id, until it is acknowledged, and Redis answers an id it has
    already applied from its record: a write whose reply was lost is never appended twice. With a
    ``fence``, a job's entries are written only while this worker owns the job; a refused job's
    entries are dropped and ``on_fenced`` is told.
    """

    def __init__(self, redis: Redis, *, flush_ms: float, maxlen: int, ttl_s: int, ttl_live_s: int | None = None,
                 fence: Fence | None = None, on_fenced: Callable[[str], None] | None = None) -> None:
        self.redis = redis
        self.flush_s = flush_ms / 1000
        self.maxlen = maxlen
        self.ttl_s = ttl_s
        self.ttl_live_s = ttl_live_s or ttl_s
        self.fence = fence
        self.on_fenced = on_fenced
        self._script = redis.register_script(STREAM_FLUSH)
        self._writer_id = fence.token if fence else uuid.uuid4().hex
        self._flush_numbers = itertools.count()
        self._pending: dict[str, _JobBatch] = {}       # not yet sent
        self._inflight: _Flush | None = None           # sent, not yet acknowledged
        self._started: set[str] = set()                # jobs this writer has written to (expiry set)
        self._urgent = asyncio.Event()
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
        batch = self._pending.get(job_id)
        if batch is None:
            batch = self._pending[job_id] = _JobBatch()
            if job_id not in self._started:
                self._started.add(job_id)
                batch.ttl = TTL.LIVE
                self._urgent.set()                # the job's first entry: do not make its reader wait
        last = batch.entries[-1] if batch.entries else None
        if (entry.kind == EntryKind.CHUNK and last is not None and last.kind == EntryKind.CHUNK
                and last.choice == entry.choice and last.attempt == entry.attempt):
            last.text += entry.text
            last.token_ids.extend(entry.token_ids)
            last.n_tokens = entry.n_tokens
            return
        batch.entries.append(entry.model_copy(deep=True))
        if entry.final:
            batch.ttl = TTL.FINAL
            self._started.discard(job_id)
            self._urgent.set()
        elif entry.kind != EntryKind.CHUNK:
            self._urgent.set()

    def drop(self, job_id: str) -> None:
        """Forget a job's unwritten entries (its lease was lost; a flush in flight is fenced off)."""
        self._pending.pop(job_id, None)
        self._started.discard(job_id)

    async def write_all(self, job_id: str) -> None:
        """Return once every entry of ``job_id`` added so far is in Redis (or was fenced off)."""
        while job_id in self._pending or (self._inflight and any(j == job_id for j, _ in self._inflight.jobs)):
            if not await self.flush():
                await asyncio.sleep(0.2)

    async def flush(self) -> bool:
        """Send the flush in flight again, or every pending job's entries as a new one. Returns
        False if Redis was unreachable (the same flush is sent again next time)."""
        async with self._lock:
            if self._inflight is None:
                if not self._pending:
                    return True
                self._inflight = _Flush(f"{self._writer_id}:{next(self._flush_numbers)}", list(self._pending.items()))
                self._pending = {}
            sent = self._inflight
            try:
                written = await self._script(keys=self._keys(sent), args=self._args(sent))
            except (RedisConnectionError, RedisTimeoutError, OSError, RedisError) as exc:
                log.warning("stream flush failed (%s); %d jobs buffered", type(exc).__name__, len(sent.jobs))
                return False
            self._inflight = None
            self.round_trips += 1
            for (job_id, batch), ok in zip(sent.jobs, written.decode() if isinstance(written, bytes) else written):
                if ok == "1":
                    self.entries_written += len(batch.entries)
                    continue
                self._pending.pop(job_id, None)
                self._started.discard(job_id)
                log.warning("job %s: no longer this worker's; abandoning it", job_id)
                if self.on_fenced is not None:
                    self.on_fenced(job_id)
            return True

    def _keys(self, sent: _Flush) -> list[str]:
        owners = self.fence.owners_key if self.fence else ""
        return [owners, write_mark_key(self._writer_id), *(stream_key(job_id) for job_id, _ in sent.jobs)]

    def _args(self, sent: _Flush) -> list[str | int]:
        args: list[str | int] = [self.fence.token if self.fence else "", sent.id, self.maxlen, self.ttl_live_s,
                                 self.ttl_s]
        for job_id, batch in sent.jobs:
            args += [job_id, int(batch.ttl), len(batch.entries)]
            for entry in batch.entries:
                fields = encode_entry(entry)
                args.append(2 * len(fields))
                for name, value in fields.items():
                    args += [name, value]
        return args

    async def _flush_loop(self) -> None:
        """Every ``flush_s``, or at once for a first or final entry; back off while Redis is down."""
        backoff = self.flush_s
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(backoff):
                    await self._urgent.wait()
            self._urgent.clear()
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
