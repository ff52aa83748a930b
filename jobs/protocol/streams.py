"""The per-job output stream (``slotq:stream:{job_id}``; on a Redis Cluster in a stream bucket,
:func:`~slotq.jobs.protocol.keys.stream_key`): its entry codec, the scripts that fence and append
to it, and every read of it.

Writers send entries through :class:`StreamAppender` (the ``STREAM_FLUSH`` script: many jobs'
entries, each job fenced by its lease in the fences hash beside its stream, in one round trip; on a
Redis Cluster one script per node for the stream buckets it serves, ``NODE_STREAM_FLUSH``, sent
together). The worker's batching writer (:class:`~slotq.jobs.worker.stream_writer.StreamWriter`)
decides when; this module only encodes. Readers use plain XREAD from their last id (no consumer
groups; :mod:`slotq.jobs.producer.stream_reader`): any number of readers, each can drop and resume
without gaps or repeats, and an HTTP gateway can use the entry id as the SSE event id. Reads return
entries as Redis gives them (:data:`RawEntry`), so a reader that only needs an id or
:func:`is_final` decodes nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError, ResponseError, SlotNotCoveredError

from slotq.jobs.protocol.connection import is_cluster, is_transient
from slotq.jobs.protocol.keys import fences_key, stream_bucket, stream_key, write_mark_key
from slotq.jobs.protocol.schemas import EntryKind, StreamEntry
from slotq.jobs.protocol.scripts.layout import ScriptRunner
from slotq.jobs.protocol.scripts.stream_flush import NodeStreamFlush, OpenStreams, StreamFlush
from slotq.jobs.protocol.wire import ErrorInfo, FinishReason, Timings, TokenLogprob, ToolCallDelta, TopLogprob, Usage

log = logging.getLogger(__name__)

T = TypeVar("T")
RawEntry = tuple[bytes, dict[bytes, bytes]]     # (entry id, fields) as XRANGE and XREAD return them
RETRY_S = 0.2                                   # between tries of a flush while Redis is unreachable


# ---------------------------------------------------------------------- the codec
def encode_chunk(*, attempt: int, choice: int, text: str, token_ids: Sequence[int], n_tokens: int,
                 reasoning: str = "", tool_calls: Sequence[ToolCallDelta] = (),
                 logprobs: Sequence[TokenLogprob] | None = None, prompt_tokens: int = 0,
                 cached_prompt_tokens: int = 0) -> dict[str, str]:
    """A chunk's fields, built without a StreamEntry: the worker's writer merges tokens into
    chunks on its per-token path and encodes each chunk once, here. Reasoning (``r``) and tool call
    pieces (``tc``) are written only when there are some, so plain text costs nothing more, and an
    entry without them (from an older worker too) decodes as none; so are logprobs (``lp``), only
    for a job that asked for them; so are a choice's prompt tokens and those of them cached (``p``,
    ``pc``), on its first chunk of an attempt (``prompt_tokens`` 0: not this chunk)."""
    fields = {"k": EntryKind.CHUNK.value, "a": str(attempt), "c": str(choice), "t": text,
              "ids": " ".join(map(str, token_ids)), "n": str(n_tokens)}
    if reasoning:
        fields["r"] = reasoning
    if tool_calls:
        fields["tc"] = json.dumps([_tool_call_fields(d) for d in merge_tool_call_deltas(tool_calls)],
                                  ensure_ascii=False, separators=(",", ":"))
    if logprobs is not None:
        fields["lp"] = encode_logprobs(logprobs)
    if prompt_tokens:
        fields["p"], fields["pc"] = str(prompt_tokens), str(cached_prompt_tokens)
    return fields


def merge_tool_call_deltas(deltas: Iterable[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive pieces of one call's arguments as one piece (what a merged chunk carries)."""
    merged: list[ToolCallDelta] = []
    for delta in deltas:
        last = merged[-1] if merged else None
        if last is not None and last.index == delta.index and delta.id is None and delta.name is None:
            merged[-1] = replace(last, arguments=last.arguments + delta.arguments)
        else:
            merged.append(delta)
    return merged


