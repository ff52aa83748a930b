"""slotq's queue on Redis: enqueue, claim, lease renewal, finish/retry/hand-back, reaping, cancel,
and O(1) counts. Producers and workers both use it; it knows Redis, not the engine.

Why slotq claims jobs itself instead of arq's poll: arq keeps running jobs at the head of its
queue's sorted set, so every poll re-reads every running job (``queue_read_limit``), each enqueue
woke every worker, and each claim cost several round trips per candidate. Here waiting, deferred
and running jobs live in separate sets per lane, one script claims up to k jobs in one round trip
whatever else is running, an idle worker waits on a blocking pop of a wake token (one enqueue
wakes one worker), and a reaper returns expired leases. arq stays the runtime that runs a claimed
job (its ``run_job``: the job record, the attempt counter, timeouts, abort, the result record); see
:mod:`slotq.jobs.protocol.arq_adapter`. The records it writes and reads are arq's formats
(:mod:`slotq.jobs.protocol.arq_formats`), so a producer loads no arq.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import TYPE_CHECKING, Any, cast

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from slotq.jobs.protocol.arq_formats import (
    Deserializer,
    ResultRecord,
    Serializer,
    job_record,
    read_result_record,
    result_record,
)
from slotq.jobs.protocol.connection import is_cluster, subscriber
from slotq.jobs.protocol.keys import (
    ABORTS,
    DEFAULT_TENANT,
    QueueKeys,
    job_fences_key,
    job_record_key,
    result_key,
    retry_counter_key,
    stream_key,
)
from slotq.jobs.protocol.replies import reply
from slotq.jobs.protocol.scripts.admission import Cancel, DropAbort, Enqueue, Forget, NoteAbort
from slotq.jobs.protocol.scripts.attempts import Finish, HandBack, Reap, Renew, RetryLater, StartAttempt
from slotq.jobs.protocol.scripts.claims import Claim, ClaimReply, LendReserve, Preempt
from slotq.jobs.protocol.scripts.layout import ScriptRunner

if TYPE_CHECKING:
    from slotq.jobs.protocol.partitioned_queue import PartitionedQueue

WAKE_CAP = 10_000              # wake (and per-lane preemption) tokens kept at most (one per waiting job below that)
PROMOTE_LIMIT = 100            # due retries moved to waiting per lane per claim or reap
REAP_LIMIT = 100               # expired leases requeued per lane per reap
RECORD_TTL_MS = 7 * 86_400_000  # a job not claimed within a week expires (arq fails it as "job expired")
TOKENS_WINDOW_MS = 60_000       # the tokens quota's window: a fixed minute of Redis' clock


class Enqueued(Enum):
    CREATED = 1
    EXISTS = 0        # the id is taken: a job still in the queue, or a kept result (idempotency)
    FULL = -1
    TENANT_WAITING = -2     # refused by a tenant's quota: jobs waiting,
    TENANT_IN_FLIGHT = -3   # jobs waiting or running,
    TENANT_TOKENS = -4      # tokens admitted this minute


@dataclass(frozen=True)
class TenantQuotas:
    """What one tenant may hold of the queue, checked by ENQUEUE in the step that counts the job,
    so two enqueues can never both take a tenant's last place (None: no limit).

    ``max_waiting``: its jobs waiting or deferred. ``max_in_flight``: its jobs waiting or running --
    a job counts from its enqueue, so no more than this many ever run at once. ``tokens_per_min``:
    the tokens its jobs may reserve per minute of the clock (what a job reserves is the producer's
    choice, see :meth:`slotq.jobs.protocol.schemas.JobRequest.quota_tokens`)."""

    max_waiting: int | None = None
    max_in_flight: int | None = None
    tokens_per_min: int | None = None


NO_QUOTAS = TenantQuotas()


@dataclass(frozen=True)
class WaitReplicas:
    """Wait after an enqueue until ``replicas`` replicas have it, at most ``timeout_ms``
    (``SLOTQ_REDIS_WAIT_REPLICAS``): Redis replicates asynchronously, so a failover right after an
    enqueue could lose the job."""

    replicas: int
    timeout_ms: int


class ReplicasBehind(Exception):
    """The job was enqueued (or already was), but only ``acknowledged`` of the ``wanted`` replicas
    acknowledged it within the timeout: a failover now could lose it."""

    def __init__(self, acknowledged: int, wanted: int) -> None:
        super().__init__(f"{acknowledged} of {wanted} replicas acknowledged the enqueue")
        self.acknowledged = acknowledged
        self.wanted = wanted


@dataclass(frozen=True)
class TenantCounts:
    waiting: int        # waiting or deferred
    running: int


@dataclass(frozen=True)
class ClaimedJob:
    """One claim of a job: ``lease`` (``<worker token>#<claim number>``) fences every write the
    attempt makes, so a later claim of the same job -- by any worker, this one included -- shuts
    this attempt out."""

    id: str
    lane: str
    ready_ms: int                   # when it became ready to claim (enqueued, or its retry due): Redis' clock
    lease: str
    claimed_ms: int                 # when it was claimed, Redis' clock: claimed_ms - ready_ms is its wait
    lent_reserve: bool = False      # claimed by LEND_RESERVE: its engine request is lent the reserve


@dataclass(frozen=True)
class BusyToken:
    """A token a full worker took: a job of ``lane`` waits that it may give a lower lane's slot
    (a preemption token, ``fair`` False) or run in its reserve for a tenant with nothing running
    (a fair-share token, ``fair`` True). ``partition``: the partition of a partitioned queue it came from
    (:class:`~slotq.jobs.protocol.partitioned_queue.PartitionedQueue`), where it is returned."""

    lane: str
    fair: bool
    partition: int = 0


@dataclass(frozen=True)
class LaneCounts:
    lane: str
    waiting: int
    deferred: int
    running: int
    oldest_waiting_age_s: float | None   # how long the job next in line has been ready (Redis' clock)
    preempted: int = 0                   # jobs of this lane that yielded their slot to a higher lane, ever


def not_started(counts: Iterable[LaneCounts]) -> int:
    """The jobs of these lanes not started yet, waiting or deferred: what a queue's length limit counts,
    and what a worker waits to see at zero before it may leave its model."""
    return sum(lane.waiting + lane.deferred for lane in counts)


class Cancelled(IntEnum):
    """What :meth:`RedisQueue.cancel` found (CANCEL's reply, but for ``ENDED_MEANWHILE``)."""

    NOT_IN_QUEUE = 0        # finished before the call, or never enqueued
    REMOVED = 1             # removed before it started (or while it waited out a retry)
    ABORTING = -1           # running: its worker was told to abort it, and ends it
    ENDED_MEANWHILE = 2     # in the queue as the call began, gone when CANCEL ran: it ended on its own, or
    #                         by this call's abort (a worker's tick acts on the noted abort alone); its
    #                         result says which


class AttemptVerdict(Enum):
    """What ``START_ATTEMPT`` decided about an attempt (see
    :class:`~slotq.jobs.protocol.scripts.attempts.StartAttempt`)."""

    LEASE_LOST = 0      # another claim owns the job: nothing was written
    STARTED = 1
    START_ISOLATED = 2  # a suspect (its last started attempts died with their worker, none made progress):
    #                     not started; start it once no other attempt of this worker is without progress
    REFUSED = 3         # as many deaths in a row as the limit: not started, dead-letter it (killed_its_worker)


@dataclass(frozen=True)
class AttemptStart:
    """What :meth:`RedisQueue.start_attempt` found. ``interruptions``: earlier attempts of the job
    lost after delivering new tokens (they spent no try); ``interrupted`` / ``failed``: how many of
    the attempts just judged were lost that way / lost before delivering anything new;
    ``worker_deaths``: the started attempts lost in a row without progress, as their worker died."""

    verdict: AttemptVerdict
    interruptions: int
    interrupted: int
    failed: int
    worker_deaths: int = 0

    @property
    def owned(self) -> bool:
        return self.verdict != AttemptVerdict.LEASE_LOST


@dataclass(frozen=True)
class AttemptLedger:
    """Where the attempts of one claimed job are judged, for its job function: the queue, and the
    claim whose lease fences the writes."""

    queue: RedisQueue | PartitionedQueue
    claim: ClaimedJob

    async def start(self, attempt: int, delivered_tokens: int, *, max_worker_deaths: int | None = None,
                    isolated: bool = False) -> AttemptStart:
        return await self.queue.start_attempt(self.claim, attempt, delivered_tokens,
                                              max_worker_deaths=max_worker_deaths, isolated=isolated)

    async def interruptions(self) -> int:
        return await self.queue.interruptions(self.claim.id)


@dataclass(frozen=True)
class AttemptOutcomes:
    """Attempts judged since the queue began: ``interrupted`` (lost after delivering new tokens,
    no try spent) and ``failed`` (a try spent: a retryable error, or lost before delivering new tokens)."""

    interrupted: int
    failed: int


class RedisQueue:
    """The queue ``name`` with ``lanes`` (highest first) on ``redis``. Every lease deadline, reap,
    ready time and quota window uses Redis' clock (``TIME`` inside the scripts, see
    :mod:`slotq.jobs.protocol.scripts`); this process's clock, shifted by ``clock_offset_s``
    (``SLOTQ_CLOCK_OFFSET_S``: a test's host whose clock runs off), only stamps the records it
    writes (:meth:`wall_ms`). On a Redis Cluster the keys are laid out for its slots
    (:class:`~slotq.jobs.protocol.keys.QueueKeys`, docs/cluster.md)."""

    def __init__(self, redis: Redis, name: str, lanes: Sequence[str], *, clock_offset_s: float = 0.0) -> None:
        self.redis = redis
        self.keys = QueueKeys(name, tuple(lanes), clustered=is_cluster(redis))
        self._clock_offset_ms = clock_offset_s * 1000
        self._scripts = ScriptRunner(redis)
        self._claim_ids = (f"{uuid.uuid4().hex}:{n}" for n in itertools.count())

    @property
    def arq_keys(self) -> QueueKeys:
        """The keys a job's arq runner builds its arq ids from (the queue's)."""
        return self.keys

    def _arq_keys(self, job_id: str) -> tuple[str, str, str]:
        """The job's record, attempt counter and result keys (arq's, in the queue's slot on a cluster)."""
        arq_id = self.keys.arq_id(job_id)
        return job_record_key(arq_id), retry_counter_key(arq_id), result_key(arq_id)

    def lane_of(self, index: int) -> str:
        return self.keys.lanes[index]

    def wall_ms(self) -> int:
        """This process's wall clock (ms, with the offset): the enqueue time in a job record, the
        times in a result record. Nothing the queue decides with."""
        return int(time.time() * 1000 + self._clock_offset_ms)

    # ------------------------------------------------------------------ producers
    async def enqueue(self, job_id: str, function: str, payload: dict[str, Any], *, lane: str,
                      tenant: str = DEFAULT_TENANT, max_waiting: int | None, serializer: Serializer,
                      quotas: TenantQuotas = NO_QUOTAS, tokens: int = 0,
                      wait_replicas: WaitReplicas | None = None) -> Enqueued:
        """Write the job record (arq's format) and put the job in its lane at its tenant's fair
        place (round-robin across tenants, see keys.py); wake one idle worker, leave a
        preemption token when a lower lane has running jobs, and a fair-share token when the
        tenant has nothing waiting or running while its lane has running jobs. FULL when
        ``max_waiting`` jobs already wait (None: no limit); TENANT_* when the tenant's ``quotas`` refuse it, ``tokens``
        being what the job reserves of its tenant's tokens per minute.

        With ``wait_replicas``, the enqueue is followed by a WAIT in the same round trip, on the same
        connection (WAIT counts that connection's writes; on a cluster it goes to the queue's node),
        and a job enqueued or already there that too few replicas acknowledged raises
        :class:`ReplicasBehind` (a refused one, which wrote nothing, does not)."""
        record = job_record(function, payload, self.wall_ms(), serializer)
        k = self.keys
        record_key, _, result = self._arq_keys(job_id)
        call = Enqueue(
            record_key=record_key, result_key=result, jobs=k.jobs, wake=k.wake,
            tags=k.tags(lane), tenant_waiting=k.tenant_waiting, tenant_running=k.tenant_running,
            tenant_tokens=k.tenant_tokens, waiting=k.waiting(lane), running=k.running(lane), preempt=k.preempt(lane),
            fair=k.fair(lane), queued=self._queued_keys(),
            below=[k.running(lower) for lower in k.lanes[k.lanes.index(lane) + 1:]],
            job_id=job_id, record=record, record_ttl_ms=RECORD_TTL_MS, lane=lane, max_waiting=max_waiting,
            wake_cap=WAKE_CAP, tenant=tenant, tenant_max_waiting=quotas.max_waiting,
            tenant_max_in_flight=quotas.max_in_flight, tenant_tokens_per_min=quotas.tokens_per_min, tokens=tokens,
            tokens_window_ms=TOKENS_WINDOW_MS)
        if wait_replicas is None:
            return Enqueued(int(await self._scripts.run(call)))
        code, acknowledged = await self._scripts.run_and_wait(call, wait_replicas.replicas, wait_replicas.timeout_ms)
        outcome = Enqueued(int(code))
        if outcome in (Enqueued.CREATED, Enqueued.EXISTS) and acknowledged < wait_replicas.replicas:
            raise ReplicasBehind(acknowledged, wait_replicas.replicas)
        return outcome

    def _queued_keys(self) -> list[str]:
        """The waiting and deferred set of every lane: the jobs the queue's limit counts, and those a cancel
        removes."""
        return [key for lane in self.keys.lanes for key in (self.keys.waiting(lane), self.keys.deferred(lane))]

    async def tenant_counts(self, tenant: str) -> TenantCounts:
        """The tenant's jobs waiting (or deferred) and running: O(1), one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hget(self.keys.tenant_waiting, tenant)
            pipe.hget(self.keys.tenant_running, tenant)
            waiting, running = await pipe.execute()
        return TenantCounts(waiting=int(waiting or 0), running=int(running or 0))

    async def follow_aborts(self, token: str, on_abort: Callable[[], Awaitable[None]]) -> None:
        """Await ``on_abort()`` for each cancel of a running job of the worker ``token`` (CANCEL
        publishes on that worker's channel); runs until cancelled, or until the subscription's
        connection fails for good (its client's retries spent): then it raises, and the worker's
        supervisor starts it again (:meth:`slotq.jobs.worker.worker.SlotqWorker._cancel_listener`).

        On a cluster the subscription is a plain client of the node that holds the queue's keys
        (:func:`~slotq.jobs.protocol.connection.subscriber`): CANCEL publishes there. Should that node
        die, the subscription fails within seconds (its client retries its node briefly), and the next
        one, finding that node gone, reads the slot map anew on each retry until it names the primary
        that took its place. A node frozen under the subscription (SIGSTOP, a
        network black hole) is not noticed: a subscription waits for messages without a bound. A
        cancel published while no subscription listens is still noted in ``arq:abort``, which the
        worker checks once per ``poll_delay_s``."""
        async with subscriber(self.redis, self.keys.jobs) as client, client.pubsub() as pubsub:
            await pubsub.subscribe(self.keys.abort_channel(token))
            async for message in pubsub.listen():
                if message.get("type") == "message":
                    await on_abort()

    async def tenants_waiting(self) -> dict[str, int]:
        """Each tenant's jobs waiting or deferred, for the tenants with some (one HGETALL,
        O(tenants with waiting jobs))."""
        raw = await reply(self.redis.hgetall(self.keys.tenant_waiting))
        return {tenant.decode(): int(count) for tenant, count in raw.items() if int(count) > 0}

    async def cancel(self, job_id: str) -> Cancelled:
        """Remove ``job_id`` if it has not started, or ask its worker to abort it (:class:`Cancelled`).

        The abort is noted in ``arq:abort`` first, so the worker told of it finds it there; the
        note is removed again when the job turned out not to run. A job not in the queue when the
        call begins is left without a note."""
        k = self.keys
        if not await reply(self.redis.hexists(k.jobs, job_id)):
            return Cancelled.NOT_IN_QUEUE
        arq_id = k.arq_id(job_id)
        await self._scripts.run(NoteAbort(aborts=ABORTS, arq_id=arq_id))
        code = Cancelled(int(await self._scripts.run(Cancel(
            jobs=k.jobs, owners=k.owners, record_key=job_record_key(arq_id), progress=k.progress,
            tenant_waiting=k.tenant_waiting, queued=self._queued_keys(), job_id=job_id,
            abort_channel_prefix=k.abort_channel("")))))
        if code != Cancelled.ABORTING:
            await self._scripts.run(DropAbort(aborts=ABORTS, arq_id=arq_id))
        return Cancelled.ENDED_MEANWHILE if code == Cancelled.NOT_IN_QUEUE else code

    async def store_result(self, job_id: str, function: str, result: Any, *, ttl_ms: int,
                           serializer: Serializer) -> None:
        """Store the result record (arq's format) of a job no worker ran, e.g. cancelled while queued."""
        record = result_record(job_id, function, result, self.keys.queue, self.wall_ms(), serializer)
        await self.redis.psetex(self._arq_keys(job_id)[2], ttl_ms, record)

    async def result_record(self, job_id: str, deserializer: Deserializer) -> ResultRecord | None:
        """The result record of a finished job, or None."""
        raw = await self.redis.get(self._arq_keys(job_id)[2])
        return None if raw is None else read_result_record(raw, deserializer)

    async def result_records(self, job_ids: Sequence[str], deserializer: Deserializer) -> dict[str, ResultRecord]:
        """The result records of those of ``job_ids`` that have finished: one MGET, so a producer
        with many jobs in flight (a bulk run) checks them all in one round trip."""
        if not job_ids:
            return {}
        raw = await self.redis.mget([self._arq_keys(job_id)[2] for job_id in job_ids])
        return {job_id: read_result_record(value, deserializer) for job_id, value in zip(job_ids, raw)
                if value is not None}

    async def forget(self, job_ids: Sequence[str]) -> int:
        """Remove the result, attempt counter and stream of each finished job; jobs still queued
        or running are left alone. Returns how many were removed."""
        if not job_ids:
            return 0
        calls = []
        for job_id in job_ids:
            _, retry_counter, result = self._arq_keys(job_id)
            calls.append(Forget(jobs=self.keys.jobs, result_key=result, retry_counter=retry_counter, job_id=job_id))
        forgotten = [job_id for job_id, done in zip(job_ids, await self._scripts.run_all(calls)) if int(done)]
        await self._delete_streams(forgotten)
        return len(forgotten)

    async def _delete_streams(self, job_ids: Sequence[str]) -> None:
        """Delete the streams and fences of ``job_ids`` (a job's stream and fences hash share a slot)."""
        if job_ids:
            clustered = self.keys.clustered
            async with self.redis.pipeline(transaction=False) as pipe:
                for job_id in job_ids:
                    pipe.delete(stream_key(job_id, clustered=clustered))
                    pipe.hdel(job_fences_key(job_id, clustered=clustered), job_id)
                await pipe.execute()

    async def clear_job(self, job_id: str) -> None:
        """Delete a job's result, attempt counter and stream whatever its state, so that it can be
        enqueued again under its id and run from scratch (an operator's requeue of a dead letter)."""
        _, retry_counter, result = self._arq_keys(job_id)
        await self.redis.delete(result, retry_counter)
        await self._delete_streams([job_id])

    async def in_queue(self, job_ids: Sequence[str]) -> list[bool]:
        """Whether each job is still queued, deferred or running (one HMGET)."""
        if not job_ids:
            return []
        return [entry is not None for entry in await reply(self.redis.hmget(self.keys.jobs, list(job_ids)))]

    async def attempt_outcomes(self) -> AttemptOutcomes:
        """Interrupted and failed attempts of every job since the queue began (one HMGET)."""
        interrupted, failed = await reply(self.redis.hmget(self.keys.attempt_outcomes, ["interrupted", "failed"]))
        return AttemptOutcomes(interrupted=int(interrupted or 0), failed=int(failed or 0))

    async def place(self, job_id: str) -> tuple[str | None, bool]:
        """(lane, running) of a job still in the queue; (None, False) when it is not."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hget(self.keys.jobs, job_id)
            pipe.hexists(self.keys.owners, job_id)
            entry, owned = await pipe.execute()
        if entry is None:
            return None, False
        return entry.decode().split("\t", 1)[0], bool(owned)

    async def counts(self) -> list[LaneCounts]:
        """Waiting, deferred and running jobs and preemptions of each lane: O(1) per lane, two
        round trips (the second reads the ready time of each lane's next job, and Redis' clock
        to age it with: ready times are Redis' time, whatever this host's clock says; on a cluster
        the clock of the queue's node, where the scripts stamped them)."""
        k = self.keys
        async with self.redis.pipeline(transaction=False) as pipe:
            for lane in k.lanes:
                pipe.zcard(k.waiting(lane))
                pipe.zcard(k.deferred(lane))
                pipe.zcard(k.running(lane))
                pipe.zrange(k.waiting(lane), 0, 0)
            pipe.hmget(k.preemptions, list(k.lanes))
            raw = await pipe.execute()
        heads: list[bytes | None] = [head[0] if head else None for head in raw[3:-1:4]]
        present = [h for h in heads if h is not None]
        entries: dict[bytes | None, bytes | None] = {}
        now_ms = 0.0
        if present:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hmget(k.jobs, present)
                # TIME by name: a cluster pipeline refuses its time() method
                pipe.execute_command("TIME", **self._on_queue_node())
                found, (seconds, micros) = await pipe.execute()
            entries, now_ms = dict(zip(present, found)), seconds * 1000 + micros / 1000
        out = []
        for i, lane in enumerate(k.lanes):
            waiting, deferred, running, _ = raw[4 * i: 4 * i + 4]
            entry = entries.get(heads[i])
            age = max(0.0, (now_ms - float(entry.decode().split("\t")[1])) / 1000) if entry else None
            out.append(LaneCounts(lane, waiting, deferred, running, age, int(raw[-1][i] or 0)))
        return out

    # ------------------------------------------------------------------ workers
    def _on_queue_node(self) -> dict[str, Any]:
        """The arguments that send a keyless command to the node of the queue's keys: none on a single
        Redis; on a cluster ``target_nodes`` (without them it would go to a default node)."""
        if not isinstance(self.redis, RedisCluster):
            return {}
        return {"target_nodes": self.redis.get_node_from_key(self.keys.jobs)}

    async def claim(self, max_jobs: int, token: str, lease_ms: int, *,
                    owed: Mapping[str, int] | None = None) -> list[ClaimedJob]:
        """Up to ``max_jobs`` jobs: first up to ``owed[lane]`` of each lane named there (slots the
        worker owes a lower lane under its guaranteed share, see ``CLAIM``), then highest lane
        first; oldest first within a lane. Each is owned by this claim's lease (``token#n``, fresh
        for every claim) until ``lease_ms`` after the claim by Redis' clock (renew it), and starts
        its next attempt.

        Each claim (this, :meth:`preempt`, :meth:`lend_reserve`) sends a fresh id, the same in the
        retries the client makes of it: a claim re-sent after its reply was lost is answered with
        the jobs it took (see ``claims.py``) instead of taking more."""
        k = self.keys
        owed = owed or {}
        flat = await self._scripts.run(Claim(
            jobs=k.jobs, owners=k.owners, claim_seq=k.claim_seq, claim_mark=k.claim_mark(token), wake=k.wake,
            tenant_waiting=k.tenant_waiting, tenant_running=k.tenant_running, lanes=k.lane_keys(), max_jobs=max_jobs,
            lease_ms=lease_ms, token=token, claim_id=next(self._claim_ids), wake_cap=WAKE_CAP,
            promote_limit=PROMOTE_LIMIT, owed=[owed.get(lane, 0) for lane in k.lanes]))
        return self._claimed(flat)

    async def preempt(self, victim_lane: str, token: str, lease_ms: int, *,
                      hand_back: bool = True) -> ClaimedJob | None:
        """Claim one waiting job of a lane above ``victim_lane`` for a busy worker, which then
        hands its victim back to give the job its slot (counted as a preemption of
        ``victim_lane``), or with ``hand_back`` false runs it in its reserve beside the victim (not
        counted: nothing yields). None: nothing above waits, or a worker with a free slot took the
        wake-up and claims it."""
        k = self.keys
        above = k.lanes[:k.lanes.index(victim_lane)]
        flat = await self._scripts.run(Preempt(
            jobs=k.jobs, owners=k.owners, claim_seq=k.claim_seq, claim_mark=k.claim_mark(token), wake=k.wake,
            preemptions=k.preemptions, tenant_waiting=k.tenant_waiting, tenant_running=k.tenant_running,
            lanes=k.lane_keys(above), lease_ms=lease_ms, token=token, claim_id=next(self._claim_ids),
            wake_cap=WAKE_CAP, promote_limit=PROMOTE_LIMIT, victim_lane=victim_lane if hand_back else ""))
        claimed = self._claimed(flat)
        return claimed[0] if claimed else None

    async def lend_reserve(self, lane: str, token: str, lease_ms: int) -> ClaimedJob | None:
        """Claim the next job of ``lane`` for a full worker to run in its reserve, when that job's
        tenant has nothing running (``LEND_RESERVE``). None: it has, nothing waits, or a worker
        with a free slot took the wake-up and claims it."""
        k = self.keys
        flat = await self._scripts.run(LendReserve(
            jobs=k.jobs, owners=k.owners, claim_seq=k.claim_seq, claim_mark=k.claim_mark(token), wake=k.wake,
            tenant_waiting=k.tenant_waiting, tenant_running=k.tenant_running, waiting=k.waiting(lane),
            deferred=k.deferred(lane), running=k.running(lane), lease_ms=lease_ms, token=token,
            claim_id=next(self._claim_ids), promote_limit=PROMOTE_LIMIT))
        claimed = self._claimed(flat, lanes=(lane,), lent_reserve=True)
        return claimed[0] if claimed else None

    def _claimed(self, flat: ClaimReply, *, lanes: Sequence[str] | None = None,
                 lent_reserve: bool = False) -> list[ClaimedJob]:
        """The claims in a claim script's reply (Redis' time of the claim, the claim's lease, then
        id, lane index, ready ms for each job; empty when the script declined); its lane indexes
        count from ``lanes[0]`` (default: the top lane)."""
        lanes = self.keys.lanes if lanes is None else lanes
        if len(flat) < 3:
            return []
        lease = flat[1].decode()
        return [ClaimedJob(flat[i].decode(), lanes[int(flat[i + 1])], int(float(flat[i + 2])), lease, int(flat[0]),
                           lent_reserve)
                for i in range(2, len(flat), 3)]

    async def wait_for_work(self, timeout_s: float) -> bool:
        """Block until a wake token arrives (one enqueue wakes one waiting worker) or the timeout."""
        # redis-py annotates blpop's timeout as int, but BLPOP takes a float (Redis >= 6) and redis-py passes it
        # on unchanged; its reply is annotated as a list: it is a (key, value) tuple, or None at the timeout
        popped = await cast("Awaitable[tuple[bytes, bytes] | None]",
                            self.redis.blpop([self.keys.wake], timeout=timeout_s))  # type: ignore[arg-type]
        return popped is not None

    async def return_wake_token(self) -> None:
        """A token this worker cannot use (its slots filled meanwhile): pass it on."""
        await reply(self.redis.rpush(self.keys.wake, "1"))

    async def wait_for_busy_token(self, timeout_s: float, *, below_lane: str | None,
                                  fair_lane: str | None) -> BusyToken | None:
        """For a full worker: block until a preemption token of a lane above ``below_lane`` (the
        lane of the job it would hand back) or a fair-share token of ``fair_lane`` (its lowest
        lane, while its reserve is free) arrives -- one enqueue wakes at most one busy worker for
        each; None at the timeout, or at once when there is neither to wait for."""
        k = self.keys
        lists = {} if below_lane is None else {
            k.preempt(lane): BusyToken(lane, fair=False) for lane in k.lanes[:k.lanes.index(below_lane)]}
        if fair_lane is not None:
            lists[k.fair(fair_lane)] = BusyToken(fair_lane, fair=True)
        if not lists:
            return None
        # blpop's float timeout and real reply: see wait_for_work
        popped = await cast("Awaitable[tuple[bytes, bytes] | None]",
                            self.redis.blpop(list(lists), timeout=timeout_s))  # type: ignore[arg-type]
        return None if popped is None else lists[popped[0].decode()]

    async def return_busy_token(self, token: BusyToken) -> None:
        """A token this worker cannot use (its lower-lane jobs ended, its reserve was taken): pass it on."""
        await reply(self.redis.rpush(self.keys.fair(token.lane) if token.fair else self.keys.preempt(token.lane), "1"))

    async def renew(self, jobs: Sequence[ClaimedJob], lease_ms: int) -> list[bool]:
        """Extend the leases of ``jobs`` to ``lease_ms`` from now by Redis' clock; False for each
        job its lease no longer owns."""
        if not jobs:
            return []
        owned = await self._scripts.run(Renew(
            owners=self.keys.owners, running=[self.keys.running(job.lane) for job in jobs], lease_ms=lease_ms,
            job_ids=[job.id for job in jobs], leases=[job.lease for job in jobs]))
        return [bool(x) for x in owned]

    async def start_attempt(self, job: ClaimedJob, attempt: int, delivered_tokens: int, *,
                            max_worker_deaths: int | None = None, isolated: bool = False) -> AttemptStart:
        """Attempt ``attempt`` of ``job`` starts with ``delivered_tokens`` tokens in its stream:
        judge the earlier attempts that were lost (interrupted if the stream grew since the last
        one started, else failed, and a worker death) and note this start.

        With ``max_worker_deaths`` the deaths in a row decide: at the limit the attempt is
        ``REFUSED``; below it, above none, it starts only if ``isolated`` (no other attempt of its
        worker is without progress), else it is ``START_ISOLATED`` and not started. None: it
        always starts (deaths are still counted)."""
        k = self.keys
        verdict, interruptions, interrupted, failed, deaths = await self._scripts.run(StartAttempt(
            owners=k.owners, progress=k.progress, attempt_outcomes=k.attempt_outcomes, lease=job.lease, job_id=job.id,
            attempt=attempt, delivered_tokens=delivered_tokens, max_deaths=max_worker_deaths, isolated=isolated))
        return AttemptStart(verdict=AttemptVerdict(int(verdict)), interruptions=int(interruptions),
                            interrupted=int(interrupted), failed=int(failed), worker_deaths=int(deaths))

    async def interruptions(self, job_id: str) -> int:
        """How many attempts of a job still in the queue were interrupted after making progress."""
        # redis-py types hget's reply as str; this client (no decode_responses) gets bytes
        entry = await cast("Awaitable[bytes | None]", self.redis.hget(self.keys.progress, job_id))
        return int(entry.decode().split("\t")[3]) if entry else 0

    async def finish(self, job: ClaimedJob, result: bytes | None, result_ttl_ms: int) -> bool:
        """Store the result and remove the job from the queue, then drop an abort noted too late
        to stop it. False: not ours (left alone)."""
        k = self.keys
        record_key, retry_counter, result_key_ = self._arq_keys(job.id)
        finished, _ = await self._scripts.run_all([
            Finish(owners=k.owners, jobs=k.jobs, running=k.running(job.lane), record_key=record_key,
                   retry_counter=retry_counter, result_key=result_key_, progress=k.progress,
                   tenant_running=k.tenant_running, lease=job.lease, job_id=job.id, result=result or b"",
                   result_ttl_ms=result_ttl_ms),
            DropAbort(aborts=ABORTS, arq_id=k.arq_id(job.id))])
        return bool(finished)

    async def retry_later(self, job: ClaimedJob, backoff_ms: int) -> bool:
        """Defer the job for ``backoff_ms`` (by Redis' clock) after its attempt failed (a try
        spent). False: not ours."""
        k = self.keys
        return bool(await self._scripts.run(RetryLater(
            owners=k.owners, running=k.running(job.lane), deferred=k.deferred(job.lane), progress=k.progress,
            attempt_outcomes=k.attempt_outcomes, jobs=k.jobs, tenant_waiting=k.tenant_waiting,
            tenant_running=k.tenant_running, lease=job.lease, job_id=job.id, backoff_ms=backoff_ms)))

    async def hand_back(self, job: ClaimedJob) -> bool:
        """Return a job to its place in line without using a try (worker shutdown, dead engine)."""
        k = self.keys
        return bool(await self._scripts.run(HandBack(
            owners=k.owners, jobs=k.jobs, running=k.running(job.lane), waiting=k.waiting(job.lane),
            retry_counter=self._arq_keys(job.id)[1], wake=k.wake, tenant_waiting=k.tenant_waiting,
            tenant_running=k.tenant_running, lease=job.lease, job_id=job.id, wake_cap=WAKE_CAP)))

    async def reap(self) -> int:
        """Requeue jobs whose lease expired by Redis' clock (their worker died or stalled);
        promote due retries."""
        k = self.keys
        return int(await self._scripts.run(Reap(
            owners=k.owners, jobs=k.jobs, wake=k.wake, tenant_waiting=k.tenant_waiting, tenant_running=k.tenant_running,
            lanes=k.lane_keys(), limit=REAP_LIMIT, wake_cap=WAKE_CAP)))
