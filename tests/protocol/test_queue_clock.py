"""Leases on one clock (issue 32): the queue API a worker uses, run by hosts whose clocks are 60 s off
in either direction (``SLOTQ_CLOCK_OFFSET_S``), on a real Valkey. Every lease deadline is Redis' now +
the lease, so no lease is reaped early and none outlives its deadline, whoever claimed, renewed or
reaps; ready times, queue ages and the tokens quota's minute are Redis' too."""

from __future__ import annotations

import asyncio
import contextlib
import time

import arq.worker
import pytest
import redis.asyncio as aioredis

from slotq.jobs.protocol.arq_adapter import Attempt, Retry
from slotq.jobs.protocol.redis_queue import ClaimedJob, Enqueued, RedisQueue, TenantQuotas
from slotq.jobs.protocol.serialization import deserialize, serialize
from slotq.jobs.worker.runtime import QueueRuntime
from tests.support.processes import wait_for_async

SKEW_S = 60
LEASE_MS = 10_000           # long enough that nothing here outlives a lease unless a clock is misread
SHORT_LEASE_MS = 300        # a lease the test waits out
LANES = ["interactive", "bulk"]

# (the worker's clock, the reaper's clock): each direction, and the reaper off the other way
SKEWS = pytest.mark.parametrize("worker_s, reaper_s", [(-SKEW_S, SKEW_S), (SKEW_S, -SKEW_S)],
                                ids=["worker-behind", "worker-ahead"])


def queue_at(redis: aioredis.Redis, offset_s: float) -> RedisQueue:
    """The queue as a process whose clock is ``offset_s`` off sees it."""
    return RedisQueue(redis, "test:clock", LANES, clock_offset_s=offset_s)


async def put(queue: RedisQueue, job_id: str, lane: str = "interactive", tenant: str = "default",
              quotas: TenantQuotas | None = None, tokens: int = 0) -> Enqueued:
    return await queue.enqueue(job_id, "generate", {"prompt": job_id}, lane=lane, tenant=tenant, max_waiting=None,
                               serializer=serialize, quotas=quotas or TenantQuotas(), tokens=tokens)


async def server_ms(redis: aioredis.Redis) -> float:
    seconds, micros = await redis.time()
    return seconds * 1000 + micros / 1000


async def lease_left_ms(redis: aioredis.Redis, queue: RedisQueue, job: ClaimedJob) -> float:
    """How long the job's lease has left by Redis' clock."""
    deadline = await redis.zscore(queue.keys.running(job.lane), job.id)
    assert deadline is not None, f"{job.id} is not running"
    return deadline - await server_ms(redis)


@SKEWS
async def test_every_lease_a_skewed_worker_takes_runs_its_ttl_by_redis_clock(redis, worker_s, reaper_s):
    """Claim, preempt, lend the reserve and renew each set a deadline of Redis' now + the lease, and a
    reaper whose clock is off the other way leaves every one of them alone."""
    producer, worker, reaper = queue_at(redis, 0), queue_at(redis, worker_s), queue_at(redis, reaper_s)
    for job_id, lane, tenant in [("bulk-0", "bulk", "A"), ("chat-a", "interactive", "A")]:
        await put(producer, job_id, lane, tenant)
    claimed = await worker.claim(2, "w1", LEASE_MS)
    await put(producer, "chat-0")                                   # waits above a running bulk job
    preempted = await worker.preempt("bulk", "w1", LEASE_MS)
    await put(producer, "chat-b", tenant="B")                       # B's first job beside A's
    lent = await worker.lend_reserve("interactive", "w1", LEASE_MS)
    assert preempted is not None and lent is not None
    jobs = [*claimed, preempted, lent]
    assert sorted(j.id for j in jobs) == ["bulk-0", "chat-0", "chat-a", "chat-b"]
    for job in jobs:
        assert 0 < await lease_left_ms(redis, worker, job) <= LEASE_MS, job.id
    assert await reaper.reap() == 0

    assert await worker.renew(jobs, LEASE_MS) == [True] * len(jobs)
    for job in jobs:
        assert LEASE_MS - 5_000 < await lease_left_ms(redis, worker, job) <= LEASE_MS, job.id
    assert await reaper.reap() == 0
    assert [j.id for j in jobs if (await producer.place(j.id))[1]] == [j.id for j in jobs]   # all still running


