"""One queue split into partitions (``SLOTQ_QUEUE_PARTITIONS``), so that its claim path spreads over a
cluster's primaries: :class:`PartitionedQueue` has :class:`~slotq.jobs.protocol.redis_queue.RedisQueue`'s
interface over P whole queues of today's layout, one per partition (:func:`~slotq.jobs.protocol.keys.
partition_names`: partition 0 is the queue's own name, the others land one P-th of the slot space apart).
The worker and the producer keep seeing one queue object; :func:`open_queue` gives the plain
:class:`RedisQueue` for one partition, so P = 1 is exactly the unpartitioned queue.

How each call is routed:

* **by job id** (enqueue, result, cancel, place, in_queue, forget, start_attempt, renew, finish, retry,
  hand back): a job lives in one partition, :func:`~slotq.jobs.protocol.keys.partition_of` its id, so any
  process that knows P finds it from the id alone, and every script stays atomic in one slot;
* **claim** goes over the partitions in rotation from a random start until ``max_jobs`` are claimed, one
  script per partition visited, but skips those the worker's claims found empty (:class:`DryPartitions`: a
  claim that took fewer jobs than it asked left none waiting there) until it takes one of their tokens, or
  for a poll delay at most. A claim that finds little thus costs one script per partition not known empty
  (its last claim filled what it asked, it got work since: a token taken, or it was found empty a poll
  ago), and none when every partition is dry: it returns nothing, and the worker waits on every
  partition's wake list, which is what reveals new work. An idle worker still claims every partition once
  per poll (a retry falls due without a token), P scripts, as before. ``preempt`` and ``lend_reserve``
  (rare) take the first job any partition gives, in the same order, dry or not;
* **counts, tenants, attempt outcomes** are sums of P reads; **reap** reaps every partition;
* **waiting for a token** (a wake token while idle, a busy token while full): a blocking pop cannot span
  slots on a cluster, so each partition has its own BLPOP, all pending at once, and the first token wins;
  the other pops stay pending for the next wait, and a token taken while nobody waits is given back to
  its partition (:class:`PartitionWaits`: no token is lost but when a wait is cancelled).
* **cancels of running jobs** are published on the job's partition's channel: a worker follows all P.

What is given up, against one queue (docs/cluster.md, "One queue's load spread by partitions"): order
across partitions (a lane's jobs are claimed in order within a partition only), fair share and tenant
quotas across partitions (each partition counts its own: a tenant's quota holds per partition, so a
tenant may hold up to P times it; the queue's ``max_waiting`` is split evenly, ``ceil(max / P)`` per
partition), preemption per partition (an enqueue leaves a preemption token only while a lower lane runs
in its own partition; the token names its partition, and the preemption then claims from any), and
counts that are P reads, not one.

A partition count that producers and workers do not share would leave jobs in partitions nobody claims:
workers name theirs in the queue's serving record, and a worker or producer of another count is refused
(:class:`~slotq.jobs.errors.QueuePartitionsDiffer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import random
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Generic, TypeAlias, TypeVar

from redis.asyncio import Redis

from slotq.jobs.protocol.arq_formats import Deserializer, ResultRecord, Serializer
from slotq.jobs.protocol.keys import DEFAULT_TENANT, PartitionedKeys, QueueKeys, partition_names, partition_of
from slotq.jobs.protocol.redis_queue import (
    NO_QUOTAS,
    AttemptOutcomes,
    AttemptStart,
    BusyToken,
    Cancelled,
    ClaimedJob,
    Enqueued,
    LaneCounts,
    RedisQueue,
    TenantCounts,
    TenantQuotas,
    WaitReplicas,
)

_T = TypeVar("_T")
_Item = TypeVar("_Item")
_Answer = TypeVar("_Answer")
# A blocking pop's shortest timeout: near a wait's deadline what is left may round to 0 ms, and BLPOP's 0 waits
# for ever.
MIN_POP_S = 0.01


def partition_share(max_waiting: int, partitions: int) -> int:
    """What each of ``partitions`` partitions may hold of a queue's ``max_waiting`` jobs
    (``SLOTQ_MAX_QUEUE_LENGTH``): ``ceil(max_waiting / partitions)``, so the whole queue holds at least the
    setting's count before every partition refuses."""
    return math.ceil(max_waiting / partitions)


