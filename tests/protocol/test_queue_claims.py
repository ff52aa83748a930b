"""The queue's claim path on a real Valkey, without a model: lanes, leases, the reaper, hand-back,
cancel, wake-ups and O(1) counts (jobs/protocol/)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import TimeoutError as RedisTimeoutError

from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.arq_formats import result_record
from slotq.jobs.protocol.connection import READ_TIMEOUT_S, connect
from slotq.jobs.protocol.keys import (
    ABORTS,
    JOB_FUNCTION,
    QueueKeys,
    job_fences_key,
    job_record_key,
    retry_counter_key,
)
from slotq.jobs.protocol.redis_queue import (
    NO_QUOTAS,
    AttemptOutcomes,
    AttemptVerdict,
    BusyToken,
    Enqueued,
    RedisQueue,
    ReplicasBehind,
    TenantQuotas,
    WaitReplicas,
)
from slotq.jobs.protocol.schemas import JobResult, JobStatus
from slotq.jobs.protocol.scripts.admission import NoteAbort
from slotq.jobs.protocol.serialization import serialize
from slotq.jobs.protocol.streams import read_all
from slotq.jobs.protocol.wire import FinishReason
from tests.support.faults import FaultyProxy
from tests.support.jobs import ON_EVERY_BACKEND, fences_raised, job_request

LEASE_MS = 60_000


@pytest.fixture
def queue(redis) -> RedisQueue:
    return RedisQueue(redis, "test:q", ["interactive", "bulk"])


async def put(queue: RedisQueue, job_id: str, lane: str = "interactive", max_waiting: int | None = None,
              tenant: str = "default", quotas: TenantQuotas = NO_QUOTAS, tokens: int = 0) -> Enqueued:
    return await queue.enqueue(job_id, "generate", {"prompt": job_id}, lane=lane, tenant=tenant,
                               max_waiting=max_waiting, serializer=serialize, quotas=quotas, tokens=tokens)


@pytest.mark.parametrize("redis_backend", ON_EVERY_BACKEND)
async def test_claim_takes_higher_lanes_first_then_oldest(queue):
    for i in range(3):
        await put(queue, f"bulk-{i}", "bulk")
        await asyncio.sleep(0.002)
    await put(queue, "chat-0")
    claimed = await queue.claim(2, "w1", LEASE_MS)
    assert [(j.id, j.lane) for j in claimed] == [("chat-0", "interactive"), ("bulk-0", "bulk")]
    rest = await queue.claim(10, "w2", LEASE_MS)
    assert [j.id for j in rest] == ["bulk-1", "bulk-2"]
    assert await queue.claim(10, "w3", LEASE_MS) == []
    counts = {c.lane: c for c in await queue.counts()}
    assert (counts["interactive"].waiting, counts["interactive"].running) == (0, 1)
    assert (counts["bulk"].waiting, counts["bulk"].running) == (0, 3)


async def test_enqueue_is_idempotent_and_bounded(queue):
    assert await put(queue, "a", max_waiting=2) == Enqueued.CREATED
    assert await put(queue, "a", max_waiting=2) == Enqueued.EXISTS
    assert await put(queue, "b", "bulk", max_waiting=2) == Enqueued.CREATED
    assert await put(queue, "c", max_waiting=2) == Enqueued.FULL           # waiting counts across lanes
    await queue.claim(1, "w1", LEASE_MS)
    assert await put(queue, "c", max_waiting=2) == Enqueued.CREATED        # running jobs do not count
    assert await put(queue, "a", max_waiting=2) == Enqueued.EXISTS         # still running: same id refused


async def test_an_enqueue_waits_for_replicas_in_the_same_round_trip(queue):
    """SLOTQ_REDIS_WAIT_REPLICAS on a Redis without replicas: the job is enqueued, and the WAIT sent with it
    says none acknowledged it; a refused enqueue (nothing written) is refused, not reported behind."""
    with pytest.raises(ReplicasBehind) as behind:
        await queue.enqueue("a", "generate", {}, lane="bulk", max_waiting=1, serializer=serialize,
                            wait_replicas=WaitReplicas(1, 50))
    assert (behind.value.acknowledged, behind.value.wanted) == (0, 1)
    assert await queue.in_queue(["a"]) == [True]
    assert await queue.enqueue("b", "generate", {}, lane="bulk", max_waiting=1, serializer=serialize,
                               wait_replicas=WaitReplicas(1, 50)) == Enqueued.FULL
    assert await queue.enqueue("b", "generate", {}, lane="bulk", max_waiting=None, serializer=serialize,
                               wait_replicas=WaitReplicas(0, 50)) == Enqueued.CREATED


async def commands_run(redis: aioredis.Redis, name: str) -> int:
    """How many ``name`` commands (``script|exists``, ``evalsha``) the server has run."""
    return int((await redis.info("commandstats")).get(f"cmdstat_{name}", {}).get("calls", 0))


async def test_scripts_in_one_round_trip_ask_no_script_exists_first(queue, redis):
    """An enqueue with SLOTQ_REDIS_WAIT_REPLICAS and a FINISH (with its DROP_ABORT) each go as one pipeline:
    redis-py's registered scripts would ask SCRIPT EXISTS before every such pipeline, a hidden round trip.
    A server that lost its scripts (SCRIPT FLUSH: a restart, a promoted replica) still runs them."""
    before = await commands_run(redis, "script|exists")
    assert await queue.enqueue("a", "generate", {}, lane="bulk", max_waiting=None, serializer=serialize,
                               wait_replicas=WaitReplicas(0, 50)) == Enqueued.CREATED
    [job] = await queue.claim(1, "w1", LEASE_MS)
    assert await queue.finish(job, b"", 60_000)
    await redis.script_flush()
    assert await queue.enqueue("b", "generate", {}, lane="bulk", max_waiting=None, serializer=serialize,
                               wait_replicas=WaitReplicas(0, 50)) == Enqueued.CREATED
    [job] = await queue.claim(1, "w1", LEASE_MS)
    await redis.script_flush()
    assert await queue.finish(job, b"", 60_000)
    assert await queue.in_queue(["a", "b"]) == [False, False]
    assert await commands_run(redis, "script|exists") == before


async def test_wake_tokens_never_exceed_waiting_jobs(queue, redis):
    for i in range(5):
        await put(queue, f"j{i}")
    assert await redis.llen(queue.keys.wake) == 5
    await queue.claim(3, "w1", LEASE_MS)
    assert await redis.llen(queue.keys.wake) == 2
    await queue.claim(3, "w1", LEASE_MS)
    assert await redis.llen(queue.keys.wake) == 0


async def test_one_enqueue_wakes_exactly_one_idle_worker(queue, redis_url):
    """No stampede: five idle workers block on the wake list; one enqueue wakes one of them."""
    clients = [aioredis.Redis.from_url(redis_url) for _ in range(5)]
    try:
        waiters = [RedisQueue(c, "test:q", ["interactive", "bulk"]) for c in clients]
        tasks = [asyncio.create_task(w.wait_for_work(2.0)) for w in waiters]
        await asyncio.sleep(0.2)                      # all five are blocked in BLPOP
        started = time.monotonic()
        await put(queue, "only-one")
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        woke_after = time.monotonic() - started
        results = await asyncio.gather(*tasks)
        assert sorted(results) == [False, False, False, False, True]
        assert woke_after < 1.0
    finally:
        for c in clients:
            await c.aclose()


async def test_renew_finish_and_fencing(queue, redis):
    await put(queue, "job")
    [job] = await queue.claim(1, "w1", LEASE_MS)
    assert job.lease.startswith("w1#")
    intruder = dataclasses.replace(job, lease="intruder#1")
    assert await queue.renew([job], LEASE_MS) == [True]
    assert await queue.renew([intruder], LEASE_MS) == [False]
    assert not await queue.finish(intruder, b"result", 60_000)              # not the owner: left alone
    assert await queue.finish(job, b"result", 60_000)
    assert await redis.get("arq:result:job") == b"result"
    assert not await redis.exists(job_record_key("job"))
    assert await redis.hlen(queue.keys.jobs) == 0 and await redis.hlen(queue.keys.owners) == 0
    assert await queue.place("job") == (None, False)
    assert not await queue.finish(job, b"again", 60_000)                    # only once


async def test_reaper_requeues_expired_leases_at_their_place_and_fences_the_old_owner(queue, redis):
    await put(queue, "old")
    await asyncio.sleep(0.005)
    await put(queue, "young")
    [old] = await queue.claim(1, "dead-worker", lease_ms=50)
    await asyncio.sleep(0.1)
    assert await queue.reap() == 1
    assert await queue.place("old") == ("interactive", False)
    [again] = await queue.claim(1, "w2", LEASE_MS)
    assert again.id == "old" and again.ready_ms == old.ready_ms              # back at the head of the line
    # the reaped worker wakes up: it can neither renew, nor finish, nor hand back
    assert await queue.renew([old], LEASE_MS) == [False]
    assert not await queue.hand_back(old)
    assert not await queue.finish(old, b"x", 1000)
    assert await queue.reap() == 0                                          # a live lease is left alone


async def test_a_worker_that_claims_its_own_reaped_job_again_fences_its_old_attempt(queue):
    """Leases are per claim, not per worker: after a Redis outage longer than the lease, a worker
    may claim its own job again; the attempt it still runs must be shut out like anyone else's."""
    await put(queue, "job")
    [first] = await queue.claim(1, "w1", lease_ms=50)
    await asyncio.sleep(0.1)
    assert await queue.reap() == 1
    [second] = await queue.claim(1, "w1", LEASE_MS)
    assert second.id == "job" and second.lease != first.lease
    assert await queue.renew([first, second], LEASE_MS) == [False, True]
    assert not await queue.finish(first, b"x", 1000)
    assert await queue.finish(second, b"x", 1000)