def _tool_call_fields(delta: ToolCallDelta) -> dict[str, Any]:
    fields: dict[str, Any] = {"i": delta.index, "a": delta.arguments}
    if delta.id is not None:
        fields["id"] = delta.id
    if delta.name is not None:
        fields["n"] = delta.name
    return fields


def _tool_call_deltas(raw: str | None) -> list[ToolCallDelta]:
    return [ToolCallDelta(index=d["i"], id=d.get("id"), name=d.get("n"), arguments=d.get("a", ""))
            for d in json.loads(raw)] if raw else []


def encode_logprobs(logprobs: Sequence[TokenLogprob]) -> str:
    """Compact JSON, one array per token: ``[id, logprob, token, [alternatives]]``, each alternative
    ``[id, logprob, token]``; an entry's bytes follow as its last element only when they are not
    the UTF-8 of its token (a piece of a character, shown as ``bytes:\\x..``)."""
    def short(entry: TopLogprob, *more: object) -> list[object]:
        fields = [entry.id, entry.logprob, entry.token, *more]
        return fields if entry.token.encode("utf-8") == bytes(entry.token_bytes) else [*fields, entry.token_bytes]

    return json.dumps([short(lp, [short(alt) for alt in lp.top]) for lp in logprobs], ensure_ascii=False,
                      separators=(",", ":"))


def decode_logprobs(raw: str) -> list[TokenLogprob]:
    """The inverse of :func:`encode_logprobs`."""
    def entry(id_: int, logprob: float, token: str, *token_bytes: list[int]) -> dict[str, Any]:
        return {"id": id_, "logprob": logprob, "token": token,
                "token_bytes": token_bytes[0] if token_bytes else list(token.encode("utf-8"))}

    return [TokenLogprob(**entry(id_, logprob, token, *rest), top=[TopLogprob(**entry(*alt)) for alt in alts])
            for id_, logprob, token, alts, *rest in json.loads(raw)]


def encode_entry(entry: StreamEntry) -> dict[str, str]:
    """Flat string fields, readable with redis-cli."""
    if entry.kind == EntryKind.CHUNK:
        fields = encode_chunk(attempt=entry.attempt, choice=entry.choice, text=entry.text, token_ids=entry.token_ids,
                              n_tokens=entry.n_tokens, reasoning=entry.reasoning, tool_calls=entry.tool_calls,
                              logprobs=entry.logprobs, prompt_tokens=entry.prompt_tokens or 0,
                              cached_prompt_tokens=entry.cached_prompt_tokens)
    else:
        fields = {"k": entry.kind.value, "a": str(entry.attempt), "c": str(entry.choice)}
    if entry.finish_reason is not None:
        fields["fr"] = entry.finish_reason.value
    if entry.stop_sequence is not None:
        fields["ss"] = entry.stop_sequence
    if entry.usage is not None:
        fields["u"] = entry.usage.model_dump_json()
    if entry.timings is not None:
        fields["tm"] = entry.timings.model_dump_json()
    if entry.error is not None:
        fields["e"] = entry.error.model_dump_json()
    if entry.worker is not None:
        fields["w"] = entry.worker
    if entry.model is not None:
        fields["m"] = entry.model
    if entry.model_fingerprint is not None:
        fields["mf"] = entry.model_fingerprint
    if entry.final:
        fields["f"] = "1"
    return fields