class PartitionWaits(Generic[_T]):
    """Blocking pops of tokens on every partition at once, for one kind of token (wake, or busy), kept across
    waits so that none is cancelled while it may be taking a token.

    A BLPOP cannot span slots on a cluster, so a wait runs one pop per partition (``wait(partition,
    seconds)``, a truthy result when it took a token) and returns the first token. The other pops are *not*
    cancelled: they stay pending, the next wait (with the same ``lists``: the token lists they pop, e.g. a
    busy wait's lanes) takes them over instead of starting new ones, and a token one of them takes while no
    wait runs, or that a second pop took in the same instant as the first, is given back to its partition
    (``give_back``) at once, so no token is lost and a cancelled pop costs no reconnection. A pop still
    pending when its worker stops waiting (a worker that fills up) ends at its own timeout (the worker's
    poll). Only when a wait is cancelled (the worker stops, or switches queues) are its pops cancelled: a
    token whose reply is on its way then is lost, as when a worker stops mid-pop on one queue -- harmless,
    since tokens are hints that each claim tops up to the jobs waiting in its partition."""

    def __init__(self, partitions: Sequence[RedisQueue], give_back: Callable[[int, _T], Awaitable[None]]) -> None:
        self._partitions = partitions
        self._give_back = give_back
        self._pending: dict[int, tuple[Hashable, asyncio.Task[_T]]] = {}     # partition -> (lists, its pop)
        self._waiting = False
        self._giving_back: set[asyncio.Task[None]] = set()

    async def first(self, wait: Callable[[RedisQueue, float], Awaitable[_T]], lists: Hashable,
                    timeout_s: float) -> tuple[int, _T] | None:
        """(partition, token) of the first token any partition's pop takes within ``timeout_s``, or None."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        self._waiting = True
        try:
            while (left := deadline - loop.time()) > 0:
                for i, part in enumerate(self._partitions):
                    if i in self._pending and self._pending[i][0] != lists:
                        self._stop(i)                         # pops other lists: not this wait's
                    if i not in self._pending:
                        task = asyncio.ensure_future(wait(part, max(left, MIN_POP_S)))
                        task.add_done_callback(functools.partial(self._ended_between_waits, i))
                        self._pending[i] = (lists, task)
                await asyncio.wait([task for _, task in self._pending.values()], timeout=left,
                                   return_when=asyncio.FIRST_COMPLETED)
                taken: tuple[int, _T] | None = None
                failed: BaseException | None = None
                for i, (_, task) in list(self._pending.items()):
                    if not task.done():
                        continue
                    del self._pending[i]
                    if task.cancelled():
                        continue
                    if (error := task.exception()) is not None:
                        failed = error
                    elif task.result() and taken is None:
                        taken = (i, task.result())
                    elif task.result():
                        self._give_back_later(i, task.result())       # two at once: this one is passed on
                if taken is not None:
                    return taken
                if failed is not None:
                    raise failed
            return None
        except asyncio.CancelledError:
            for i in list(self._pending):
                self._stop(i)
            raise
        finally:
            self._waiting = False

    def _stop(self, partition: int) -> None:
        """Cancel a partition's pending pop; a token it took before the cancel landed is given back."""
        _, task = self._pending.pop(partition)
        task.cancel()
        task.add_done_callback(functools.partial(self._give_back_taken, partition))

    def _ended_between_waits(self, partition: int, task: asyncio.Task[_T]) -> None:
        """A pop that ended while no wait runs (a wait harvests its own): pass on the token it took."""
        if self._waiting or self._pending.get(partition, (None, None))[1] is not task:
            return
        del self._pending[partition]
        self._give_back_taken(partition, task)

    def _give_back_taken(self, partition: int, task: asyncio.Task[_T]) -> None:
        if not task.cancelled() and task.exception() is None and task.result():
            self._give_back_later(partition, task.result())

    def _give_back_later(self, partition: int, token: _T) -> None:
        async def give_back() -> None:
            with contextlib.suppress(Exception):
                await self._give_back(partition, token)

        task = asyncio.ensure_future(give_back())
        self._giving_back.add(task)
        task.add_done_callback(self._giving_back.discard)