async def test_hand_back_gives_the_try_back_atomically(queue, redis):
    await put(queue, "handed")
    [job] = await queue.claim(1, "w1", LEASE_MS)
    await redis.incr(retry_counter_key("handed"))                           # arq's run_job counted attempt 1
    assert await queue.hand_back(job)
    assert await redis.get(retry_counter_key("handed")) == b"0"
    assert await queue.place("handed") == ("interactive", False)
    assert await redis.llen(queue.keys.wake) == 1                          # an idle worker is woken for it
    [again] = await queue.claim(1, "w2", LEASE_MS)
    assert again.ready_ms == job.ready_ms


async def test_retry_later_waits_out_its_backoff(queue):
    await put(queue, "flaky")
    [job] = await queue.claim(1, "w1", LEASE_MS)
    assert await queue.retry_later(job, 150)
    assert {c.lane: c.deferred for c in await queue.counts()}["interactive"] == 1
    assert await queue.claim(1, "w1", LEASE_MS) == []                       # not yet
    await asyncio.sleep(0.2)
    [again] = await queue.claim(1, "w1", LEASE_MS)                          # promoted when due
    assert again.id == "flaky"


async def test_lost_attempts_are_judged_by_the_progress_they_left_in_the_stream(queue, redis):
    """START_ATTEMPT: the attempt that started last, lost since, was an interruption (no try) if the
    stream grew while it ran, else a failure; attempts lost before they started failed too; a
    hand-back judges nothing, and a retried attempt was judged (a failure) when it was retried."""
    await put(queue, "job")
    [job] = await queue.claim(1, "w1", LEASE_MS)
    judged = [(s.interruptions, s.interrupted, s.failed) for s in [
        await queue.start_attempt(job, 1, 0),
        await queue.start_attempt(job, 2, 40),    # 1 was lost after delivering 40 tokens: interrupted
        await queue.start_attempt(job, 3, 40),    # 2 delivered nothing new: failed
        await queue.start_attempt(job, 5, 40),    # 3 delivered nothing, 4 was lost before it started: 2 failed
        await queue.start_attempt(job, 5, 60),    # 5 again after a hand-back: nothing lost
        await queue.start_attempt(job, 6, 90),    # 5 (since its hand-back) delivered 30 tokens: interrupted
    ]]
    assert judged == [(0, 0, 0), (1, 1, 0), (1, 0, 1), (1, 0, 2), (1, 0, 0), (2, 1, 0)]
    assert await queue.interruptions("job") == 2
    assert await queue.retry_later(job, 0)                                  # 6 failed with a retryable error
    [job] = await queue.claim(1, "w2", LEASE_MS)
    after_retry = await queue.start_attempt(job, 7, 120)                   # 6 made progress, but it failed
    assert (after_retry.interruptions, after_retry.interrupted, after_retry.failed) == (2, 0, 0)
    assert await queue.attempt_outcomes() == AttemptOutcomes(interrupted=2, failed=4)
    assert not (await queue.start_attempt(dataclasses.replace(job, lease="intruder#1"), 8, 500)).owned
    assert await queue.interruptions("job") == 2                            # the intruder wrote nothing
    assert await queue.finish(job, b"done", 60_000)
    assert not await redis.hexists(queue.keys.progress, "job")