def decode_entry(entry_id: bytes | str, raw: Mapping[Any, Any]) -> StreamEntry:
    """An entry from its id and fields, as bytes (XRANGE, XREAD) or as text."""
    f = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
         for k, v in raw.items()}
    ids = f.get("ids", "")
    return StreamEntry(
        id=entry_id.decode() if isinstance(entry_id, bytes) else entry_id,
        kind=EntryKind(f["k"]),
        attempt=int(f.get("a", 1)),
        choice=int(f.get("c", 0)),
        text=f.get("t", ""),
        reasoning=f.get("r", ""),
        tool_calls=_tool_call_deltas(f.get("tc")),
        token_ids=[int(x) for x in ids.split()] if ids else [],
        n_tokens=int(f.get("n", 0)),
        logprobs=decode_logprobs(f["lp"]) if "lp" in f else None,
        prompt_tokens=int(f["p"]) if "p" in f else None,
        cached_prompt_tokens=int(f.get("pc", 0)),
        finish_reason=FinishReason(f["fr"]) if "fr" in f else None,
        stop_sequence=f.get("ss"),
        usage=Usage.model_validate_json(f["u"]) if "u" in f else None,
        timings=Timings.model_validate_json(f["tm"]) if "tm" in f else None,
        error=ErrorInfo.model_validate_json(f["e"]) if "e" in f else None,
        worker=f.get("w"),
        model=f.get("m"),
        model_fingerprint=f.get("mf"),
        final=f.get("f") == "1",
    )


def is_final(raw: Mapping[Any, Any]) -> bool:
    """Whether an entry as XREAD/XRANGE return it is the stream's final one, without decoding it."""
    return raw.get(b"f", raw.get("f")) in (b"1", "1")


# ---------------------------------------------------------------------- appending
class TTL(IntEnum):
    """What an append does to a job's stream expiry (only where it changes: not on every chunk)."""

    KEEP = 0
    LIVE = 1      # the first write of this writer: the stream outlives any attempt (ttl_live_s)
    FINAL = 2     # the final entry: the stream now lives ttl_s


@dataclass(frozen=True)
class JobEntries:
    """One job's part of an append: its encoded entries (:func:`encode_entry`, :func:`encode_chunk`),
    the lease they are fenced by ('' = not fenced) and what to do to the stream's expiry."""

    job_id: str
    lease: str
    ttl: TTL
    entries: Sequence[Mapping[str, str]]


_Bucket = tuple[int | None, list[JobEntries]]     # a stream bucket (None on a single Redis), its jobs of a flush


