"""Following job streams: ONE blocking XREAD serves every stream a client follows.

A reader per job costs a round trip per job each time the job's worker flushes, and a web app or
gateway streaming sixteen jobs would make sixteen XREADs per flush. :class:`StreamReader` keeps
one connection that blocks in a single ``XREAD`` over all the streams being followed and hands each
follower its entries, so the cost is one round trip per flush for all of them (Redis answers as
soon as any stream has news, so no follower waits for another).

A follower that arrives while that read is blocked must not wait for it to time out: the reader
asks Redis to end the blocked read (``CLIENT UNBLOCK`` from another connection: one command per
new follower, none per entry) and reads again with the new stream included. The blocked
connection's id is fetched on every (re)connect, so a reconnect cannot leave a stale id behind.

Readers still resume exactly: each follower keeps the id of the last entry it was given, and a
stream read for several followers starts after the oldest of their ids, each getting only what
follows its own.

On a Redis Cluster one XREAD can only cover one slot, so :class:`ClusterStreamReader` keeps one
:class:`StreamReader` per stream bucket (the streams of a bucket share a hash tag:
:func:`slotq.jobs.protocol.keys.stream_key`), each on a connection to the node that serves it:
as many blocking reads as buckets with followers, at most
:data:`~slotq.jobs.protocol.keys.STREAM_BUCKETS`, however many streams are followed.
:func:`stream_reader` picks the kind the client needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from slotq.jobs.aio import cancel_and_wait
from slotq.jobs.errors import StreamGone
from slotq.jobs.protocol import streams
from slotq.jobs.protocol.connection import is_cluster, node_client
from slotq.jobs.protocol.keys import STREAM_TAGS, stream_bucket
from slotq.jobs.protocol.schemas import StreamEntry
from slotq.jobs.protocol.streams import RawEntry, decode_entry, is_final

log = logging.getLogger(__name__)

StreamId = tuple[int, int]
UNBLOCK_TRIES = 8       # a CLIENT UNBLOCK can overtake the XREAD it is meant for: try again briefly
FINAL_ENTRY_REREADS = 4  # reads of an ended job's stream before it is declared to have no final entry
NODE_LOST_WAIT_S = 30.0  # on a cluster: how long a follower looks for the node of its stream after losing it


def parse_id(entry_id: bytes | str) -> StreamId:
    """``"1700000000000-3"`` -> (1700000000000, 3): stream ids order as these tuples do."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def format_id(stream_id: StreamId) -> str:
    return f"{stream_id[0]}-{stream_id[1]}"


@dataclass(eq=False)
class _Follower:
    job_id: str
    last: StreamId
    inbox: asyncio.Queue[list[RawEntry] | BaseException] = field(default_factory=asyncio.Queue)


def split_for(followers: list[_Follower], entries: list[RawEntry]) -> list[tuple[_Follower, list[RawEntry]]]:
    """Each follower's share of what one read returned for its stream: the entries after its own
    last id (the read started after the oldest follower's id)."""
    out = []
    ids = [parse_id(entry_id) for entry_id, _ in entries]
    for follower in followers:
        mine = [entry for entry, entry_id in zip(entries, ids) if entry_id > follower.last]
        if mine:
            follower.last = max(ids)
            out.append((follower, mine))
    return out