async def test_attempts_lost_without_progress_in_a_row_are_worker_deaths(queue, redis):
    """START_ATTEMPT with a limit of 2 worker deaths: a started attempt lost without progress is a
    death; after one the job starts only isolated; an interruption ends the run of deaths, an
    attempt lost before it started neither adds nor ends one; at 2 the job is refused, again at
    every later claim, and nothing is started."""
    await put(queue, "job")
    [job] = await queue.claim(1, "w1", LEASE_MS)

    async def start(attempt: int, tokens: int, isolated: bool = False) -> tuple[AttemptVerdict, int, int]:
        s = await queue.start_attempt(job, attempt, tokens, max_worker_deaths=2, isolated=isolated)
        return s.verdict, s.failed, s.worker_deaths

    assert await start(1, 0) == (AttemptVerdict.STARTED, 0, 0)
    assert await start(2, 0) == (AttemptVerdict.START_ISOLATED, 1, 1)        # 1 died without progress
    assert await start(2, 0, isolated=True) == (AttemptVerdict.STARTED, 0, 1)
    assert await start(3, 30) == (AttemptVerdict.STARTED, 0, 0)              # 2 delivered 30 tokens
    assert await start(4, 30) == (AttemptVerdict.START_ISOLATED, 1, 1)       # 3 died without progress
    assert await start(6, 30) == (AttemptVerdict.START_ISOLATED, 2, 1)       # 4 and 5 were lost before they started
    assert await start(6, 30, isolated=True) == (AttemptVerdict.STARTED, 0, 1)
    assert await start(6, 30) == (AttemptVerdict.START_ISOLATED, 0, 1)       # 6 again after a hand-back
    assert await start(6, 30, isolated=True) == (AttemptVerdict.STARTED, 0, 1)
    assert await start(7, 30) == (AttemptVerdict.REFUSED, 1, 2)              # 6 died without progress: 2 in a row
    assert await start(8, 30, isolated=True) == (AttemptVerdict.REFUSED, 1, 2)   # 7 never started
    assert (await queue.start_attempt(dataclasses.replace(job, lease="intruder#1"), 9, 30,
                                      max_worker_deaths=2)).verdict == AttemptVerdict.LEASE_LOST
    # without a limit the caller is told the count, and every attempt starts
    assert (await queue.start_attempt(job, 9, 30)).verdict == AttemptVerdict.STARTED
    assert await queue.retry_later(job, 0)                                   # its worker lived: the run ends
    [job] = await queue.claim(1, "w2", LEASE_MS)
    assert await start(10, 30) == (AttemptVerdict.STARTED, 0, 0)