class StreamAppender:
    """Appends the entries of many jobs in one round trip (``STREAM_FLUSH``).

    A job with a lease is written only while its fence holds that lease (:func:`open_streams`, and
    :mod:`slotq.jobs.protocol.scripts.stream_flush` for why). Each flush has an id; the script
    records the last one it applied under ``writer_id`` with its answer, and answers an id it has
    already applied from that record, so a flush re-sent after a lost reply is never appended
    twice. On a Redis Cluster the jobs are sent as one script per node, for the stream buckets it
    serves, all at once (the record is then one per call, in the slot of its first bucket). Redis
    errors are raised: retrying is the caller's choice.
    """

    def __init__(self, redis: Redis, *, writer_id: str, maxlen: int, ttl_s: int, ttl_live_s: int | None = None) -> None:
        self.redis = redis
        self.writer_id = writer_id
        self.maxlen = maxlen
        self.ttl_s = ttl_s
        self.ttl_live_s = ttl_live_s or ttl_s
        self._scripts = ScriptRunner(redis)
        # the last flush sent: its id and its calls, each a list of stream buckets (one call on a single Redis)
        self._sent: tuple[str, list[list[int | None]]] | None = None

    async def append(self, flush_id: str, jobs: Sequence[JobEntries]) -> list[bool]:
        """Send one flush; per job, whether its entries were written (False: fenced off).

        On a cluster the buckets one node serves (by the client's slot map) go in one call,
        :class:`NodeStreamFlush` (a node with one bucket gets a plain ``STREAM_FLUSH``), the nodes' calls
        at once. A flush sent again (the same id: its reply was lost) goes in the same calls as the last
        time, so each call's flush mark answers it. A node call its node refuses -- a bucket's slot moved
        or is migrating, so the script stopped before writing anything -- may still have been applied by
        an earlier send of the same flush: its mark says so, and is read first (the cluster client finds
        the mark's slot wherever it is now). If it was not, its buckets go one by one, one
        ``STREAM_FLUSH`` each, which the client routes by each bucket's own slot, following MOVED and
        ASK, and the flush keeps that grouping if it is sent again; the next flush groups by the map the
        client has learnt by then."""
        nodes = self._groups(flush_id, by_bucket(self.redis, jobs, lambda job: job.job_id))
        replies = await self._scripts.run_all([self._call(flush_id, node) for node in nodes], return_refusals=True)
        answered: list[tuple[list[_Bucket], Any]] = []
        refused: list[_Bucket] = []
        for node, reply in zip(nodes, replies):
            if not isinstance(reply, ResponseError):
                answered.append((node, reply))
            elif len(node) == 1:
                raise reply                    # one bucket's own call: its error is the flush's
            elif (recorded := await self._recorded(flush_id, node)) is not None:
                answered.append((node, recorded))
            else:
                log.info("stream flush %s: a node refused the call for buckets %s (%s); sent bucket by bucket",
                         flush_id, [bucket for bucket, _ in node], reply)
                refused += node
        if refused:
            alone = {bucket for bucket, _ in refused}
            kept = [group for group in (self._sent[1] if self._sent else []) if not alone & set(group)]
            self._sent = (flush_id, kept + [[bucket] for bucket, _ in refused])    # if sent again: one by one
            answers = await self._scripts.run_all([self._call(flush_id, [bucket]) for bucket in refused])
            answered += [([bucket], answer) for bucket, answer in zip(refused, answers)]
        written: dict[str, bool] = {}
        for node, answer in answered:
            text = answer.decode() if isinstance(answer, bytes) else answer
            written.update((job.job_id, ok == "1") for job, ok in zip((j for _, g in node for j in g), text))
        return [written[job.job_id] for job in jobs]

    def _groups(self, flush_id: str, buckets: list[_Bucket]) -> list[list[_Bucket]]:
        """The calls of a flush: as the last time for a flush sent again (its marks are where it wrote them),
        else by node (:meth:`_by_node`)."""
        by_number = dict(buckets)
        if self._sent is not None and self._sent[0] == flush_id and \
                {bucket for group in self._sent[1] for bucket in group} == set(by_number):
            layout = self._sent[1]
        else:
            layout = [[bucket for bucket, _ in node] for node in self._by_node(buckets)]
        self._sent = (flush_id, layout)
        return [[(bucket, by_number[bucket]) for bucket in group] for group in layout]

    async def _recorded(self, flush_id: str, node: list[_Bucket]) -> str | None:
        """The answer a node call of ``flush_id`` left in its flush mark, if an earlier send applied it."""
        mark = await self.redis.get(write_mark_key(self.writer_id, node[0][0]))
        text = mark.decode() if isinstance(mark, bytes) else mark
        prefix = f"{flush_id}|"
        return text[len(prefix):] if text is not None and text.startswith(prefix) else None

    def _by_node(self, buckets: list[_Bucket]) -> list[list[_Bucket]]:
        """``buckets`` grouped by the node that serves their slot now, as the cluster client's slot map
        says (one group per bucket on a single Redis, which has one bucket)."""
        if not isinstance(self.redis, RedisCluster):
            return [[bucket] for bucket in buckets]
        nodes: dict[str, list[_Bucket]] = {}
        for bucket in buckets:
            try:
                node = self.redis.get_node_from_key(fences_key(bucket[0]))
            except SlotNotCoveredError:
                node = None
            # a slot no node serves, as far as the client knows: a call of its own, which the client routes
            nodes.setdefault(node.name if node else f"bucket {bucket[0]}", []).append(bucket)
        return list(nodes.values())

    def _call(self, flush_id: str, buckets: list[_Bucket]) -> StreamFlush | NodeStreamFlush:
        """The call that writes ``buckets`` (of one node): ``STREAM_FLUSH`` for one bucket,
        ``NODE_STREAM_FLUSH`` for several."""
        jobs = [job for _, group in buckets for job in group]
        entries: list[str | int] = []
        for job in jobs:
            for fields in job.entries:
                entries.append(2 * len(fields))
                for name, value in fields.items():
                    entries += [name, value]
        clustered = is_cluster(self.redis)
        per_job: dict[str, Any] = dict(
            streams=[stream_key(job.job_id, clustered=clustered) for job in jobs], flush_id=flush_id,
            maxlen=self.maxlen, live_ttl_s=self.ttl_live_s, final_ttl_s=self.ttl_s,
            job_ids=[job.job_id for job in jobs], leases=[job.lease for job in jobs],
            ttls=[int(job.ttl) for job in jobs], entry_counts=[len(job.entries) for job in jobs], entries=entries)
        if len(buckets) == 1:
            bucket = buckets[0][0]
            return StreamFlush(flush_mark=write_mark_key(self.writer_id, bucket), fences=fences_key(bucket), **per_job)
        return NodeStreamFlush(flush_mark=write_mark_key(self.writer_id, buckets[0][0]),
                               bucket_fences=[fences_key(b) for b, _ in buckets],
                               bucket_jobs=[len(group) for _, group in buckets], **per_job)

    async def open_streams(self, leases: Mapping[str, str]) -> dict[str, StreamOpening]:
        """:func:`open_streams` with this appender's runner, the fences living as long as a live stream."""
        return await open_streams(self.redis, leases, ttl_s=self.ttl_live_s, scripts=self._scripts)