@SKEWS
async def test_a_dead_workers_lease_ends_at_its_deadline_whatever_the_clocks(redis, worker_s, reaper_s):
    """A worker that claimed (and renewed) with its clock off, then died: a reaper with its clock off
    the other way requeues the job once the lease has run out by Redis' clock, not 120 s later
    or never."""
    producer, worker, reaper = queue_at(redis, 0), queue_at(redis, worker_s), queue_at(redis, reaper_s)
    await put(producer, "job")
    [job] = await worker.claim(1, "dying-worker", SHORT_LEASE_MS)
    assert await worker.renew([job], SHORT_LEASE_MS) == [True]
    reaped = 0

    async def requeued() -> bool:
        nonlocal reaped
        reaped += await reaper.reap()
        return reaped > 0

    await wait_for_async(requeued, timeout=5 + SHORT_LEASE_MS / 1000, what="the dead worker's job to be requeued")
    assert reaped == 1 and await producer.place("job") == ("interactive", False)
    assert await worker.renew([job], SHORT_LEASE_MS) == [False]          # the dead worker's lease is gone


async def test_ready_times_and_queue_ages_are_redis_time(redis):
    """A producer 60 s ahead and one 60 s behind: the queue's oldest job is aged from Redis' clock by
    a reader whose own clock is off (not 0 or 120 s), and a claim's pickup wait is its real one."""
    ahead, behind = queue_at(redis, SKEW_S), queue_at(redis, -SKEW_S)
    await put(ahead, "from-ahead")
    await put(behind, "from-behind")
    for reader in (ahead, behind):
        age = {c.lane: c.oldest_waiting_age_s for c in await reader.counts()}["interactive"]
        assert age is not None and 0 <= age < SKEW_S / 2
    claimed = await behind.claim(2, "w1", LEASE_MS)
    assert [j.id for j in claimed] == ["from-ahead", "from-behind"]      # in enqueue order
    assert all(0 <= j.claimed_ms - j.ready_ms < SKEW_S * 1000 / 2 for j in claimed)


async def test_the_tokens_quota_counts_one_minute_for_producers_on_skewed_clocks(redis):
    """Two producers of one tenant, 60 s apart: both count in Redis' minute, so the second cannot
    reset the first's count by being in another minute of its own."""
    quotas = TenantQuotas(tokens_per_min=100)
    ahead, behind = queue_at(redis, SKEW_S), queue_at(redis, -SKEW_S)
    minute = (await server_ms(redis)) // 60_000
    if (await server_ms(redis) + 2_000) // 60_000 != minute:         # a minute about to turn: wait for the next
        await wait_for_async(lambda: _minute_turned(redis, minute), timeout=5, what="the next minute")
    assert await put(ahead, "a-0", tenant="t", quotas=quotas, tokens=80) == Enqueued.CREATED
    assert await put(behind, "a-1", tenant="t", quotas=quotas, tokens=80) == Enqueued.TENANT_TOKENS
    assert await put(ahead, "a-2", tenant="t", quotas=quotas, tokens=20) == Enqueued.CREATED


async def _minute_turned(redis: aioredis.Redis, minute: float) -> bool:
    return (await server_ms(redis)) // 60_000 != minute


@pytest.mark.parametrize("worker_s", [-SKEW_S, SKEW_S], ids=["worker-behind", "worker-ahead"])
async def test_a_retry_waits_its_backoff_by_redis_clock(redis_url, worker_s, monkeypatch):
    """The worker's claim loop runs a job that fails with ``Retry(defer=30 s)`` on a host whose clock
    is 60 s off (arq's clock too, which turns the delay into a shift of the job's score): the job is
    due 30 s from now by Redis' clock, not at once (a clock behind) or in 90 s (a clock ahead)."""
    backoff_s = 30
    monkeypatch.setattr(arq.worker, "timestamp_ms", lambda: round((time.time() + worker_s) * 1000))
    redis = aioredis.Redis.from_url(redis_url)
    queue = queue_at(redis, worker_s)
    await put(queue_at(redis, 0), "flaky")

    async def fails(attempt: Attempt, payload: object) -> None:
        raise Retry(defer=backoff_s)

    runtime = QueueRuntime(function_name="generate", job=fails, queue=queue, token="w1", lease_ms=LEASE_MS, slots=1,
                           job_timeout_s=60, keep_result_s=60, max_tries=5, poll_delay_s=0.05, serializer=serialize,
                           deserializer=deserialize)
    loop = asyncio.create_task(runtime.run())
    try:
        await wait_for_async(lambda: _deferred(redis, queue), timeout=10, what="the failed job to be deferred")
        due_in_ms = await redis.zscore(queue.keys.deferred("interactive"), "flaky") - await server_ms(redis)
        assert backoff_s * 1000 - 5_000 < due_in_ms <= backoff_s * 1000
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
        await runtime.close()


async def _deferred(redis: aioredis.Redis, queue: RedisQueue) -> bool:
    return await redis.zcard(queue.keys.deferred("interactive")) == 1