async def test_cancel_queued_and_running(queue, redis):
    await put(queue, "running")
    assert [j.id for j in await queue.claim(1, "w1", LEASE_MS)] == ["running"]
    await put(queue, "queued2")
    pubsub = redis.pubsub()
    await pubsub.subscribe(queue.keys.abort_channel("w1"))
    await pubsub.get_message(timeout=1)                                     # the subscribe confirmation
    try:
        assert await queue.cancel("queued2") == 1
        assert await queue.place("queued2") == (None, False)
        assert not await redis.exists(job_record_key("queued2"))
        assert await queue.cancel("running") == -1
        assert await redis.zscore(ABORTS, "running") is not None
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
        assert message is not None and message["data"] == b"running"     # told the owner, and only it
        assert await queue.cancel("never-enqueued") == 0
    finally:
        await pubsub.aclose()


@pytest.mark.parametrize("redis_backend", ON_EVERY_BACKEND)
async def test_a_job_cancelled_while_queued_after_an_earlier_claim_leaves_no_fence(client):
    """A claim raised the job's stream fence, the job went back to waiting (a hand-back), and the
    producer cancelled it there: the unfenced final entry it writes takes the fence away, as a
    worker's fenced final entry does (before, the field stayed in the fences hash for good)."""
    queue, redis = client.queue, client.redis
    await put(queue, "j")
    [claim] = await queue.claim(1, "w1", LEASE_MS)
    assert await fences_raised(redis, {"j": claim.lease}) == {"j": True}
    assert await queue.hand_back(claim)
    assert await client.cancel("j")
    assert await redis.hget(job_fences_key("j", clustered=queue.keys.clustered), "j") is None
    assert [entry.finish_reason for entry in await read_all(redis, "j")] == [FinishReason.CANCELLED]


SPIN = "local start = os.clock() repeat until os.clock() - start > tonumber(ARGV[1]) / 1000 return 1"   # CPU ms


async def test_a_claim_whose_reply_was_lost_is_answered_again_not_run_again(queue, redis_url):
    """redis-py sends a command again, whole, when its reply does not come in time; a claim whose reply
    was lost had run, and run again it took a second job, the first left under a lease nobody holds
    until the reaper. Here the server is held busy (a script spinning 0.15 s of CPU) while the claim is sent: the
    client gives up on each reply after 0.1 s and sends it again, and every copy runs once the server is
    free. The claim's id makes the copies answer the first one's reply."""
    assert await queue.claim(1, "warm-up", LEASE_MS) == []           # the script is loaded: no NOSCRIPT below
    await put(queue, "first")
    await asyncio.sleep(0.002)
    await put(queue, "second")
    impatient = aioredis.Redis.from_url(redis_url, socket_timeout=0.1, retry=Retry(NoBackoff(), 200),
                                        retry_on_error=[RedisTimeoutError])
    busy = aioredis.Redis.from_url(redis_url)
    try:
        await impatient.ping()                  # connected: a connect that times out is not retried
        spin = asyncio.create_task(busy.eval(SPIN, 0, 150))
        await asyncio.sleep(0.05)
        claimed = await RedisQueue(impatient, "test:q", ["interactive", "bulk"]).claim(1, "w1", LEASE_MS)
        await spin
        assert [job.id for job in claimed] == ["first"]
        assert await impatient.hgetall(queue.keys.owners) == {b"first": claimed[0].lease.encode()}
        assert await queue.in_queue(["second"]) == [True]
        assert [job.id for job in await queue.claim(1, "w2", LEASE_MS)] == ["second"]    # still waiting
    finally:
        await impatient.aclose()
        await busy.aclose()


@pytest.mark.fault
async def test_a_claim_whose_reply_never_comes_is_sent_again_after_the_read_bound(queue, redis_server):
    """The same on a worker's own connection (connect(), single Redis): the claim runs, and its connection
    then passes nothing more either way (a network black hole right after the request). Its reply is
    overdue after READ_TIMEOUT_S, and the claim is sent again on a new connection, where its claim mark
    answers it with the first copy's job. Without the bound it waited for ever; a retry without the mark
    would have taken the second job too."""
    assert await queue.claim(1, "warm-up", LEASE_MS) == []           # the script is loaded: no NOSCRIPT below
    await put(queue, "first")
    await asyncio.sleep(0.002)
    await put(queue, "second")
    proxy = FaultyProxy(redis_server.port)
    await proxy.start()
    worker = await connect(proxy.url, patient=True)
    try:
        proxy.arm(b"blackholed-worker", "freeze")
        started = time.monotonic()
        async with asyncio.timeout(60):                              # a hang guard
            claimed = await RedisQueue(worker, "test:q", ["interactive", "bulk"]).claim(1, "blackholed-worker",
                                                                                        LEASE_MS)
        assert proxy.fired.is_set()                                  # the first copy ran, its reply was lost
        assert time.monotonic() - started >= READ_TIMEOUT_S
        assert [job.id for job in claimed] == ["first"]
        assert await queue.redis.hgetall(queue.keys.owners) == {b"first": claimed[0].lease.encode()}
        assert await queue.in_queue(["second"]) == [True]
    finally:
        await worker.aclose()
        await proxy.close()


