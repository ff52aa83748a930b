"""The producer API: enqueue jobs, follow their streams, await results, cancel.

    async with await SlotqClient.connect("redis://...") as client:
        job = await client.enqueue(JobRequest(prompt="Hello", max_tokens=64))
        async for text in job.text():
            print(text, end="")
        result = await job.result(timeout=60)

:class:`SyncSlotqClient` offers the same calls for Flask, Django and scripts.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from slotq.engine import GrammarError
from slotq.jobs.errors import (
    JobFailed,
    JobNotFound,
    JobRejected,
    JobTimeout,
    QueueFull,
    QueuePartitionsDiffer,
    QuotaExceeded,
    RedisUnavailable,
    StreamGone,
)
from slotq.jobs.producer.stream_reader import ClusterStreamReader, StreamReader, stream_reader
from slotq.jobs.protocol import catalog, dead_letters, registry, streams
from slotq.jobs.protocol.arq_formats import ResultRecord
from slotq.jobs.protocol.connection import connect, is_transient
from slotq.jobs.protocol.keys import JOB_FUNCTION, partition_of
from slotq.jobs.protocol.partitioned_queue import PartitionedQueue, open_queue, partition_share
from slotq.jobs.protocol.payload import decode_payload, encode_payload
from slotq.jobs.protocol.redis_queue import (
    TOKENS_WINDOW_MS,
    Cancelled,
    Enqueued,
    ReplicasBehind,
    TenantQuotas,
    WaitReplicas,
    not_started,
)
from slotq.jobs.protocol.schemas import (
    AnyJobRequest,
    EmbeddingJobRequest,
    EntryKind,
    JobRequest,
    JobResult,
    JobStatus,
    LaneInfo,
    ModelInfo,
    QueueInfo,
    RerankJobRequest,
    StreamEntry,
    WorkerInfo,
    ranked,
    tenant_job_id,
)
from slotq.jobs.protocol.serialization import deserialize, serialize
from slotq.jobs.protocol.wire import ErrorInfo, FinishReason, Usage
from slotq.jobs.settings import ClientSettings

__all__ = ["EmbeddingResult", "JobFailed", "JobHandle", "JobNotFound", "JobRejected", "JobTimeout", "QueueFull",
           "QuotaExceeded", "RerankResult", "SlotqClient", "StreamGone"]

EmbeddingInputs = str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]

WORKERS_CACHE_S = 5.0     # how long enqueue trusts its last read of the workers' advertised limits
RESULT_OUTAGE_S = 30.0    # result() without a timeout: Redis failing this long in a row ends the wait
RESULT_RETRY_PAUSE_S = 0.2   # result(): between reads while Redis fails

log = logging.getLogger(__name__)


class JobHandle:
    """A job's id plus the calls that concern it."""

    def __init__(self, client: SlotqClient, job_id: str, *, created: bool = True) -> None:
        self.client = client
        self.id = job_id
        self.created = created     # False when an idempotency key matched an existing job

    def stream(self, last_id: str = "0-0") -> AsyncIterator[StreamEntry]:
        return self.client.stream(self.id, last_id=last_id)

    def text(self) -> AsyncIterator[str]:
        return self.client.text(self.id)

    async def result(self, timeout: float | None = None) -> JobResult:
        return await self.client.result(self.id, timeout=timeout)

    async def status(self) -> JobStatus:
        return await self.client.status(self.id)

    async def cancel(self) -> bool:
        return await self.client.cancel(self.id)

    def __repr__(self) -> str:
        return f"JobHandle({self.id!r})"


@dataclass(frozen=True)
class EmbeddingResult:
    """What :meth:`SlotqClient.embed` returns: one vector per input, in input order."""

    job_id: str
    vectors: list[list[float]]
    usage: Usage
    dimensions: int

    @classmethod
    def of(cls, result: JobResult) -> EmbeddingResult:
        """The vectors of a finished embedding job; JobFailed when it failed or was cancelled."""
        if result.status != JobStatus.SUCCEEDED:
            error = result.error
            raise JobFailed(result.id, error.code if error else result.status.value, error.message if error else "")
        return cls(job_id=result.id, vectors=result.vectors(), usage=result.usage, dimensions=result.dimensions or 0)