class DryPartitions:
    """Which partitions one worker's claims found empty, so that its next claims skip them: a claim costs one
    script on each partition it visits, and without this a claim that finds one job or none visits all P.

    A partition turns *dry* when a claim there took fewer jobs than it asked for. That CLAIM left no job
    waiting there (it takes every lane's jobs up to what it asks: no tenant or lane holds one back), and it
    trimmed the partition's wake list to one token per job still waiting, so none: a token found there
    later was pushed after it, for new work, and a worker woken by a stale one claims, finds nothing and
    leaves none behind (no spin). A dry partition is claimed again once this worker learns that it got
    work -- it took a wake or busy token of that partition (an enqueue, a hand-back or a reap leaves one;
    a token a pending pop takes and gives back counts too), or it enqueued, handed back or reaped a job
    there itself -- or once ``recheck_s`` has passed since that claim was sent. The recheck is for work
    that comes without a token: a retry that falls due is moved to waiting by a claim or a reap, neither
    of which pushes a token for it. The worker passes its poll delay: a worker idle for a poll has every
    mark expired when its poll ends, so it claims each partition once per poll, as before. Work seen while
    a claim is on its way cancels the mark that claim would set (the work may have come after the claim
    looked). ``recheck_s`` 0: nothing is ever skipped."""

    def __init__(self, partitions: int, recheck_s: float) -> None:
        self._recheck_s = recheck_s
        self._dry_until = [0.0] * partitions      # monotonic time each mark ends; past: claimable
        self._work_seen = [0] * partitions        # how often work was seen in each partition

    def claimable(self, partitions: Sequence[int]) -> list[int]:
        """Those of ``partitions`` not dry now, in the same order."""
        now = time.monotonic()
        return [i for i in partitions if self._dry_until[i] <= now]

    def claim_sent(self, partition: int) -> Callable[[], None]:
        """Call as a claim of ``partition`` is sent; call what it returns if that claim took fewer jobs than
        it asked for."""
        sent_at, seen_before = time.monotonic(), self._work_seen[partition]

        def found_fewer() -> None:
            if self._work_seen[partition] == seen_before:
                self._dry_until[partition] = sent_at + self._recheck_s

        return found_fewer

    def got_work(self, partition: int) -> None:
        """``partition`` has (or had) a job waiting: claim it again."""
        self._work_seen[partition] += 1
        self._dry_until[partition] = 0.0