@pytest.mark.parametrize("redis_backend", ON_EVERY_BACKEND)
async def test_every_claim_script_answers_a_resent_claim_from_its_mark(queue):
    """CLAIM, PREEMPT and LEND_RESERVE sent twice under one claim id (what a client's retry sends): the
    second is answered with the first one's jobs and lease, claims nothing more; on a cluster the mark
    lies in the queue's slot. A new id claims again."""
    queue._claim_ids = itertools.repeat("resent")        # each call's id, as its retries send it
    for job_id in ("c1", "c2"):
        await put(queue, job_id, "bulk", tenant=job_id)      # one tenant each: the one left may be lent
    first = await queue.claim(1, "w1", LEASE_MS)
    assert len(first) == 1 and await queue.claim(1, "w1", LEASE_MS) == first
    [other] = {"c1", "c2"} - {first[0].id}
    await put(queue, "p1")
    queue._claim_ids = itertools.repeat("resent-preempt")
    preempted = await queue.preempt("bulk", "w1", LEASE_MS)
    assert preempted is not None and preempted.id == "p1"
    await put(queue, "p2")
    assert await queue.preempt("bulk", "w1", LEASE_MS) == preempted
    queue._claim_ids = itertools.repeat("resent-lend")
    lent = await queue.lend_reserve("bulk", "w2", LEASE_MS)
    assert lent is not None and lent.id == other
    await put(queue, "c3", "bulk", tenant="other")
    assert await queue.lend_reserve("bulk", "w2", LEASE_MS) == lent
    assert await queue.in_queue(["p2", "c3"]) == [True, True]
    queue._claim_ids = itertools.repeat("fresh")
    assert [job.id for job in await queue.claim(2, "w1", LEASE_MS)] == ["p2", "c3"]


async def test_claim_cost_does_not_grow_with_running_jobs(queue, redis):
    """Beyond arq's old queue_read_limit (1000 running jobs, after which waiting ones became
    invisible): a new job is claimed at once, in one script whose command count stays small."""
    n = 1500
    for start in range(0, n, 250):
        await asyncio.gather(*(put(queue, f"r{i}") for i in range(start, start + 250)))
    claimed = 0
    while claimed < n:
        claimed += len(await queue.claim(500, f"w{claimed}", LEASE_MS))
    assert {c.lane: c.running for c in await queue.counts()}["interactive"] == n

    await redis.config_resetstat()
    await put(queue, "newcomer")
    [job] = await queue.claim(4, "free-worker", LEASE_MS)
    assert job.id == "newcomer"
    stats = await redis.info("commandstats")
    inner = sum(v["calls"] for k, v in stats.items() if not k.startswith(("cmdstat_evalsha", "cmdstat_eval",
                                                                          "cmdstat_config", "cmdstat_info")))
    assert inner < 45, stats            # enqueue + claim of one job (and its claim mark): a few dozen, not thousands


# ---------------------------------------------------------------------- fair share across tenants
@pytest.mark.parametrize("redis_backend", ON_EVERY_BACKEND)
async def test_a_tenants_backlog_does_not_delay_another_tenants_job(queue):
    """Tenant A queues 1,000 jobs, then tenant B one and a job without a tenant (the default tenant):
    those two are the next two claimed, ahead of A's next job (they used to tie with it and lose the
    tie by job id order); A's own jobs stay in order, a job handed back keeps its place among them,
    and once A's queue is the only one, A is served at full speed."""
    for i in range(1000):
        await put(queue, f"a-{i:04d}", "bulk", tenant="A")
    first = await queue.claim(1, "w1", LEASE_MS)                 # the lane's clock is running
    await put(queue, "b-only", "bulk", tenant="B")
    await put(queue, "c-only", "bulk")                           # no tenant: the default tenant
    claimed = [j.id for j in await queue.claim(4, "w2", LEASE_MS)]
    assert set(claimed[:2]) == {"b-only", "c-only"}, claimed
    a_jobs = [j.id for j in first] + [i for i in claimed if i.startswith("a-")]
    [next_a] = await queue.claim(1, "w3", LEASE_MS)
    assert await queue.hand_back(next_a)                         # back to its place, ahead of A's later jobs
    rest = [j.id for j in await queue.claim(1000, "w3", LEASE_MS)]
    assert a_jobs + rest == [f"a-{i:04d}" for i in range(1000)]   # FIFO within the tenant, nothing lost