@dataclass(frozen=True)
class RerankResult:
    """What :meth:`SlotqClient.rerank` returns: one relevance score per document, in document order."""

    job_id: str
    scores: list[float]
    usage: Usage

    @classmethod
    def of(cls, result: JobResult) -> RerankResult:
        """The scores of a finished rerank job; JobFailed when it failed or was cancelled."""
        if result.status != JobStatus.SUCCEEDED:
            error = result.error
            raise JobFailed(result.id, error.code if error else result.status.value, error.message if error else "")
        return cls(job_id=result.id, scores=result.scores, usage=result.usage)

    def ranked(self, top_n: int | None = None) -> list[int]:
        """Document indices, most relevant first (see :func:`~slotq.jobs.protocol.schemas.ranked`)."""
        return ranked(self.scores, top_n)


def embedding_inputs(inputs: EmbeddingInputs) -> list[Any]:
    """``inputs`` as an embedding job holds them: one text, or one token array, becomes a list of one
    (EmbeddingJobRequest then checks the items)."""
    if isinstance(inputs, str):
        return [inputs]
    items = list(inputs)
    return [items] if items and all(isinstance(item, int) for item in items) else items


class SlotqClient:
    """A producer's view of one queue. ``for_queue`` gives a client of another queue (another
    model) on the same connections; only the client that connected closes them."""

    def __init__(self, redis: Redis, settings: ClientSettings, *, owns_connection: bool = True,
                 reader: StreamReader | ClusterStreamReader | None = None) -> None:
        self.redis = redis
        self.settings = settings
        self.queue = open_queue(redis, settings.queue_name, settings.lanes, partitions=settings.queue_partitions,
                                clock_offset_s=settings.clock_offset_s)
        self.reader = reader or stream_reader(redis)   # one XREAD for all streams followed (per bucket on a cluster)
        self._owns_connection = owns_connection
        self._workers_cache: tuple[float, list[WorkerInfo]] | None = None
        self._workers_read: asyncio.Future[list[WorkerInfo]] | None = None

    @classmethod
    async def connect(cls, redis_url: str, settings: ClientSettings | None = None) -> SlotqClient:
        """Connect and check that Redis answers; raises RedisUnavailable within
        ``redis_connect_timeout_s`` when it does not."""
        settings = settings or ClientSettings()
        pool = await connect(redis_url, patient=False, connect_timeout_s=settings.redis_connect_timeout_s,
                             ca_file=settings.redis_ca_file)
        return cls(pool, settings)

    def for_queue(self, queue_name: str) -> SlotqClient:
        """A client of ``queue_name`` sharing this client's connections."""
        return SlotqClient(self.redis, self.settings.model_copy(update={"queue_name": queue_name}),
                           owns_connection=False, reader=self.reader)

    async def close(self) -> None:
        if self._workers_read is not None:
            self._workers_read.cancel()
        if self._owns_connection:
            await self.reader.close()
            await self.redis.aclose()

    async def __aenter__(self) -> SlotqClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ enqueue
    async def enqueue(self, request: JobRequest | str, **fields: Any) -> JobHandle:
        """Queue a job. ``request`` is a JobRequest, or a text plus JobRequest fields; the text is
        sent as the user's chat message (the model's chat template applies, as in llama.cpp's
        conversation mode). For a raw completion prompt pass ``JobRequest(prompt=...)``.

        Raises pydantic.ValidationError (field named), JobRejected (an unknown lane, a limit the
        workers of this queue advertise, e.g. max_tokens beyond their context, or a JSON schema or
        grammar over the structured-output limits, ``SLOTQ_GRAMMAR_*``), QueueFull or
        QuotaExceeded (the request's tenant is at a ``SLOTQ_TENANT_*`` quota); nothing is queued
        then. One enqueue wakes at most one idle worker.
        """
        if isinstance(request, str):
            if "messages" in fields:
                raise TypeError("enqueue() got a text and messages=; give one of them")
            request = JobRequest.model_validate({"messages": [{"role": "user", "content": request}], **fields})
        elif fields:
            request = JobRequest.model_validate({**request.model_dump(exclude_unset=True), **fields})
        self._check_lane(request)
        await self._check_fits(request)
        if request.sampling.json_schema is not None or request.sampling.grammar is not None or request.calls_tools:
            await self._check_constraint(request)
        return await self._submit(request)

    async def enqueue_embedding(self, request: EmbeddingJobRequest | EmbeddingInputs, **fields: Any) -> JobHandle:
        """Queue an embedding job: a request, or its inputs (a text, texts, a token array or token
        arrays) plus EmbeddingJobRequest fields (``truncate``, ``lane``, ``idempotency_key``, ...).
        The queue must be an embedding model's (``slotq worker --embeddings``). Its result holds one
        vector per input (``JobResult.vectors()``). Raises as :meth:`enqueue` does; JobRejected also
        for a text that cannot fit the workers' input limit (unless ``truncate``), or a queue whose
        workers generate text."""
        if not isinstance(request, EmbeddingJobRequest):
            request = EmbeddingJobRequest(inputs=embedding_inputs(request), **fields)
        elif fields:
            request = EmbeddingJobRequest.model_validate({**request.model_dump(exclude_unset=True), **fields})
        self._check_lane(request)
        await self._check_embedding_fits(request)
        return await self._submit(request)

    async def embed(self, inputs: EmbeddingJobRequest | EmbeddingInputs, *, timeout: float | None = None,
                    **fields: Any) -> EmbeddingResult:
        """Enqueue an embedding job and wait for its vectors: ``await client.embed(["a", "b"])``.
        JobFailed if it fails (e.g. an input over the model's limit without ``truncate=True``)."""
        handle = await self.enqueue_embedding(inputs, **fields)
        return EmbeddingResult.of(await handle.result(timeout=timeout))

    async def enqueue_rerank(self, request: RerankJobRequest | str, documents: Sequence[str] = (),
                             **fields: Any) -> JobHandle:
        """Queue a rerank job: a request, or a query, its documents and RerankJobRequest fields (``lane``,
        ``idempotency_key``, ...). The queue must be a reranker's (a worker on a GGUF with rank pooling).
        Its result holds one score per document (``JobResult.scores``, ``JobResult.ranked()``). Raises as
        :meth:`enqueue` does; JobRejected also for a document that, with the query, cannot fit the workers'
        input limit, or a queue whose workers serve another kind of job."""
        if not isinstance(request, RerankJobRequest):
            request = RerankJobRequest(query=request, documents=list(documents), **fields)
        elif fields or documents:
            extra = {"documents": list(documents)} if documents else {}
            request = RerankJobRequest.model_validate({**request.model_dump(exclude_unset=True), **fields, **extra})
        self._check_lane(request)
        await self._check_rerank_fits(request)
        return await self._submit(request)

    async def rerank(self, query: str, documents: Sequence[str], *, timeout: float | None = None,
                     **fields: Any) -> RerankResult:
        """Enqueue a rerank job and wait for its scores: ``await client.rerank("a query", ["doc", "doc"])``.
        JobFailed if it fails (e.g. a document over the model's limit)."""
        handle = await self.enqueue_rerank(query, documents, **fields)
        return RerankResult.of(await handle.result(timeout=timeout))

    async def enqueue_request(self, request: AnyJobRequest) -> JobHandle:
        """Queue a job of any kind, with the checks of its kind's enqueue method."""
        if isinstance(request, EmbeddingJobRequest):
            return await self.enqueue_embedding(request)
        if isinstance(request, RerankJobRequest):
            return await self.enqueue_rerank(request)
        return await self.enqueue(request)

    def _check_lane(self, request: AnyJobRequest) -> None:
        if request.lane not in self.settings.lanes:
            raise JobRejected(f"lane {request.lane!r} is not one of this queue's lanes {self.settings.lanes} "
                              "(SLOTQ_LANES)", field="lane")

    def _tenant_quotas(self) -> TenantQuotas:
        """The quotas this producer's settings apply to each tenant's enqueues."""
        return TenantQuotas(max_waiting=self.settings.tenant_max_waiting,
                            max_in_flight=self.settings.tenant_max_in_flight,
                            tokens_per_min=self.settings.tenant_tokens_per_min)

    async def _submit(self, request: AnyJobRequest) -> JobHandle:
        job_id = tenant_job_id(request.tenant, request.idempotency_key or uuid.uuid4().hex)
        try:
            outcome = await self.queue.enqueue(job_id, JOB_FUNCTION, encode_payload(request), lane=request.lane,
                                               tenant=request.tenant, max_waiting=self.settings.max_queue_length,
                                               serializer=serialize, quotas=self._tenant_quotas(),
                                               tokens=request.quota_tokens(), wait_replicas=self._wait_replicas())
        except ReplicasBehind as exc:
            raise RedisUnavailable(
                f"job {job_id} was enqueued, but only {exc.acknowledged} of {exc.wanted} replicas acknowledged it "
                f"within {self.settings.redis_connect_timeout_s:g} s (SLOTQ_REDIS_WAIT_REPLICAS); a failover now "
                "could lose it") from None
        if outcome == Enqueued.FULL:
            raise await self._queue_full(job_id)
        if outcome in _QUOTA_REFUSALS:
            raise self._quota_exceeded(outcome, request)
        return JobHandle(self, job_id, created=outcome == Enqueued.CREATED)

    async def _queue_full(self, job_id: str) -> QueueFull:
        """Why ``job_id`` was refused: the waiting jobs against ``SLOTQ_MAX_QUEUE_LENGTH``, or of a queue split
        into partitions those of the job's partition against its share of the setting."""
        limit = self.settings.max_queue_length
        if not isinstance(self.queue, PartitionedQueue):
            return QueueFull(not_started(await self.queue.counts()), limit)
        partitions = len(self.queue.partitions)
        partition = partition_of(job_id, partitions)
        depth = not_started(await self.queue.partitions[partition].counts())
        return QueueFull(depth, partition_share(limit, partitions), partition=partition, partitions=partitions,
                         max_queue_length=limit)

    async def _check_constraint(self, request: JobRequest) -> None:
        """Compile the request's JSON schema, grammar or tools' parameters as a worker would, under
        the same limits (``SLOTQ_GRAMMAR_*``), so one a worker would refuse is never queued. Off the
        event loop: a large grammar takes a few hundred milliseconds to refuse. The engine's checkers
        read the engine's types, so the request is read as the engine's parameters first. They are
        imported here, on the first such request: they load llguidance, numpy and jinja2, which a
        producer that never sends a schema or tools need not pay for at import."""
        from slotq.engine.constraints import check_constraint
        from slotq.engine.request import GenerationParams
        from slotq.engine.tools import check_tools

        def check() -> None:
            params = GenerationParams.model_validate(request.model_dump(include=set(GenerationParams.model_fields)))
            check_constraint(params.sampling, self.settings)
            check_tools(params, self.settings)

        try:
            await asyncio.to_thread(check)
        except GrammarError as exc:
            raise JobRejected(str(exc), field=exc.field or "sampling") from None

    def _quota_exceeded(self, outcome: Enqueued, request: AnyJobRequest) -> QuotaExceeded:
        """The refusal of a tenant's quota, saying which limit and when to try again: the tokens
        quota frees at the next minute of the clock; a waiting or in-flight place when one of the
        tenant's jobs starts or ends, which no one can foresee (``retry_after_s`` None)."""
        tenant, s = request.tenant, self.settings
        if outcome == Enqueued.TENANT_TOKENS:
            window_s = TOKENS_WINDOW_MS / 1000
            return QuotaExceeded(
                f"tenant {tenant!r} has used its {s.tenant_tokens_per_min} tokens this minute "
                f"(SLOTQ_TENANT_TOKENS_PER_MIN); this request reserves {request.quota_tokens()} (prompt characters / 4 "
                "+ max_tokens x n)", tenant=tenant, quota="tokens", retry_after_s=window_s - time.time() % window_s)
        if outcome == Enqueued.TENANT_WAITING:
            return QuotaExceeded(f"tenant {tenant!r} already has {s.tenant_max_waiting} jobs waiting to start "
                                 "(SLOTQ_TENANT_MAX_WAITING)", tenant=tenant, quota="waiting", retry_after_s=None)
        return QuotaExceeded(f"tenant {tenant!r} already has {s.tenant_max_in_flight} jobs waiting or running "
                             "(SLOTQ_TENANT_MAX_IN_FLIGHT)", tenant=tenant, quota="in_flight", retry_after_s=None)

    def _wait_replicas(self) -> WaitReplicas | None:
        """Redis replicates asynchronously: a failover right after an enqueue could lose the job. With
        ``redis_wait_replicas``, each enqueue waits until that many replicas have it (bounded by the
        connect timeout)."""
        want = self.settings.redis_wait_replicas
        return WaitReplicas(want, int(self.settings.redis_connect_timeout_s * 1000)) if want else None

    def job(self, job_id: str) -> JobHandle:
        return JobHandle(self, job_id, created=False)

    # ------------------------------------------------------------------ reading
    async def stream(self, job_id: str, *, last_id: str = "0-0", block_ms: int = 1000) -> AsyncIterator[StreamEntry]:
        """Every stream entry after ``last_id`` until the final one. Pass the last id you saw to
        resume after a dropped connection: nothing is missed or repeated. All streams a client
        follows at once share one blocking read (:class:`~slotq.jobs.producer.stream_reader.StreamReader`).

        The iteration ends with the job's final entry and never earlier. If the rest cannot be
        read it raises instead: StreamGone (the stream expired or was trimmed past ``last_id``,
        or the job ended without a final entry), JobNotFound (no such job, and no stream)."""

        async def is_live() -> bool:
            return await self.status(job_id) in (JobStatus.QUEUED, JobStatus.RUNNING)

        try:
            async for entry in self.reader.follow(job_id, last_id=last_id, idle_ms=block_ms, is_live=is_live):
                yield entry
        except StreamGone:
            if not await streams.exists(self.redis, job_id) and await self.status(job_id) is JobStatus.NOT_FOUND:
                raise JobNotFound(job_id) from None      # no stream and no job: a wrong id, or long expired
            raise

    async def text(self, job_id: str) -> AsyncIterator[str]:
        """Just the text of choice 0, as it arrives. Retried attempts continue seamlessly."""
        async for entry in self.stream(job_id):
            if entry.kind == EntryKind.CHUNK and entry.choice == 0 and entry.text:
                yield entry.text

    async def result(self, job_id: str, timeout: float | None = None) -> JobResult:
        """Wait for the job's result. The job's stream doubles as the wake-up signal, so waiting
        costs one blocked XREAD, not a poll loop.

        A Redis error that trying again can outlast (a failover, a restart, a network cut:
        :func:`~slotq.jobs.protocol.connection.is_transient`) does not end the wait the caller asked
        for: each command gives up after the producer's own bound (0.8 x the connect timeout, so an
        enqueue fails fast), but the wait reads again until ``timeout``, or, without one, until Redis
        has failed for :data:`RESULT_OUTAGE_S` in a row. A cluster's failover takes longer than that
        bound (its node timeout and an election), and a wait of 60 s failed in the middle of one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        last_id: str | bytes = "0-0"
        missing = 0
        failing_since: float | None = None
        while True:
            try:
                result = await self._stored_result(job_id)
                if result is not None:
                    return result
                lane, _running = await self.queue.place(job_id)
                missing = missing + 1 if lane is None else 0
                if missing >= 3:   # not a momentary gap (e.g. a cancel between its two writes)
                    raise JobNotFound(job_id)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise JobTimeout(f"job {job_id} did not finish within {timeout} s")
                block = 200 if remaining is None else max(1, min(200, int(remaining * 1000)))
                entries = (await streams.read_new(self.redis, {job_id: last_id}, count=1000,
                                                  block_ms=block)).get(job_id)
            except (RedisError, OSError) as exc:
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                outlasted = now >= deadline if deadline is not None else now - failing_since >= RESULT_OUTAGE_S
                if not is_transient(exc) or outlasted:
                    raise
                log.warning("job %s: waiting for its result, Redis failed (%s); reading again", job_id, exc)
                await asyncio.sleep(RESULT_RETRY_PAUSE_S)
                continue
            failing_since = None
            if entries:
                last_id = entries[-1][0]
                if any(streams.is_final(raw) for _id, raw in entries):
                    await asyncio.sleep(0.002)   # the result lands right after the final entry

    async def status(self, job_id: str) -> JobStatus:
        result = await self._stored_result(job_id)
        if result is not None:
            return result.status
        lane, running = await self.queue.place(job_id)
        if lane is None:
            # It may have finished between the two reads (its result is stored as it leaves the queue).
            result = await self._stored_result(job_id)
            return JobStatus.NOT_FOUND if result is None else result.status
        return JobStatus.RUNNING if running else JobStatus.QUEUED

    async def finished(self, job_ids: Sequence[str]) -> dict[str, JobResult]:
        """The results of those of ``job_ids`` that have finished, in one round trip (no waiting)."""
        records = await self.queue.result_records(job_ids, deserialize)
        return {job_id: _to_job_result(job_id, record) for job_id, record in records.items()}

    async def forget(self, job_ids: Sequence[str]) -> int:
        """Remove finished jobs' results and output streams now rather than when they expire
        (``keep_result_s``, ``stream_ttl_s``): a bulk run calls it once a line's output is safely
        written, so Redis holds no more than the run's window. A job still queued or running is
        left alone. Returns how many jobs were removed."""
        return await self.queue.forget(job_ids)

    async def _stored_result(self, job_id: str) -> JobResult | None:
        record = await self.queue.result_record(job_id, deserialize)
        return None if record is None else _to_job_result(job_id, record)

    # ------------------------------------------------------------------ cancel
    async def cancel(self, job_id: str) -> bool:
        """Cancel a job. A queued job never starts; a running one stops at the next decode step
        and its stream ends with finish_reason 'cancelled'. False if it had already finished; True
        when it ended during this call, cancelled (a worker may act on the abort this call notes
        before the call has told it)."""
        taken = await self.queue.cancel(job_id)
        if taken == Cancelled.ABORTING:
            return True          # running: its worker was told, and it ends the stream itself
        if taken == Cancelled.NOT_IN_QUEUE:
            return False
        if taken == Cancelled.ENDED_MEANWHILE:
            ended = await self._stored_result(job_id)
            return ended is not None and ended.status == JobStatus.CANCELLED
        # The final entry goes first, as a worker writes it: a follower that sees the result
        # then finds the stream's end in place.
        await streams.end_stream(self.redis, job_id, StreamEntry(id="", kind=EntryKind.DONE, attempt=0,
                                                                 finish_reason=FinishReason.CANCELLED, final=True),
                                 maxlen=self.settings.stream_maxlen, ttl_s=self.settings.stream_ttl_s)
        result = JobResult(id=job_id, status=JobStatus.CANCELLED, finish_reason=FinishReason.CANCELLED)
        await self.queue.store_result(job_id, JOB_FUNCTION, result.model_dump(mode="json"),
                                      ttl_ms=self.settings.keep_result_s * 1000, serializer=serialize)
        return True

    async def requeue_dead_letter(self, job_id: str) -> bool:
        """Run a dead-lettered job again under the same id, from scratch, on the queue it ran on
        (its old result and stream are removed). False when the record holds no valid request."""
        letter = await dead_letters.get(self.redis, job_id)
        if letter is None or letter.payload is None:
            return False
        request = decode_payload(letter.payload).request
        if request is None:
            return False
        queue = self.queue if letter.queue in (None, self.settings.queue_name) else self.for_queue(letter.queue).queue
        await queue.clear_job(job_id)
        await queue.enqueue(job_id, JOB_FUNCTION, encode_payload(request), lane=request.lane, tenant=request.tenant,
                            max_waiting=None, serializer=serialize)     # an operator's requeue is never refused
        await dead_letters.remove(self.redis, job_id)
        return True

    # ------------------------------------------------------------------ fleet
    async def workers(self) -> list[WorkerInfo]:
        """Every live worker on this Redis (all queues), from their heartbeats: the worker index
        names those heard from lately (O(workers), never a scan of the keyspace), and a worker's
        own heartbeat hash, which expires three beats after its last, says it is alive
        (:mod:`~slotq.jobs.protocol.registry`)."""
        return await registry.live_workers(self.redis)

    async def _queue_workers(self, request: AnyJobRequest) -> list[WorkerInfo]:
        """The live workers of this queue, or JobRejected when every one serves another kind of job
        (an embedding job sent to a text generator's queue, or the reverse) or another model than
        the one the request names. With none, an empty list. (A worker refuses such a job too, by
        name: this only spares the round trip while the workers are known.)"""
        workers = [w for w in await self._cached_workers() if w.queue == self.settings.queue_name]
        self._check_partitions(workers)
        kind = request.kind
        if workers and all(w.kind != kind for w in workers):
            raise JobRejected(
                f"the workers of queue {self.settings.queue_name!r} (model {workers[0].model}) serve "
                f"{workers[0].kind.value} jobs, not {kind.value} jobs; use the queue of a model that serves them",
                field="model")
        if workers and request.model is not None and all(w.model != request.model for w in workers):
            raise JobRejected(
                f"model {request.model!r} is not served on queue {self.settings.queue_name!r} (its workers serve "
                f"{workers[0].model!r}); use the queue of {request.model!r} (SLOTQ_QUEUE_NAME)", field="model")
        return [w for w in workers if w.kind == kind]

    def _check_partitions(self, workers: list[WorkerInfo]) -> None:
        """Refuse to enqueue into a queue whose live workers split it into another number of partitions
        than this producer (``SLOTQ_QUEUE_PARTITIONS``): its jobs could land in partitions they never claim."""
        differing = [w for w in workers if w.partitions != self.settings.queue_partitions]
        if differing:
            raise QueuePartitionsDiffer(queue=self.settings.queue_name, partitions=self.settings.queue_partitions,
                                        other_partitions=differing[0].partitions, other=f"worker {differing[0].id}")

    async def _check_embedding_fits(self, request: EmbeddingJobRequest) -> None:
        """Refuse a text that cannot fit the largest input limit the queue's workers advertise (its
        characters over that limit times ``max_prompt_chars_per_token``), unless it is to be truncated."""
        contexts = [w.ctx for w in await self._queue_workers(request) if w.ctx]
        if not contexts or request.truncate:
            return
        limit = int(max(contexts) * self.settings.max_prompt_chars_per_token)
        for i, item in enumerate(request.inputs):
            if isinstance(item, str) and len(item) > limit:
                raise JobRejected(
                    f"input {i} has {len(item)} characters, more than the {max(contexts)}-token input limit of queue "
                    f"{self.settings.queue_name!r} can hold ({limit} characters at most, "
                    f"SLOTQ_MAX_PROMPT_CHARS_PER_TOKEN={self.settings.max_prompt_chars_per_token:g}); "
                    "ask to truncate it", field="inputs")

    async def _check_rerank_fits(self, request: RerankJobRequest) -> None:
        """Refuse a document that, with the query, cannot fit the largest input limit the queue's workers
        advertise (its characters over that limit times ``max_prompt_chars_per_token``)."""
        contexts = [w.ctx for w in await self._queue_workers(request) if w.ctx]
        if not contexts:
            return
        limit = int(max(contexts) * self.settings.max_prompt_chars_per_token)
        for i, document in enumerate(request.documents):
            if len(request.query) + len(document) > limit:
                raise JobRejected(
                    f"document {i} and the query have {len(request.query) + len(document)} characters, more than "
                    f"the {max(contexts)}-token input limit of queue {self.settings.queue_name!r} can hold ({limit} "
                    f"characters at most, SLOTQ_MAX_PROMPT_CHARS_PER_TOKEN="
                    f"{self.settings.max_prompt_chars_per_token:g})", field="documents")

    async def _check_fits(self, request: JobRequest) -> None:
        """Refuse what no live worker of this queue could ever run. The prompt's token count is
        only known to a worker, so the checks are ``max_tokens`` against the largest per-sequence
        context advertised (the prompt takes at least one token), and the prompt's characters
        against that context times ``max_prompt_chars_per_token``: a prompt that long cannot fit,
        and refusing it here spares a worker tokenizing megabytes only to say so. With no live
        worker, accept."""
        contexts = [w.ctx for w in await self._queue_workers(request) if w.ctx]
        if not contexts:
            return
        ctx = max(contexts)
        if request.max_tokens >= ctx:
            raise JobRejected(
                f"max_tokens is {request.max_tokens}; the workers of queue {self.settings.queue_name!r} have a "
                f"per-sequence context of {ctx} tokens, which must hold the prompt and max_tokens",
                field="max_tokens")
        chars = request.prompt_chars()
        limit = int(ctx * self.settings.max_prompt_chars_per_token)
        if chars > limit:
            raise JobRejected(
                f"the prompt has {chars} characters, more than the {ctx}-token context of queue "
                f"{self.settings.queue_name!r} can hold ({limit} characters at most, "
                f"SLOTQ_MAX_PROMPT_CHARS_PER_TOKEN={self.settings.max_prompt_chars_per_token:g})",
                field="prompt" if request.prompt is not None else "messages")

    async def _cached_workers(self) -> list[WorkerInfo]:
        """The live workers, re-read at most every WORKERS_CACHE_S. Enqueues that find the cache
        stale at the same time share one read: at hundreds of enqueues a second, each starting
        its own read stampeded Redis with SCANs (found by ``slotq bench fleet``)."""
        now = time.monotonic()
        if self._workers_cache is not None and now - self._workers_cache[0] <= WORKERS_CACHE_S:
            return self._workers_cache[1]
        if self._workers_read is None or self._workers_read.done():
            self._workers_read = asyncio.ensure_future(self.workers())
            # Its waiters may all be cancelled; an error nobody awaited then is not worth a log line.
            self._workers_read.add_done_callback(lambda f: f.cancelled() or f.exception())
        workers = await asyncio.shield(self._workers_read)   # a cancelled enqueue leaves the read to the others
        self._workers_cache = (now, workers)
        return workers

    async def queue_info(self) -> QueueInfo:
        """Counts per lane (each O(1)), the oldest waiting job, live workers, dead letters, and the
        attempts lost to interruptions apart from those that spent a try."""
        lanes = [LaneInfo(lane=c.lane, queued=c.waiting, deferred=c.deferred, running=c.running,
                          oldest_queued_age_s=c.oldest_waiting_age_s, preempted=c.preempted)
                 for c in await self.queue.counts()]
        outcomes = await self.queue.attempt_outcomes()
        return QueueInfo(
            queue=self.settings.queue_name,
            lanes=lanes,
            workers=[w for w in await self.workers() if w.queue == self.settings.queue_name],
            dead_letters=await dead_letters.count(self.redis),
            dead_letters_by_reason=await dead_letters.by_reason(self.redis),
            interrupted_attempts=outcomes.interrupted,
            failed_attempts=outcomes.failed,
        )

    async def models(self) -> list[ModelInfo]:
        """Every model the fleet can serve, by name: each live worker's catalog entries (the models it
        can load, loaded or not), with the jobs waiting in each model's queue (O(lanes) per model) and
        which live workers have it loaded. A model no worker has loaded but whose jobs wait is the
        demand a worker of several models switches to (:mod:`slotq.jobs.worker.model_switch`)."""
        offers = await catalog.read(self.redis, now=time.time())
        workers = await self.workers()
        models = []
        for name, offer in offers.items():
            lanes = await open_queue(self.redis, offer.queue, self.settings.lanes,
                                     partitions=self.settings.queue_partitions).counts()
            loaded = [w for w in workers if w.model == name and w.queue == offer.queue]
            ages = [lane.oldest_waiting_age_s for lane in lanes if lane.oldest_waiting_age_s is not None]
            loads = [s for s in (offer.load_s, *(w.load_s for w in loaded)) if s is not None]
            models.append(ModelInfo(
                model=name, queue=offer.queue, kind=offer.kind, fingerprint=offer.fingerprint,
                status="loaded" if any(w.ready for w in loaded) else "loading" if loaded else "unloaded",
                loaded_on=[w.id for w in loaded], can_load=list(offer.workers),
                queued=sum(lane.waiting for lane in lanes), deferred=sum(lane.deferred for lane in lanes),
                running=sum(lane.running for lane in lanes), oldest_queued_age_s=max(ages) if ages else None,
                load_s=min(loads) if loads else None))
        return models


_QUOTA_REFUSALS = frozenset({Enqueued.TENANT_WAITING, Enqueued.TENANT_IN_FLIGHT, Enqueued.TENANT_TOKENS})


def _to_job_result(job_id: str, record: ResultRecord) -> JobResult:
    """Our job function returns a JobResult; the runtime stores a failure instead when it ended a
    job without one (expired, aborted, out of tries, timed out)."""
    if record.output is not None and "status" in record.output:
        return JobResult.model_validate(record.output)
    if record.cancelled:
        return JobResult(id=job_id, status=JobStatus.CANCELLED, finish_reason=FinishReason.CANCELLED,
                         attempts=record.attempts)
    error = ErrorInfo(code=(record.error or "job_failed").lower(), message=record.message or record.error,
                      retryable=False)
    return JobResult(id=job_id, status=JobStatus.FAILED, finish_reason=FinishReason.ERROR, attempts=record.attempts,
                     error=error)
