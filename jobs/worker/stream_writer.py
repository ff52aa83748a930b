"""The worker's stream writer: every running job's output, batched into one Redis round trip per
flush, so Redis traffic grows with time, not with tokens.

Chunks are coalesced for up to ``stream_flush_ms`` (:class:`FlushPolicy` says when a flush is
worth its commands) and every job's pending entries go out in one ``STREAM_FLUSH`` script through
:class:`~slotq.jobs.protocol.streams.StreamAppender`, which owns the encoding and the script's
arguments. This module owns the buffering, the fencing by lease and the retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import RedisError

from slotq.jobs.protocol.connection import is_cluster, is_transient
from slotq.jobs.protocol.keys import stream_bucket
from slotq.jobs.protocol.schemas import EntryKind, StreamEntry
from slotq.jobs.protocol.streams import TTL, JobEntries, StreamAppender, StreamOpening, encode_chunk, encode_entry
from slotq.jobs.protocol.wire import TokenLogprob, ToolCallDelta
from slotq.jobs.worker import metrics

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Chunk:
    """Consecutive text of one choice and attempt, merged while it waits for a flush (no pydantic
    object per token: this is the worker's per-token path)."""

    attempt: int
    choice: int
    texts: list[str]
    token_ids: list[int]
    n_tokens: int
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None      # one per token id, for a job that asked for them
    prompt_tokens: int = 0                          # an attempt's first chunk: the prompt's tokens (0: not said)
    cached_prompt_tokens: int = 0                   # and those of them cached

    def fields(self) -> dict[str, str]:
        return encode_chunk(attempt=self.attempt, choice=self.choice, text="".join(self.texts),
                            token_ids=self.token_ids, n_tokens=self.n_tokens, reasoning="".join(self.reasoning),
                            tool_calls=self.tool_calls, logprobs=self.logprobs, prompt_tokens=self.prompt_tokens,
                            cached_prompt_tokens=self.cached_prompt_tokens)


@dataclass
class _JobBatch:
    lease: str                     # the claim these entries were written under ('' = not fenced)
    entries: list[_Chunk | StreamEntry] = field(default_factory=list)
    ttl: TTL = TTL.KEEP


@dataclass
class _Flush:
    id: str
    jobs: dict[str, _JobBatch]     # one batch per job, as pending held them
    since: float                   # when its oldest entry was added (monotonic)
    tokens: int                    # its chunk tokens
    refusals: int = 0              # tries Redis answered with a deterministic error (see StreamWriter.flush)


# A flush Redis refused this many times in a row with a deterministic error (a Lua error, OOM, WRONGTYPE:
# connection.is_transient) is given up: sending it again gets the same answer. A few tries, with the flush
# loop's backoff (under a second in all), let an OOM that eviction or a freed key clears at once pass.
DETERMINISTIC_TRIES = 4


@dataclass(frozen=True)
class FlushPolicy:
    """When the pending entries are worth a flush.

    A flush costs Redis a fixed handful of commands per stream bucket it touches (a bucket's own call:
    the call, the flush mark's read and write, the fences; a reader's read; a node's call for several
    buckets costs less, docs/cluster.md); a single Redis has one bucket, a Redis Cluster up to
    :data:`~slotq.jobs.protocol.keys.STREAM_BUCKETS` (each node's in one script call). Each entry
    costs more than its XADD: the worker packs its fields into the script's arguments, and every
    follower reads, decodes and forwards it (an SSE event, a chunk of the OpenAI SDK). So a flush waits
    until its tokens pay for all of it -- ``tokens >= FIXED_COMMANDS x buckets + ENTRY_COST x entries``
    -- or until its oldest entry has waited ``max_delay_s``. Many streams thus flush every few steps
    with several tokens an entry, one or a few every ``max_delay_s`` at most, and no text waits longer
    than that. A job's first entry, a final entry and errors go at once: time to first token and to
    the result are never delayed.
    """

    max_delay_s: float
    FIXED_COMMANDS = 5      # per bucket, as its own call costs: EVALSHA, the mark's GET + SET, HMGET; a reader's XREAD
    # An entry's cost, in tokens: measured with ``python -m bench.worker_ab --before <rev> --workloads overhead``
    # (64 streams x 256 tokens, the tiny model, a quiet 2-core machine, 2026-12-06), the worker's main thread
    # spent 29-31 ms a 1,000 tokens at 1 (an entry a step or two), 20 at 4, 17 at 8 and 14 at 16, and the
    # Redis path gave 0.56x the engine in-process at 1, 0.70x at 4, 0.79x at 8, 0.81x at 16: most of the
    # gain by 8, where 64 streams flush about every 8 decode steps (50 ms here) and one stream at the
    # 100 ms bound.
    ENTRY_COST = 8

    @classmethod
    def pays(cls, *, tokens: int, entries: int, buckets: int) -> bool:
        """Whether ``tokens`` pay for a flush of ``entries`` in ``buckets`` stream buckets."""
        return tokens >= cls.FIXED_COMMANDS * buckets + cls.ENTRY_COST * entries

    def due_in(self, *, waited_s: float, tokens: int, entries: int, buckets: int, urgent: bool) -> float:
        """Seconds until the pending entries should be flushed (0 = now)."""
        if urgent or self.pays(tokens=tokens, entries=entries, buckets=buckets):
            return 0.0
        return max(0.0, self.max_delay_s - waited_s)


class StreamWriter:
    """Buffers entries per job and writes every job's entries in ONE script per flush.

    When a flush goes out is :class:`FlushPolicy`'s call (at the latest ``flush_ms`` after the
    oldest waiting entry; at once for a job's first entry, final entries and errors). The script
    checks each job's fence, appends its entries and touches a stream's expiry only on its first
    and its final write (on a Redis Cluster, one script per node, sent together).

    If Redis is unreachable, entries stay buffered (bounded by slots x max_tokens) and are written,
    in order, once it is back; generation does not stop for a Redis blip. A flush that was sent is
    re-sent unchanged, under the same id, until it is acknowledged, and Redis answers an id it has
    already applied from its record: a write whose reply was lost is never appended twice.

    A job bound to a lease (:meth:`bind`) has its entries written only while its fence holds that
    lease (:func:`~slotq.jobs.protocol.streams.open_streams`): each entry keeps its lease until it
    is written, so entries an attempt left buffered are refused once the job is claimed again, even
    by this worker. A refused job's pending entries are dropped and ``on_fenced(job_id, lease)`` is
    told. Entries of a job never bound are not fenced. So is a flush Redis refuses for good (a
    deterministic error, :data:`DETERMINISTIC_TRIES` times in a row): retried as an outage it would
    hold its jobs' attempts forever.
    """

    def __init__(self, redis: Redis, *, flush_ms: float, maxlen: int, ttl_s: int, ttl_live_s: int | None = None,
                 writer_id: str | None = None,
                 on_fenced: Callable[[str, str], None] | None = None) -> None:
        self.redis = redis
        self.policy = FlushPolicy(max_delay_s=flush_ms / 1000)
        self.on_fenced = on_fenced
        self._writer_id = writer_id or uuid.uuid4().hex
        self._appender = StreamAppender(redis, writer_id=self._writer_id, maxlen=maxlen, ttl_s=ttl_s,
                                        ttl_live_s=ttl_live_s)
        self._flush_numbers = itertools.count()
        self._leases: dict[str, str] = {}              # job id -> the lease its new entries are written under
        self._pending: dict[str, _JobBatch] = {}       # not yet sent
        # on a cluster: stream bucket -> pending jobs in it (what a flush costs grows with the buckets)
        self._buckets: Counter[int] | None = Counter() if is_cluster(redis) else None
        self._inflight: _Flush | None = None           # sent, not yet acknowledged
        self._started: set[str] = set()                # jobs this writer has written to (expiry set)
        self._tokens = 0                               # in _pending: chunk tokens, entries, oldest add
        self._entries = 0
        self._since: float | None = None
        self._urgent = False
        self._wake = asyncio.Event()                   # the flush loop re-checks the policy
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        # asked for this turn (:meth:`open`): job id -> its lease then, and what its opening answers
        self._opening: dict[str, tuple[str, asyncio.Future[StreamOpening]]] = {}
        self._open_task: asyncio.Task[None] | None = None
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

    def bind(self, job_id: str, lease: str) -> None:
        """Entries of ``job_id`` added from now on are written only while ``lease`` owns the job.
        Entries still pending under an earlier lease are dropped: a newer claim exists, so the
        fence would refuse them anyway."""
        self._leases[job_id] = lease
        batch = self._pending.get(job_id)
        if batch is not None and batch.lease != lease:
            self.drop(job_id)

    async def open(self, job_id: str) -> StreamOpening:
        """Raise the fence of ``job_id`` to the lease it is bound to and read its stream, for its
        attempt to resume from (:func:`~slotq.jobs.protocol.streams.open_streams`); not raised: a newer
        claim of the job holds the fence, so this attempt has lost it. A job never bound is only read.

        The jobs that open in the same turn of the event loop -- a claim's jobs, whose arq preludes
        end together -- share one call: one round trip for all of them, not one each."""
        asked = self._opening.get(job_id)
        if asked is None:
            asked = self._opening[job_id] = (self._leases.get(job_id, ""), asyncio.get_running_loop().create_future())
            if self._open_task is None:
                self._open_task = asyncio.create_task(self._open_together(), name="slotq-stream-open")
        return await asyncio.shield(asked[1])

    async def _open_together(self) -> None:
        """Open every stream asked for in this turn of the event loop (:meth:`open`), in one call."""
        await asyncio.sleep(0)                          # the rest of this turn's openers join
        asking, self._opening, self._open_task = self._opening, {}, None
        try:
            opened = await self._appender.open_streams({job_id: lease for job_id, (lease, _) in asking.items()})
        except asyncio.CancelledError:
            for _, future in asking.values():
                future.cancel()
            raise
        except Exception as exc:
            for _, future in asking.values():
                future.set_exception(exc)
            return
        for job_id, (_, future) in asking.items():
            future.set_result(opened[job_id])

    def unbind(self, job_id: str) -> None:
        """The attempt is over (entries it already added keep their lease until written). The job is
        forgotten: an attempt that ends without a final entry (handed back, retried) would otherwise
        stay among the jobs this writer started for good, and the job's next attempt here would not
        set its stream's live expiry again."""
        self._leases.pop(job_id, None)
        self._started.discard(job_id)

    def tracked_jobs(self) -> int:
        """Jobs the writer keeps anything of (a lease, pending entries, a started stream): none once
        every attempt has ended and its entries are written."""
        return len(self._leases.keys() | self._pending.keys() | self._started)

    def add_chunk(self, job_id: str, *, attempt: int, choice: int, text: str, token_ids: list[int],
                  n_tokens: int, reasoning: str = "", tool_calls: Sequence[ToolCallDelta] = (),
                  logprobs: list[TokenLogprob] | None = None, prompt_tokens: int = 0,
                  cached_prompt_tokens: int = 0) -> None:
        """Queue generated output; consecutive chunks of one choice and attempt merge into one entry
        (their logprobs too, so each token id keeps its own). ``prompt_tokens`` (0: none) and
        ``cached_prompt_tokens`` come with a choice's first tokens (the entry's ``p`` and ``pc``)."""
        batch = self._batch(job_id)
        last = batch.entries[-1] if batch.entries else None
        if isinstance(last, _Chunk) and last.choice == choice and last.attempt == attempt:
            last.texts.append(text)
            last.token_ids.extend(token_ids)
            last.n_tokens = n_tokens
        else:
            last = _Chunk(attempt, choice, [text], list(token_ids), n_tokens)
            batch.entries.append(last)
            self._entries += 1
        if reasoning:
            last.reasoning.append(reasoning)
        if tool_calls:
            last.tool_calls.extend(tool_calls)
        if logprobs is not None:
            if last.logprobs is None:
                last.logprobs = []
            last.logprobs.extend(logprobs)
        if prompt_tokens:
            last.prompt_tokens, last.cached_prompt_tokens = prompt_tokens, cached_prompt_tokens
        self._tokens += len(token_ids)
        self._added()

    def add(self, job_id: str, entry: StreamEntry) -> None:
        """Queue an entry (a chunk merges with the one before it, as :meth:`add_chunk`)."""
        if entry.kind == EntryKind.CHUNK:
            self.add_chunk(job_id, attempt=entry.attempt, choice=entry.choice, text=entry.text,
                           token_ids=entry.token_ids, n_tokens=entry.n_tokens, reasoning=entry.reasoning,
                           tool_calls=entry.tool_calls, logprobs=entry.logprobs,
                           prompt_tokens=entry.prompt_tokens or 0, cached_prompt_tokens=entry.cached_prompt_tokens)
            return
        batch = self._batch(job_id)
        batch.entries.append(entry)
        self._entries += 1
        if entry.final:
            batch.ttl = TTL.FINAL
            self._started.discard(job_id)
        self._urgent = True                    # a final entry or an error: the reader is waiting for it
        self._added()

    def _buckets_touched(self) -> int:
        """The stream buckets a flush of the pending entries touches."""
        return len(self._buckets) if self._buckets is not None else 1

    def _batch(self, job_id: str) -> _JobBatch:
        batch = self._pending.get(job_id)
        if batch is None:
            batch = self._pending[job_id] = _JobBatch(lease=self._leases.get(job_id, ""))
            if self._buckets is not None:
                self._buckets[stream_bucket(job_id)] += 1
            if job_id not in self._started:
                self._started.add(job_id)
                batch.ttl = TTL.LIVE
                self._urgent = True            # the job's first entry: do not make its reader wait
        return batch

    def _added(self) -> None:
        """Wake the flush loop only when the policy's answer may have changed to "now", or to arm
        its timer for the first entry after a flush: not once per token."""
        if self._since is None:
            self._since = time.monotonic()
            self._wake.set()
        elif self._urgent or FlushPolicy.pays(tokens=self._tokens, entries=self._entries,
                                              buckets=self._buckets_touched()):
            self._wake.set()

    def drop(self, job_id: str) -> None:
        """Forget a job's unwritten entries (its lease was lost; a flush in flight is fenced off)."""
        batch = self._pending.pop(job_id, None)
        if batch is not None:
            self._forget_bucket(job_id)
            self._entries -= len(batch.entries)
            self._tokens -= sum(len(e.token_ids) for e in batch.entries if isinstance(e, _Chunk))
        self._started.discard(job_id)

    def _forget_bucket(self, job_id: str) -> None:
        if self._buckets is not None:
            bucket = stream_bucket(job_id)
            self._buckets[bucket] -= 1
            if not self._buckets[bucket]:
                del self._buckets[bucket]

    async def write_all(self, job_id: str, *, within_s: float | None = None) -> bool:
        """Return True once every entry of ``job_id`` added so far is in Redis (or was fenced off).

        While Redis is unreachable this retries. With ``within_s`` it stops retrying after that many
        seconds, logs what was not written and returns False; those entries stay buffered, and the
        flush loop still sends them if Redis comes back before the writer closes. A write that a
        shield keeps going after its attempt was cancelled needs that bound: unbounded, it retried
        for as long as Redis was down, a task left running after the worker had stopped."""
        try:
            async with asyncio.timeout(within_s):
                while self.unwritten(job_id)[0]:
                    if not await self.flush():
                        await asyncio.sleep(0.2)
        except TimeoutError:
            entries, tokens = self.unwritten(job_id)
            log.warning("job %s: %d stream entries (%d tokens) not written within %g s, Redis unreachable; "
                        "they stay buffered until the writer closes", job_id, entries, tokens, within_s)
            return False
        return True

    def unwritten(self, job_id: str) -> tuple[int, int]:
        """Entries of ``job_id`` not yet acknowledged by Redis (pending or in flight), and the chunk
        tokens among them."""
        batches = [batch for batch in (self._inflight.jobs.get(job_id) if self._inflight else None,
                                       self._pending.get(job_id)) if batch is not None]
        entries = [entry for batch in batches for entry in batch.entries]
        return len(entries), sum(len(e.token_ids) for e in entries if isinstance(e, _Chunk))

    async def flush(self) -> bool:
        """Send the flush in flight again, or every pending job's entries as a new one. Returns
        False if Redis was unreachable (the same flush is sent again next time)."""
        async with self._lock:
            if self._inflight is None:
                if not self._pending:
                    return True
                self._inflight = _Flush(f"{self._writer_id}:{next(self._flush_numbers)}", self._pending,
                                        since=self._since or time.monotonic(), tokens=self._tokens)
                self._pending = {}
                if self._buckets is not None:
                    self._buckets.clear()
                self._tokens = self._entries = 0
                self._since = None
                self._urgent = False
            sent = self._inflight
            try:
                written = await self._appender.append(sent.id, [
                    JobEntries(job_id, batch.lease, batch.ttl,
                               [e.fields() if isinstance(e, _Chunk) else encode_entry(e) for e in batch.entries])
                    for job_id, batch in sent.jobs.items()])
            except (OSError, RedisError) as exc:
                return self._failed(sent, exc)
            self._inflight = None
            self.round_trips += 1
            for (job_id, batch), ok in zip(sent.jobs.items(), written):
                if ok:
                    self.entries_written += len(batch.entries)
                    continue
                log.warning("job %s: its lease %s no longer owns it; its entries are dropped", job_id, batch.lease)
                self._refused(job_id, batch)
            return True

    def _failed(self, sent: _Flush, error: OSError | RedisError) -> bool:
        """A flush that raised: kept to be sent again (False) while the error is one a retry can
        outlast; given up after :data:`DETERMINISTIC_TRIES` deterministic errors in a row (True: nothing
        is left to send), its jobs' entries dropped and each attempt stopped as if fenced off (its job
        goes back to the queue when its lease ends, and resumes from what reached its stream)."""
        metrics.redis_failure("flush", error)
        if is_transient(error):
            log.warning("stream flush failed (%s); %d jobs buffered", type(error).__name__, len(sent.jobs))
            return False
        sent.refusals += 1
        log.error("stream flush refused by Redis (%s: %s), %d of %d tries; %d jobs buffered", type(error).__name__,
                  error, sent.refusals, DETERMINISTIC_TRIES, len(sent.jobs))
        if sent.refusals < DETERMINISTIC_TRIES:
            return False
        self._inflight = None
        for job_id, batch in sent.jobs.items():
            log.error("job %s: %d stream entries given up (Redis refused them %d times: %s); its attempt stops",
                      job_id, len(batch.entries), DETERMINISTIC_TRIES, error)
            self._refused(job_id, batch)
        return True

    def _refused(self, job_id: str, batch: _JobBatch) -> None:
        """``batch`` of ``job_id`` will never be written: drop what is pending under its lease and tell
        ``on_fenced``."""
        pending = self._pending.get(job_id)
        if pending is not None and pending.lease == batch.lease:
            self.drop(job_id)
        if self.on_fenced is not None:
            self.on_fenced(job_id, batch.lease)

    def backlog(self) -> tuple[int, float]:
        """Chunk tokens not yet acknowledged by Redis (pending or in flight), and how long the oldest
        entry among them has waited (s; 0 when none waits): the ``slotq_stream_*`` gauges, and what
        ``/ready`` compares with ``SLOTQ_HEALTH_MAX_STALL_S``."""
        oldest = [t for t in (self._since, self._inflight.since if self._inflight else None) if t is not None]
        tokens = self._tokens + (self._inflight.tokens if self._inflight else 0)
        return tokens, time.monotonic() - min(oldest) if oldest else 0.0

    async def _flush_loop(self) -> None:
        """Sleeps while nothing waits; flushes when the policy says so; backs off while Redis is down."""
        backoff = 0.0
        while True:
            if backoff:
                await asyncio.sleep(backoff)
            elif self._inflight is None and not self._pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            else:
                delay = self.policy.due_in(waited_s=time.monotonic() - (self._since or time.monotonic()),
                                           tokens=self._tokens, entries=self._entries, buckets=self._buckets_touched(),
                                           urgent=self._urgent or self._inflight is not None)
                if delay > 0:
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(delay):
                            await self._wake.wait()
                    continue
            ok = await self.flush()
            backoff = 0.0 if ok else min(max(backoff * 2, 0.1), 2.0)