async def test_a_job_handed_back_goes_ahead_of_jobs_enqueued_after_it_even_across_an_emptied_lane(queue):
    """A burst of enqueues hands out places faster than the clock (one per job, the clock a
    millisecond); claims then empty the lane, and the next job used to get its ready time + 1 as
    its place, below the burst's. A burst job handed back (preempted for an interactive one) then
    waited behind that later job: in `slotq bench bulk` a preempted bulk job of the first wave
    resumed only after the second wave's jobs, seconds later, and held up the run's end."""
    burst = [f"burst-{i:03d}" for i in range(200)]
    for job_id in burst:
        await put(queue, job_id, "bulk")
    claimed = await queue.claim(200, "w1", LEASE_MS)
    assert [j.id for j in claimed] == burst                      # the lane is empty now
    await put(queue, "after", "bulk")
    assert await queue.hand_back(claimed[-1])
    assert [j.id for j in await queue.claim(2, "w2", LEASE_MS)] == [burst[-1], "after"]


# ---------------------------------------------------------------------- tenants' counts and quotas
async def counts_of(queue: RedisQueue, tenant: str) -> tuple[int, int]:
    counts = await queue.tenant_counts(tenant)
    return counts.waiting, counts.running


@pytest.mark.parametrize("redis_backend", ON_EVERY_BACKEND)
async def test_a_tenants_counts_follow_its_jobs_through_every_move_and_return_to_zero(queue, redis):
    """Waiting and running per tenant move in the script that moves the job: enqueue, claim,
    preempt claim, retry later (deferred counts as waiting), hand back, reap, finish and cancel.
    Another tenant's counts never move, and nothing is left behind once the jobs are gone."""
    for i in range(4):
        await put(queue, f"a-{i}", "bulk", tenant="A")
    await put(queue, "b-0", "bulk", tenant="B")
    assert await counts_of(queue, "A") == (4, 0) and await counts_of(queue, "B") == (1, 0)
    running = {j.id: j for j in await queue.claim(3, "w1", LEASE_MS)}       # a-0, b-0 and a-1 (fair share)
    assert set(running) == {"a-0", "b-0", "a-1"}
    assert await counts_of(queue, "A") == (2, 2) and await counts_of(queue, "B") == (0, 1)
    assert await queue.hand_back(running.pop("a-0"))
    assert await counts_of(queue, "A") == (3, 1)
    assert await queue.retry_later(running.pop("a-1"), 60_000)
    assert await counts_of(queue, "A") == (4, 0)
    [stalled] = await queue.claim(1, "dead-worker", lease_ms=50)
    assert stalled.id == "a-0" and await counts_of(queue, "A") == (3, 1)
    await asyncio.sleep(0.1)
    assert await queue.reap() == 1
    assert await counts_of(queue, "A") == (4, 0)
    await put(queue, "chat-a", tenant="A")                                  # a higher lane, while bulk runs
    preempting = await queue.preempt("bulk", "w1", LEASE_MS)
    assert preempting is not None and preempting.id == "chat-a" and await counts_of(queue, "A") == (4, 1)
    assert await queue.finish(preempting, b"done", 60_000)
    assert await queue.finish(running.pop("b-0"), b"done", 60_000)
    assert await counts_of(queue, "A") == (4, 0) and await counts_of(queue, "B") == (0, 0)
    assert await queue.cancel("a-1") == 1                                   # deferred
    for job in await queue.claim(10, "w2", LEASE_MS):
        if job.id == "a-2":
            assert await queue.cancel(job.id) == -1                         # running: its FINISH ends it
        assert await queue.finish(job, b"done", 60_000)
    assert await counts_of(queue, "A") == (0, 0)
    assert await redis.hlen(queue.keys.tenant_waiting) == 0 and await redis.hlen(queue.keys.tenant_running) == 0


@pytest.mark.parametrize("redis_backend", ON_EVERY_BACKEND)
async def test_a_job_ended_by_the_abort_a_cancel_noted_was_cancelled_by_that_cancel(client: SlotqClient,
                                                                                   monkeypatch) -> None:
    """A worker's tick acts on an abort noted in arq:abort alone (``check_aborts``), so a running job can
    end, cancelled, between the cancel's NOTE_ABORT and its CANCEL, which then finds it gone. The cancel
    did it: the producer says True. It said False ("had already finished"), and `slotq enqueue`
    interrupted on a loaded machine printed that for the job it had just cancelled (CI, Python 3.13).
    A job that ends on its own in the same moment is not counted as cancelled."""
    ids = [(await client.enqueue(job_request(f"cancel race {i}"))).id for i in range(2)]
    running = {job.id: job for job in await client.queue.claim(2, "w1", LEASE_MS)}
    assert set(running) == set(ids)
    ends = {ids[0]: JobStatus.CANCELLED, ids[1]: JobStatus.SUCCEEDED}
    run = client.queue._scripts.run

    async def a_worker_ends_the_job_once_the_abort_is_noted(call: Any) -> Any:
        answer = await run(call)
        if isinstance(call, NoteAbort):
            job_id = next(job_id for job_id in ids if client.queue.keys.arq_id(job_id) == call.arq_id)
            ended = JobResult(id=job_id, status=ends[job_id])
            record = result_record(job_id, JOB_FUNCTION, ended.model_dump(mode="json"), client.queue.keys.queue,
                                   int(time.time() * 1000), serialize)
            assert await client.queue.finish(running[job_id], record, 60_000)
        return answer

    monkeypatch.setattr(client.queue._scripts, "run", a_worker_ends_the_job_once_the_abort_is_noted)
    assert await client.cancel(ids[0]) is True
    assert await client.cancel(ids[1]) is False
    assert await client.cancel("never-enqueued") is False
    assert await client.redis.zcard(ABORTS) == 0          # every note dropped