def by_bucket(redis: Redis, items: Sequence[T], job_id: Callable[[T], str]) -> list[tuple[int | None, list[T]]]:
    """``items`` in groups whose job keys (stream, fence) share one hash slot, for one script each,
    with their stream bucket: every item in one group (bucket None) on a single Redis, one group per
    stream bucket on a cluster."""
    if not is_cluster(redis):
        return [(None, list(items))] if items else []
    groups: dict[int | None, list[T]] = {}
    for item in items:
        groups.setdefault(stream_bucket(job_id(item)), []).append(item)
    return list(groups.items())


@dataclass(frozen=True)
class StreamOpening:
    """What a claim found when it raised its job's fence (:func:`open_streams`): whether the fence
    rose (False: a newer claim holds it, so this claim lost the job and read nothing), the stream's
    entries, and whether MAXLEN trimming dropped any of its entries (a stream that holds none: False)."""

    raised: bool
    entries: list[StreamEntry] = field(default_factory=list)
    trimmed: bool = False


async def open_streams(redis: Redis, leases: Mapping[str, str], *, ttl_s: int,
                       scripts: ScriptRunner | None = None) -> dict[str, StreamOpening]:
    """Raise the fence of each job (job id -> its new claim's lease) and read its stream, for its
    attempt to resume from, in one step (``OPEN_STREAMS``: no write of an older claim can land between
    the two); one script per stream bucket, all in one round trip. ``scripts``: the caller's runner,
    whose scripts are loaded already."""
    scripts = scripts or ScriptRunner(redis)
    clustered = is_cluster(redis)
    groups = by_bucket(redis, list(leases), lambda job_id: job_id)
    answers = await scripts.run_all([OpenStreams(fences=fences_key(bucket),
                                                 streams=[stream_key(job_id, clustered=clustered) for job_id in group],
                                                 job_ids=group, leases=[leases[job_id] for job_id in group],
                                                 ttl_s=ttl_s)
                                     for bucket, group in groups])
    opened: dict[str, StreamOpening] = {}
    for (_, group), answer in zip(groups, answers):
        for job_id, (raised, *found) in zip(group, answer):
            if not raised:
                opened[job_id] = StreamOpening(raised=False)
                continue
            trimmed, entries = found
            opened[job_id] = StreamOpening(raised=True, trimmed=bool(trimmed), entries=[
                decode_entry(entry_id, dict(zip(flat[::2], flat[1::2]))) for entry_id, flat in entries])
    return opened