class PartitionedQueue:
    """The queue ``name`` with ``lanes`` split into ``partitions`` (2..64) queues on ``redis`` (see the
    module). ``keys`` are partition 0's: the queue's name, its lanes and its serving record. Claims skip the
    partitions the last claims found empty for up to ``dry_recheck_s`` (:class:`DryPartitions`; a worker
    passes its poll delay, 0 skips none)."""

    def __init__(self, redis: Redis, name: str, lanes: Sequence[str], *, partitions: int,
                 clock_offset_s: float = 0.0, dry_recheck_s: float = 0.0) -> None:
        self.redis = redis
        self.partitions = tuple(RedisQueue(redis, part, lanes, clock_offset_s=clock_offset_s)
                                for part in partition_names(name, partitions))
        self.keys: QueueKeys = self.partitions[0].keys
        self.arq_keys = PartitionedKeys(tuple(part.keys for part in self.partitions))
        self._woken_from = 0            # the partition of the last wake token taken (return_wake_token's)
        self._dry = DryPartitions(partitions, dry_recheck_s)

        # a token one of the pops took means work in its partition, even though it goes back for another worker
        async def give_back_wake(partition: int, _token: bool) -> None:
            self._dry.got_work(partition)
            await self.partitions[partition].return_wake_token()

        async def give_back_busy(partition: int, token: BusyToken | None) -> None:
            if token is not None:
                self._dry.got_work(partition)
                await self.partitions[partition].return_busy_token(token)

        self._wakes = PartitionWaits[bool](self.partitions, give_back_wake)
        self._busy = PartitionWaits[BusyToken | None](self.partitions, give_back_busy)

    def of_job(self, job_id: str) -> RedisQueue:
        """The partition that holds ``job_id``."""
        return self.partitions[partition_of(job_id, len(self.partitions))]

    def _rotation(self) -> list[int]:
        """Every partition's index once, from a random one on: claims spread over the partitions."""
        start = random.randrange(len(self.partitions))
        return [*range(start, len(self.partitions)), *range(start)]

    def _by_partition(self, job_ids: Sequence[str]) -> dict[int, list[str]]:
        grouped: dict[int, list[str]] = defaultdict(list)
        for job_id in job_ids:
            grouped[partition_of(job_id, len(self.partitions))].append(job_id)
        return grouped

    async def _answered_in_order(self, items: Sequence[_Item], job_id: Callable[[_Item], str],
                                 ask: Callable[[RedisQueue, list[_Item]], Awaitable[list[_Answer]]]) -> list[_Answer]:
        """``ask`` each partition about its jobs among ``items`` (one call each, side by side), and give the
        answers in the order of ``items``: a per-job answer of a call that takes many jobs (renew, in_queue)."""
        positions: dict[int, list[int]] = defaultdict(list)       # partition -> where its items are in items
        for position, item in enumerate(items):
            positions[partition_of(job_id(item), len(self.partitions))].append(position)
        answers = await asyncio.gather(*(ask(self.partitions[i], [items[p] for p in at])
                                         for i, at in positions.items()))
        ordered: dict[int, _Answer] = {}
        for at, answer in zip(positions.values(), answers, strict=True):
            ordered.update(zip(at, answer, strict=True))
        return [ordered[position] for position in range(len(items))]

    def lane_of(self, index: int) -> str:
        return self.keys.lanes[index]

    def wall_ms(self) -> int:
        return self.partitions[0].wall_ms()

    # ------------------------------------------------------------------ producers
    async def enqueue(self, job_id: str, function: str, payload: dict[str, Any], *, lane: str,
                      tenant: str = DEFAULT_TENANT, max_waiting: int | None, serializer: Serializer,
                      quotas: TenantQuotas = NO_QUOTAS, tokens: int = 0,
                      wait_replicas: WaitReplicas | None = None) -> Enqueued:
        """:meth:`RedisQueue.enqueue` into the job's partition; ``max_waiting`` is split evenly over the
        partitions (:func:`partition_share` each), the tenant's ``quotas`` hold per partition."""
        per_partition = None if max_waiting is None else partition_share(max_waiting, len(self.partitions))
        enqueued = await self.of_job(job_id).enqueue(
            job_id, function, payload, lane=lane, tenant=tenant, max_waiting=per_partition, serializer=serializer,
            quotas=quotas, tokens=tokens, wait_replicas=wait_replicas)
        if enqueued is Enqueued.CREATED:
            self._dry.got_work(partition_of(job_id, len(self.partitions)))
        return enqueued

    async def tenant_counts(self, tenant: str) -> TenantCounts:
        counts = await asyncio.gather(*(part.tenant_counts(tenant) for part in self.partitions))
        return TenantCounts(waiting=sum(c.waiting for c in counts), running=sum(c.running for c in counts))

    async def follow_aborts(self, token: str, on_abort: Callable[[], Awaitable[None]]) -> None:
        """Follow the cancels of every partition (:meth:`RedisQueue.follow_aborts`, one subscription each);
        raises as soon as one of them does, the others stopped."""
        tasks = [asyncio.ensure_future(part.follow_aborts(token, on_abort)) for part in self.partitions]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def tenants_waiting(self) -> dict[str, int]:
        total: dict[str, int] = defaultdict(int)
        for waiting in await asyncio.gather(*(part.tenants_waiting() for part in self.partitions)):
            for tenant, count in waiting.items():
                total[tenant] += count
        return dict(total)

    async def cancel(self, job_id: str) -> Cancelled:
        return await self.of_job(job_id).cancel(job_id)

    async def store_result(self, job_id: str, function: str, result: Any, *, ttl_ms: int,
                           serializer: Serializer) -> None:
        await self.of_job(job_id).store_result(job_id, function, result, ttl_ms=ttl_ms, serializer=serializer)

    async def result_record(self, job_id: str, deserializer: Deserializer) -> ResultRecord | None:
        return await self.of_job(job_id).result_record(job_id, deserializer)

    async def result_records(self, job_ids: Sequence[str], deserializer: Deserializer) -> dict[str, ResultRecord]:
        found: dict[str, ResultRecord] = {}
        for records in await asyncio.gather(*(self.partitions[i].result_records(ids, deserializer)
                                              for i, ids in self._by_partition(job_ids).items())):
            found |= records
        return found

    async def forget(self, job_ids: Sequence[str]) -> int:
        return sum(await asyncio.gather(*(self.partitions[i].forget(ids)
                                          for i, ids in self._by_partition(job_ids).items())))

    async def clear_job(self, job_id: str) -> None:
        await self.of_job(job_id).clear_job(job_id)

    async def in_queue(self, job_ids: Sequence[str]) -> list[bool]:
        return await self._answered_in_order(job_ids, str, lambda part, ids: part.in_queue(ids))

    async def attempt_outcomes(self) -> AttemptOutcomes:
        outcomes = await asyncio.gather(*(part.attempt_outcomes() for part in self.partitions))
        return AttemptOutcomes(interrupted=sum(o.interrupted for o in outcomes), failed=sum(o.failed for o in outcomes))

    async def place(self, job_id: str) -> tuple[str | None, bool]:
        return await self.of_job(job_id).place(job_id)

    async def counts(self) -> list[LaneCounts]:
        """Each lane's counts summed over the partitions; the oldest waiting age is the oldest of any."""
        per_partition = await asyncio.gather(*(part.counts() for part in self.partitions))
        summed = []
        for lane_counts in zip(*per_partition):
            ages = [c.oldest_waiting_age_s for c in lane_counts if c.oldest_waiting_age_s is not None]
            summed.append(LaneCounts(
                lane_counts[0].lane, sum(c.waiting for c in lane_counts), sum(c.deferred for c in lane_counts),
                sum(c.running for c in lane_counts), max(ages) if ages else None,
                sum(c.preempted for c in lane_counts)))
        return summed

    # ------------------------------------------------------------------ workers
    async def claim(self, max_jobs: int, token: str, lease_ms: int, *,
                    owed: Mapping[str, int] | None = None) -> list[ClaimedJob]:
        """Up to ``max_jobs`` jobs from the partitions not dry (:class:`DryPartitions`) in rotation from a
        random one (each partition's claim as :meth:`RedisQueue.claim`), the slots owed a lane counted down as
        they are filled. Every partition dry: nothing is sent, and the worker waits for their tokens."""
        owed_left = dict(owed or {})
        claimed: list[ClaimedJob] = []
        for i in self._dry.claimable(self._rotation()):
            asked = max_jobs - len(claimed)
            found_fewer = self._dry.claim_sent(i)
            jobs = await self.partitions[i].claim(asked, token, lease_ms, owed=owed_left)
            if len(jobs) < asked:
                found_fewer()
            claimed += jobs
            for job in jobs:
                if owed_left.get(job.lane):
                    owed_left[job.lane] -= 1
            if len(claimed) >= max_jobs:
                break
        return claimed

    async def preempt(self, victim_lane: str, token: str, lease_ms: int, *,
                      hand_back: bool = True) -> ClaimedJob | None:
        """:meth:`RedisQueue.preempt` on the partitions in rotation: the first job found."""
        for i in self._rotation():
            if (job := await self.partitions[i].preempt(victim_lane, token, lease_ms, hand_back=hand_back)) is not None:
                return job
        return None

    async def lend_reserve(self, lane: str, token: str, lease_ms: int) -> ClaimedJob | None:
        """:meth:`RedisQueue.lend_reserve` on the partitions in rotation: the first job found."""
        for i in self._rotation():
            if (job := await self.partitions[i].lend_reserve(lane, token, lease_ms)) is not None:
                return job
        return None

    async def wait_for_work(self, timeout_s: float) -> bool:
        """Block until a wake token of any partition arrives (:class:`PartitionWaits`) or the timeout."""
        taken = await self._wakes.first(lambda part, wait_s: part.wait_for_work(wait_s), (), timeout_s)
        if taken is None:
            return False
        self._woken_from = taken[0]
        self._dry.got_work(taken[0])
        return True

    async def return_wake_token(self) -> None:
        """Pass on the last wake token taken, to the partition it came from."""
        await self.partitions[self._woken_from].return_wake_token()

    async def wait_for_busy_token(self, timeout_s: float, *, below_lane: str | None,
                                  fair_lane: str | None) -> BusyToken | None:
        """:meth:`RedisQueue.wait_for_busy_token` on every partition at once (:class:`PartitionWaits`): the
        first token, which names its partition (preemption and the fair share's reserve work per partition)."""
        if below_lane is None and fair_lane is None:
            return None
        taken = await self._busy.first(
            lambda part, wait_s: part.wait_for_busy_token(wait_s, below_lane=below_lane, fair_lane=fair_lane),
            (below_lane, fair_lane), timeout_s)
        if taken is None or taken[1] is None:
            return None
        self._dry.got_work(taken[0])
        return replace(taken[1], partition=taken[0])

    async def return_busy_token(self, token: BusyToken) -> None:
        await self.partitions[token.partition].return_busy_token(token)

    async def renew(self, jobs: Sequence[ClaimedJob], lease_ms: int) -> list[bool]:
        return await self._answered_in_order(jobs, lambda job: job.id, lambda part, held: part.renew(held, lease_ms))

    async def start_attempt(self, job: ClaimedJob, attempt: int, delivered_tokens: int, *,
                            max_worker_deaths: int | None = None, isolated: bool = False) -> AttemptStart:
        return await self.of_job(job.id).start_attempt(job, attempt, delivered_tokens,
                                                       max_worker_deaths=max_worker_deaths, isolated=isolated)

    async def interruptions(self, job_id: str) -> int:
        return await self.of_job(job_id).interruptions(job_id)

    async def finish(self, job: ClaimedJob, result: bytes | None, result_ttl_ms: int) -> bool:
        return await self.of_job(job.id).finish(job, result, result_ttl_ms)

    async def retry_later(self, job: ClaimedJob, backoff_ms: int) -> bool:
        return await self.of_job(job.id).retry_later(job, backoff_ms)

    async def hand_back(self, job: ClaimedJob) -> bool:
        handed_back = await self.of_job(job.id).hand_back(job)
        if handed_back:
            self._dry.got_work(partition_of(job.id, len(self.partitions)))
        return handed_back

    async def reap(self) -> int:
        reaped = await asyncio.gather(*(part.reap() for part in self.partitions))
        for i, jobs in enumerate(reaped):
            if jobs:
                self._dry.got_work(i)
        return sum(reaped)