@pytest.mark.parametrize("redis_backend", ON_EVERY_BACKEND)
async def test_a_tenants_quotas_refuse_its_enqueues_and_no_one_elses(queue):
    waiting = TenantQuotas(max_waiting=2)
    assert [await put(queue, f"a-{i}", tenant="A", quotas=waiting) for i in range(3)] == [
        Enqueued.CREATED, Enqueued.CREATED, Enqueued.TENANT_WAITING]
    assert await put(queue, "b-0", tenant="B", quotas=waiting) == Enqueued.CREATED
    assert await put(queue, "a-0", tenant="A", quotas=waiting) == Enqueued.EXISTS   # its own job: no new place
    in_flight = TenantQuotas(max_in_flight=3)
    await queue.claim(2, "w1", LEASE_MS)                                    # a-0 and b-0 run: A has 1 + 1
    assert await put(queue, "a-2", tenant="A", quotas=in_flight) == Enqueued.CREATED
    assert await put(queue, "a-3", tenant="A", quotas=in_flight) == Enqueued.TENANT_IN_FLIGHT
    assert await put(queue, "a-3", tenant="A", quotas=waiting) == Enqueued.TENANT_WAITING
    assert await put(queue, "b-1", tenant="B", quotas=in_flight) == Enqueued.CREATED
    # tokens per minute: a minute admits jobs up to the quota, or one larger job alone. Whichever
    # minute each enqueue falls in, three in a row cross at most one minute, so one is refused.
    tokens = TenantQuotas(tokens_per_min=100)
    assert await put(queue, "t-0", tenant="T", quotas=tokens, tokens=60) == Enqueued.CREATED
    assert await put(queue, "t-1", tenant="T", quotas=tokens, tokens=40) == Enqueued.CREATED
    assert Enqueued.TENANT_TOKENS in [await put(queue, f"t-{i}", tenant="T", quotas=tokens, tokens=1)
                                      for i in range(2, 5)]
    assert await put(queue, "u-0", tenant="U", quotas=tokens, tokens=150) == Enqueued.CREATED
    assert Enqueued.TENANT_TOKENS in [await put(queue, f"u-{i}", tenant="U", quotas=tokens, tokens=150)
                                      for i in range(1, 4)]


async def test_two_enqueues_never_both_take_a_tenants_last_place(queue, redis_url):
    clients = [aioredis.Redis.from_url(redis_url) for _ in range(8)]
    try:
        producers = [RedisQueue(c, "test:q", ["interactive", "bulk"]) for c in clients]
        outcomes = await asyncio.gather(*(put(p, f"a-{i}", tenant="A", quotas=TenantQuotas(max_in_flight=3))
                                          for i, p in enumerate(producers * 4)))
    finally:
        for c in clients:
            await c.aclose()
    assert outcomes.count(Enqueued.CREATED) == 3 and await counts_of(queue, "A") == (3, 0)


# ---------------------------------------------------------------------- preemption across lanes
async def test_preemption_tokens_and_the_preempt_claim(queue, redis):
    """An interactive job enqueued while bulk jobs run leaves one preemption token; the busy
    worker that takes it claims that job from above its victim's lane (exactly one worker wins)
    and the preemption is counted for the victim's lane. Without running bulk work, no token."""
    await put(queue, "chat-idle")
    assert await redis.llen(queue.keys.preempt("interactive")) == 0        # nothing lower runs: no token
    await queue.claim(1, "w0", LEASE_MS)
    await put(queue, "bulk-0", "bulk")
    await put(queue, "bulk-1", "bulk")
    await queue.claim(2, "w1", LEASE_MS)                                     # both bulk jobs run on w1
    await put(queue, "bulk-2", "bulk")                                       # bulk work waits too
    await put(queue, "chat-0")
    assert await preemption_token(queue, "bulk") == BusyToken("interactive", fair=False)   # one token, one worker
    assert await preemption_token(queue, "bulk") is None
    assert await preemption_token(queue, "interactive") is None      # nothing is above the top lane
    winner = await queue.preempt("bulk", "w1", LEASE_MS)
    assert winner is not None and (winner.id, winner.lane) == ("chat-0", "interactive")
    assert await queue.preempt("bulk", "w2", LEASE_MS) is None              # the job goes to one worker
    assert {c.lane: c.preempted for c in await queue.counts()} == {"interactive": 0, "bulk": 1}
    await put(queue, "chat-1")                      # the next one runs in w1's reserve: nobody yields
    in_reserve = await queue.preempt("bulk", "w1", LEASE_MS, hand_back=False)
    assert in_reserve is not None and in_reserve.id == "chat-1"
    assert {c.lane: c.preempted for c in await queue.counts()} == {"interactive": 0, "bulk": 1}
    assert {c.lane: c.running for c in await queue.counts()} == {"interactive": 3, "bulk": 2}