async def end_stream(redis: Redis, job_id: str, entry: StreamEntry, *, maxlen: int, ttl_s: int) -> None:
    """Append a job's final ``entry`` from outside any worker (a producer cancelling a job no
    worker runs): not fenced, and the stream then lives ``ttl_s``. Like the worker's writer, it
    re-sends the same flush while Redis is unreachable and returns once it is acknowledged: the job
    has left the queue, and its followers wait for this entry. An error no retry outlasts (a Lua
    error, OOM, WRONGTYPE: :func:`~slotq.jobs.protocol.connection.is_transient`) is raised at once."""
    writer_id = uuid.uuid4().hex
    appender = StreamAppender(redis, writer_id=writer_id, maxlen=maxlen, ttl_s=ttl_s)
    jobs = [JobEntries(job_id, "", TTL.FINAL, [encode_entry(entry)])]
    while True:
        try:
            await appender.append(f"{writer_id}:0", jobs)
            return
        except (RedisError, OSError) as exc:
            if not is_transient(exc):
                raise
            log.warning("stream flush failed (%s); %d jobs buffered", type(exc).__name__, len(jobs))
            await asyncio.sleep(RETRY_S)


# ---------------------------------------------------------------------- reading
# Each read takes ``clustered``: whether the keys are a cluster's (:func:`~slotq.jobs.protocol.keys.stream_key`).
# None: as ``redis`` is; a reader on a plain client of one cluster node passes True.
def _key(redis: Redis, job_id: str, clustered: bool | None) -> str:
    return stream_key(job_id, clustered=is_cluster(redis) if clustered is None else clustered)


async def read_all(redis: Redis, job_id: str, *, clustered: bool | None = None) -> list[StreamEntry]:
    """Every entry the job's stream holds, decoded (one XRANGE)."""
    return [decode_entry(entry_id, raw) for entry_id, raw in await redis.xrange(_key(redis, job_id, clustered))]


async def read_after(redis: Redis, job_id: str, after: str, *, page: int,
                     clustered: bool | None = None) -> list[RawEntry]:
    """Every entry after the id ``after``, read in XRANGE pages of ``page`` entries."""
    key = _key(redis, job_id, clustered)
    rest: list[RawEntry] = []
    start = f"({after}"
    while entries := await redis.xrange(key, min=start, count=page):
        rest += entries
        last = entries[-1][0]
        start = f"({last.decode() if isinstance(last, bytes) else last}"
    return rest


async def read_last(redis: Redis, job_id: str, *, clustered: bool | None = None) -> RawEntry | None:
    """The stream's newest entry, None when it holds none (one XREVRANGE)."""
    last = await redis.xrevrange(_key(redis, job_id, clustered), count=1)
    return last[0] if last else None


async def read_new(redis: Redis, after: Mapping[str, str | bytes], *, count: int, block_ms: int,
                   clustered: bool | None = None) -> dict[str, list[RawEntry]]:
    """One XREAD of the streams of the jobs in ``after`` (job id -> the last entry id seen),
    blocking up to ``block_ms`` for news; the entries per job id, only for jobs that have some. On a
    cluster the jobs must share a stream bucket (one XREAD covers one slot)."""
    by_key = {_key(redis, job_id, clustered): job_id for job_id in after}
    response = await redis.xread({_key(redis, job_id, clustered): last for job_id, last in after.items()},
                                 count=count, block=block_ms)
    out: dict[str, list[RawEntry]] = {}
    for raw_key, entries in response or ():
        out[by_key[raw_key.decode() if isinstance(raw_key, bytes) else raw_key]] = entries
    return out


async def exists(redis: Redis, job_id: str, *, clustered: bool | None = None) -> bool:
    return bool(await redis.exists(_key(redis, job_id, clustered)))


@dataclass(frozen=True)
class StreamStart:
    """Where a stream now starts: its oldest entry's id, and whether MAXLEN trimming dropped entries."""

    first_id: str | None
    trimmed: bool


async def stream_start(redis: Redis, job_id: str, *, clustered: bool | None = None) -> StreamStart | None:
    """Where the job's stream starts (one XINFO STREAM); None when there is no such stream."""
    try:
        info = await redis.xinfo_stream(_key(redis, job_id, clustered))
    except ResponseError:
        return None                               # no such key (yet)
    first = info.get("first-entry")
    first_id = None
    if first:
        first_id = first[0].decode() if isinstance(first[0], bytes) else first[0]
    return StreamStart(first_id, int(info.get("entries-added", 0)) > int(info.get("length", 0)))