class StreamReader:
    """Shared by everything a client reads; :meth:`close` with the client. ``clustered``: the streams
    are a cluster's (``redis`` is then a client of the one node that serves them all)."""

    def __init__(self, redis: Redis, *, block_ms: int = 1000, count: int = 512, clustered: bool = False) -> None:
        self.redis = redis
        self.block_ms = block_ms
        self.count = count
        self.clustered = clustered
        self._followers: dict[str, list[_Follower]] = {}
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._client_id: int | None = None
        self._reading: dict[str, StreamId] | None = None    # what the XREAD in flight asked for
        self._generation = 0                                 # +1 per XREAD sent
        self._unblocking: asyncio.Task[None] | None = None
        self.reads = 0                                       # XREADs sent (tests, benchmarks)

    async def follow(self, job_id: str, *, last_id: str = "0-0", idle_ms: int = 1000,
                     is_live: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator[StreamEntry]:
        """Yield the job's entries after ``last_id`` until its final entry; never return before it.

        ``is_live`` is awaited whenever nothing arrives for ``idle_ms``. Once it says the job will
        never write again, the shared read may still be carrying the job's last entries (a slow
        link, a read being retried), so the follower reads the rest of the stream itself (XRANGE)
        instead of trusting the quiet. It then ends with the final entry, or raises
        :class:`~slotq.jobs.errors.StreamGone` naming the job and the last id given out: the stream
        expired, was trimmed past that id, or holds no final entry. A read error (Redis
        unreachable beyond the retries) is raised as it is. Without ``is_live`` the follower
        waits for the final entry however long it takes."""
        follower = _Follower(job_id, parse_id(last_id))
        given = follower.last                     # the last id yielded: nothing at or before it is yielded again
        self._add(follower)
        trim_check: asyncio.Task[None] | None = asyncio.create_task(self._check_not_trimmed(job_id, given))
        try:
            while True:
                try:
                    async with asyncio.timeout(idle_ms / 1000):
                        item = await follower.inbox.get()
                except TimeoutError:
                    if is_live is None or await is_live():
                        continue
                    item = await self._rest_of(job_id, given)
                    if not item:
                        return                    # a reader resuming after the final entry
                    follower.last = max(follower.last, parse_id(item[-1][0]))
                if isinstance(item, BaseException):
                    raise item
                if trim_check is not None:        # before the first entry: a trimmed stream never yields a gap
                    await trim_check
                    trim_check = None
                for entry_id, raw in item:
                    if parse_id(entry_id) <= given:
                        continue                  # given already (by a catch-up read, or the shared read)
                    entry = decode_entry(entry_id, raw)
                    given = parse_id(entry.id)
                    yield entry
                    if entry.final:
                        return
        finally:
            if trim_check is not None:
                trim_check.cancel()
            self._remove(follower)

    async def _check_not_trimmed(self, job_id: str, after: StreamId) -> None:
        """Raise StreamGone if entries after ``after`` are no longer in the stream. MAXLEN trimming
        drops the oldest entries, so when some were dropped (``entries-added`` > ``length``) and the
        stream now starts past ``after``, what followed ``after`` may be among them (a reader whose
        own last entry was the last one dropped is told so too: Redis keeps nothing that could tell
        the two apart). Started with the
        follower and awaited before its first entry, so it adds no wait on a live stream. A stream
        that does not exist yet (a queued job) cannot have been trimmed."""
        start = await streams.stream_start(self.redis, job_id, clustered=self.clustered)
        if start is None:
            return                                # no such stream (yet)
        if start.trimmed and start.first_id and parse_id(start.first_id) > after:
            raise StreamGone(job_id, format_id(after), f"was trimmed past this reader (it now starts at "
                             f"{format_id(parse_id(start.first_id))}; SLOTQ_STREAM_MAXLEN)")

    async def _rest_of(self, job_id: str, after: StreamId) -> list[RawEntry]:
        """Everything after ``after`` in the stream of a job that will not write again, read
        directly. Empty when the reader already had the final entry; StreamGone when the stream
        cannot end the follow (no such stream, or no final entry in it). A job's final entry is
        written before its result, so one that finished a moment ago has it; the few re-reads
        cover a result written by a producer between its two writes (a cancel)."""
        for attempt in range(FINAL_ENTRY_REREADS):
            rest = await streams.read_after(self.redis, job_id, format_id(after), page=self.count,
                                            clustered=self.clustered)
            if any(is_final(raw) for _id, raw in rest):
                return rest
            if not rest:
                last = await streams.read_last(self.redis, job_id, clustered=self.clustered)
                if last is None and not await streams.exists(self.redis, job_id, clustered=self.clustered):
                    raise StreamGone(job_id, format_id(after), "does not exist (expired after SLOTQ_STREAM_TTL_S, "
                                     "or the job never started)")
                if last is not None and is_final(last[1]) and parse_id(last[0]) <= after:
                    return []
            if attempt + 1 < FINAL_ENTRY_REREADS:
                await asyncio.sleep(0.1 * (attempt + 1))
        raise StreamGone(job_id, format_id(after), "holds no final entry although the job has ended "
                         "(it ended without running: see its result)")

    async def close(self) -> None:
        for task in (self._unblocking, self._task):
            await cancel_and_wait(task)

    # ------------------------------------------------------------------ followers
    def _add(self, follower: _Follower) -> None:
        self._followers.setdefault(follower.job_id, []).append(follower)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="slotq-stream-reader")
        self._changed.set()
        reading = self._reading
        behind = reading is not None and (follower.job_id not in reading or follower.last < reading[follower.job_id])
        if behind and (self._unblocking is None or self._unblocking.done()):
            self._unblocking = asyncio.create_task(self._unblock(self._generation), name="slotq-stream-unblock")

    def _remove(self, follower: _Follower) -> None:
        followers = self._followers.get(follower.job_id, [])
        with contextlib.suppress(ValueError):
            followers.remove(follower)
        if not followers:
            self._followers.pop(follower.job_id, None)

    async def _unblock(self, generation: int) -> None:
        """End the blocked XREAD of ``generation`` so the next one includes the new follower."""
        delay = 0.001
        for _ in range(UNBLOCK_TRIES):
            if self._generation != generation or self._reading is None:
                return                    # that read already returned: the next one sees the follower
            if self._client_id is not None:
                try:
                    if await self.redis.client_unblock(self._client_id):
                        return
                except RedisError as exc:   # the read itself will time out at block_ms
                    log.debug("CLIENT UNBLOCK failed: %s", exc)
                    return
            await asyncio.sleep(delay)    # the XREAD has not reached Redis yet
            delay = min(delay * 2, 0.05)

    # ------------------------------------------------------------------ the one read
    async def _run(self) -> None:
        client = Redis(connection_pool=self.redis.connection_pool, single_connection_client=True)
        try:
            try:
                await client.initialize()             # a dedicated connection of the same pool
                connection = client.connection
                assert connection is not None         # single_connection_client: initialize() made it
                connection.register_connect_callback(self._on_connect)
                self._client_id = await client.client_id()
            except (RedisError, OSError) as exc:
                self._fail_all(exc)
                return
            while True:
                if not self._followers:
                    self._changed.clear()
                    await self._changed.wait()
                    continue
                reading = {job_id: min(f.last for f in followers) for job_id, followers in self._followers.items()}
                self._reading = reading
                self._generation += 1
                self.reads += 1
                try:
                    response = await streams.read_new(client, {job_id: format_id(v) for job_id, v in reading.items()},
                                                      count=self.count, block_ms=self.block_ms,
                                                      clustered=self.clustered)
                except (RedisError, OSError) as exc:
                    self._fail_all(exc)
                    continue
                finally:
                    self._reading = None
                for job_id, entries in response.items():
                    for follower, mine in split_for(self._followers.get(job_id, []), entries):
                        follower.inbox.put_nowait(mine)
        finally:
            self._client_id = None
            if client.connection is not None:
                client.connection.deregister_connect_callback(self._on_connect)
            await client.aclose()

    async def _on_connect(self, connection: AbstractConnection) -> None:
        """A reconnect gives the blocked connection a new id: learn it before the read is retried."""
        await connection.send_command("CLIENT", "ID")
        self._client_id = int(await connection.read_response())

    def _fail_all(self, exc: BaseException) -> None:
        """Every current follower raises ``exc`` (as a reader of its own would have); later ones
        start a fresh read."""
        followers = [f for fs in self._followers.values() for f in fs]
        self._followers.clear()
        for follower in followers:
            follower.inbox.put_nowait(exc)