async def preemption_token(queue: RedisQueue, below_lane: str) -> BusyToken | None:
    return await queue.wait_for_busy_token(0.1, below_lane=below_lane, fair_lane=None)


async def test_preempt_declines_when_an_idle_worker_took_the_wake_up(queue, redis):
    """A worker with a free slot takes the enqueue's wake token and claims the job itself, so no
    busy worker yields a slot for it."""
    await put(queue, "bulk-0", "bulk")
    await queue.claim(1, "busy", LEASE_MS)
    await put(queue, "chat-0")
    assert await queue.wait_for_work(0.1)                                   # an idle worker's wake-up
    assert await queue.preempt("bulk", "busy", LEASE_MS) is None
    assert [j.id for j in await queue.claim(1, "idle", LEASE_MS)] == ["chat-0"]


# ---------------------------------------------------------------------- no lane starves
@pytest.mark.parametrize("redis_backend", ON_EVERY_BACKEND)
async def test_a_claim_fills_the_slots_owed_to_a_lower_lane_first(queue):
    """CLAIM takes up to ``owed[lane]`` jobs of each lower lane before the strict order, so a worker
    owing bulk one slot gets a bulk job even while interactive jobs wait; a slot owed to a lane with
    nothing waiting goes to the higher lane, and without owed slots lanes are strict."""
    for i in range(2):
        await put(queue, f"bulk-{i}", "bulk")
    for i in range(4):
        await put(queue, f"chat-{i}")
    assert [j.id for j in await queue.claim(2, "w1", LEASE_MS, owed={"bulk": 1})] == ["bulk-0", "chat-0"]
    assert [j.id for j in await queue.claim(1, "w1", LEASE_MS)] == ["chat-1"]                # nothing owed: strict
    assert [j.id for j in await queue.claim(3, "w2", LEASE_MS, owed={"bulk": 2})] == ["bulk-1", "chat-2", "chat-3"]
    await put(queue, "chat-4")
    assert [j.id for j in await queue.claim(1, "w3", LEASE_MS, owed={"bulk": 1})] == ["chat-4"]   # bulk is empty
    assert {c.lane: c.running for c in await queue.counts()} == {"interactive": 5, "bulk": 2}


# ---------------------------------------------------------------------- the reserve lent to a tenant
async def test_fair_share_tokens_and_the_lend_reserve_claim(queue, redis):
    """A tenant's first job, enqueued while another tenant's jobs of its lane run (and more wait),
    leaves a fair-share token; the full worker that takes it claims that job into its reserve,
    marked lent. A job of a tenant with work running or waiting leaves no token, and is not lent
    the reserve even when a token is left over: the claim checks the next job's tenant."""
    fair = queue.keys.fair("interactive")
    for i in range(3):
        await put(queue, f"a-{i}", tenant="A")
    assert await redis.llen(fair) == 0                       # nothing ran in the lane at A's first job
    await queue.claim(2, "w1", LEASE_MS)                     # A holds both of w1's slots; a-2 waits
    await put(queue, "a-3", tenant="A")
    await put(queue, "c-0", "bulk", tenant="C")              # nothing runs in the bulk lane
    assert await redis.llen(fair) == await redis.llen(queue.keys.fair("bulk")) == 0
    await put(queue, "b-0", tenant="B")
    token = await queue.wait_for_busy_token(0.1, below_lane=None, fair_lane="interactive")
    assert token == BusyToken("interactive", fair=True)
    assert await queue.wait_for_busy_token(0.1, below_lane=None, fair_lane="interactive") is None
    lent = await queue.lend_reserve("interactive", "w1", LEASE_MS)
    assert lent is not None and (lent.id, lent.lane, lent.lent_reserve) == ("b-0", "interactive", True)
    assert await counts_of(queue, "B") == (0, 1)
    assert await queue.lend_reserve("interactive", "w2", LEASE_MS) is None     # next is a-2: A runs jobs
    await put(queue, "b-1", tenant="B")                      # ahead of A's backlog, but B has a job running
    assert await redis.llen(fair) == 0
    assert await queue.lend_reserve("interactive", "w2", LEASE_MS) is None
    assert [j.id for j in await queue.claim(1, "w2", LEASE_MS)] == ["b-1"]      # its turn at the next free slot


async def test_lend_reserve_declines_when_an_idle_worker_took_the_wake_up(queue):
    await put(queue, "a-0", tenant="A")
    await queue.claim(1, "busy", LEASE_MS)
    await put(queue, "b-0", tenant="B")
    assert await queue.wait_for_work(0.1)                    # an idle worker's wake-up: it claims b-0 itself
    assert await queue.lend_reserve("interactive", "busy", LEASE_MS) is None
    assert [j.id for j in await queue.claim(1, "idle", LEASE_MS)] == ["b-0"]


def test_lane_names_are_checked():
    with pytest.raises(ValueError, match="lane 'Bulk'"):
        QueueKeys("q", ("interactive", "Bulk"))
    with pytest.raises(ValueError, match="distinct"):
        QueueKeys("q", ("a", "a"))