Queue: TypeAlias = RedisQueue | PartitionedQueue


def partition_job_keys(queue: Queue) -> list[str]:
    """Each partition's jobs hash (every job not finished), partition 0's (the queue's own) first; of a queue
    of one partition, its own alone. They hold the queue's demand (KEDA's triggers read them), and, as any key of a
    partition, name the hash slot its claim path lands on (:class:`~slotq.jobs.protocol.shard_load.ShardLoadReader`)."""
    return [part.keys.jobs for part in (queue.partitions if isinstance(queue, PartitionedQueue) else (queue,))]


def open_queue(redis: Redis, name: str, lanes: Sequence[str], *, partitions: int = 1,
               clock_offset_s: float = 0.0, dry_recheck_s: float = 0.0) -> Queue:
    """The queue ``name`` as producers and workers use it: a :class:`RedisQueue` for one partition (exactly
    the unpartitioned queue), a :class:`PartitionedQueue` for more (``SLOTQ_QUEUE_PARTITIONS``), whose claims
    skip a partition found empty for up to ``dry_recheck_s`` (a worker's poll delay; unused with one)."""
    if partitions == 1:
        return RedisQueue(redis, name, lanes, clock_offset_s=clock_offset_s)
    return PartitionedQueue(redis, name, lanes, partitions=partitions, clock_offset_s=clock_offset_s,
                            dry_recheck_s=dry_recheck_s)