class ClusterStreamReader:
    """:class:`StreamReader` on a Redis Cluster (see the module): one reader per stream bucket, each on
    a client of the node serving the bucket, made when the bucket's first follower comes.

    When a follower's read fails for want of its node (a primary died), the bucket's reader is
    dropped, the slot map read again, and the follower carries on from the last entry it gave, on
    a reader of the node that serves the bucket now (the replica promoted in its place); it gives up
    after :data:`NODE_LOST_WAIT_S` without one, raising the last error."""

    def __init__(self, redis: Redis, *, block_ms: int = 1000, count: int = 512) -> None:
        self.redis = redis
        self.block_ms = block_ms
        self.count = count
        self._readers: dict[int, StreamReader] = {}
        self._lock = asyncio.Lock()

    @property
    def reads(self) -> int:
        """XREADs sent by the readers open now."""
        return sum(reader.reads for reader in self._readers.values())

    async def follow(self, job_id: str, *, last_id: str = "0-0", idle_ms: int = 1000,
                     is_live: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator[StreamEntry]:
        """As :meth:`StreamReader.follow`."""
        bucket = stream_bucket(job_id)
        given = last_id
        lost_since: float | None = None
        while True:
            reader: StreamReader | None = None
            try:
                reader = await self._reader(bucket, fresh_map=lost_since is not None)
                async for entry in reader.follow(job_id, last_id=given, idle_ms=idle_ms, is_live=is_live):
                    given, lost_since = entry.id, None
                    yield entry
                return
            except (RedisConnectionError, RedisTimeoutError, OSError):
                now = asyncio.get_running_loop().time()
                lost_since = now if lost_since is None else lost_since
                if reader is not None:
                    await self._drop(bucket, reader)
                if now - lost_since > NODE_LOST_WAIT_S:
                    raise
                log.warning("job %s: the node of its stream failed; looking for the node that serves it now", job_id)
                await asyncio.sleep(0.2)

    async def _reader(self, bucket: int, *, fresh_map: bool) -> StreamReader:
        async with self._lock:
            reader = self._readers.get(bucket)
            if reader is None:
                # any key with the bucket's hash tag names its slot
                client = await node_client(self.redis, f"{{{STREAM_TAGS[bucket]}}}", fresh_map=fresh_map)
                reader = self._readers[bucket] = StreamReader(client, block_ms=self.block_ms, count=self.count,
                                                              clustered=True)
            return reader

    async def _drop(self, bucket: int, reader: StreamReader) -> None:
        async with self._lock:
            if self._readers.get(bucket) is reader:
                del self._readers[bucket]
        await reader.close()
        await reader.redis.aclose()

    async def close(self) -> None:
        async with self._lock:
            readers, self._readers = list(self._readers.values()), {}
        for reader in readers:
            await reader.close()
            await reader.redis.aclose()


def stream_reader(redis: Redis, *, block_ms: int = 1000, count: int = 512) -> StreamReader | ClusterStreamReader:
    """The shared reader a client of ``redis`` needs: a :class:`ClusterStreamReader` on a cluster."""
    if is_cluster(redis):
        return ClusterStreamReader(redis, block_ms=block_ms, count=count)
    return StreamReader(redis, block_ms=block_ms, count=count)
