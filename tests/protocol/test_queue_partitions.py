"""A queue split into partitions (``SLOTQ_QUEUE_PARTITIONS``, :mod:`slotq.jobs.protocol.partitioned_queue`):
the names spread over the slot space, one partition is exactly the unpartitioned queue, and the facade
routes by job id, claims over every partition but those its last claims found empty, wakes on any, and sums
the counts -- on one Valkey and on the session's 3-primary cluster, where every script passing is the check
that it stayed in one slot."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import time
from pathlib import Path
from typing import cast

import httpx
import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from slotq.jobs.errors import QueueFull
from slotq.jobs.gateway.app import create_app
from slotq.jobs.gateway.settings import GatewaySettings
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol import catalog, registry
from slotq.jobs.protocol.arq_adapter import Attempt, Retry
from slotq.jobs.protocol.catalog import CatalogEntry
from slotq.jobs.protocol.keys import CLUSTER_SLOTS, PartitionedKeys, QueueKeys, partition_names, partition_of
from slotq.jobs.protocol.partitioned_queue import DryPartitions, PartitionedQueue, open_queue
from slotq.jobs.protocol.redis_queue import Enqueued, RedisQueue
from slotq.jobs.protocol.schemas import JobKind, JobStatus, WorkerInfo
from slotq.jobs.protocol.serialization import deserialize, serialize
from slotq.jobs.protocol.shard_load import ShardLoadReader
from slotq.jobs.worker.runtime import QueueRuntime
from tests.support.jobs import ON_EVERY_BACKEND, job_request, settings_for
from tests.support.processes import wait_for_async

LANES = ("interactive", "bulk")


@pytest.fixture(params=ON_EVERY_BACKEND)
def redis_backend(request: pytest.FixtureRequest) -> str:
    return cast(str, request.param)


def ids_in_every_partition(partitions: int, per_partition: int = 1, prefix: str = "job") -> list[str]:
    """Job ids, ``per_partition`` of them in each of ``partitions`` partitions."""
    wanted = dict.fromkeys(range(partitions), per_partition)
    ids = []
    for n in itertools.count():
        job_id = f"{prefix}-{n}"
        if wanted[partition_of(job_id, partitions)]:
            wanted[partition_of(job_id, partitions)] -= 1
            ids.append(job_id)
        if not any(wanted.values()):
            return ids
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------- names and routing (no Redis)
@pytest.mark.parametrize("queue", ["slotq:queue", "slotq:queue:llama-8b", "model-0"])
@pytest.mark.parametrize("partitions", [2, 3, 4, 6, 8])
def test_partition_names_fall_one_in_each_equal_part_of_the_slots(queue: str, partitions: int) -> None:
    names = partition_names(queue, partitions)
    assert names[0] == queue and len(set(names)) == partitions
    assert all(name.startswith(f"{queue}#") for name in names[1:])
    home = key_slot(queue.encode())
    width = CLUSTER_SLOTS / partitions
    for i, name in enumerate(names):
        # each lies i P-ths after the queue's own slot: the same place in the i-th next primary's range
        assert key_slot(name.encode()) == (home + round(i * width)) % CLUSTER_SLOTS
    # a cluster of P primaries holding equal contiguous ranges: one partition on each
    edges = [round(k * width) for k in range(1, partitions)]
    assert {bisect.bisect(edges, key_slot(name.encode())) for name in names} == set(range(partitions))
    assert partition_names(queue, partitions) == names          # deterministic


def test_one_partition_is_the_queue_of_every_release() -> None:
    assert partition_names("slotq:queue", 1) == ("slotq:queue",)
    redis = Redis()             # never connected: only the keys are read
    queue = open_queue(redis, "slotq:queue", LANES)
    assert type(queue) is RedisQueue and queue.keys == QueueKeys("slotq:queue", LANES)
    assert queue.arq_keys is queue.keys
    assert all(partition_of(f"job-{n}", 1) == 0 for n in range(100))
    with pytest.raises(ValueError, match="hash tag"):
        partition_names("{slotq}:queue", 2)
    with pytest.raises(ValueError, match="1..64"):
        partition_names("slotq:queue", 65)


def test_a_job_id_always_maps_to_one_partition_and_ids_spread() -> None:
    ids = [f"job-{n}" for n in range(3000)]
    assert [partition_of(job_id, 3) for job_id in ids] == [partition_of(job_id, 3) for job_id in ids]
    spread = [sum(partition_of(job_id, 3) == i for job_id in ids) for i in range(3)]
    assert all(900 < count < 1100 for count in spread), spread
    keys = PartitionedKeys(tuple(QueueKeys(name, LANES, clustered=True) for name in partition_names("q", 3)))
    for job_id in ids[:50]:
        arq_id = keys.arq_id(job_id)
        assert arq_id == keys.of_job(job_id).arq_id(job_id) and keys.job_id(arq_id) == job_id
        assert arq_id.startswith(f"{{{partition_names('q', 3)[partition_of(job_id, 3)]}}}:")


# ---------------------------------------------------------------------- the facade on Redis
async def enqueue(queue: RedisQueue | PartitionedQueue, job_id: str, lane: str = "interactive") -> Enqueued:
    return await queue.enqueue(job_id, "generate", {"id": job_id}, lane=lane, max_waiting=None, serializer=serialize)


async def test_jobs_land_in_their_partitions_and_one_claim_takes_them_from_all(redis: Redis,
                                                                                redis_backend: str) -> None:
    queue = open_queue(redis, "slotq:queue", LANES, partitions=3)
    assert isinstance(queue, PartitionedQueue)
    ids = ids_in_every_partition(3, per_partition=4)
    for job_id in ids:
        assert await enqueue(queue, job_id) == Enqueued.CREATED
    assert await enqueue(queue, ids[0]) == Enqueued.EXISTS
    for i, part in enumerate(queue.partitions):
        assert sorted(await redis.hkeys(part.keys.jobs)) == sorted(
            job_id.encode() for job_id in ids if partition_of(job_id, 3) == i)
    if redis_backend == "cluster":
        nodes = {cast(RedisCluster, redis).get_node_from_key(part.keys.jobs).name for part in queue.partitions}
        assert len(nodes) == 3, "the three partitions' claim paths are on the three primaries"

    # counts are sums of the partitions' counts
    [interactive, bulk] = await queue.counts()
    assert (interactive.waiting, interactive.running, bulk.waiting) == (12, 0, 0)
    assert [(await part.counts())[0].waiting for part in queue.partitions] == [4, 4, 4]
    assert interactive.oldest_waiting_age_s is not None
    assert await queue.tenants_waiting() == {"default": 12}
    assert (await queue.tenant_counts("default")).waiting == 12
    assert await queue.in_queue([*ids, "nope"]) == [True] * 12 + [False]

    claimed = await queue.claim(7, "w1", 30_000)
    assert len(claimed) == 7
    claimed += await queue.claim(10, "w1", 30_000)
    assert sorted(job.id for job in claimed) == sorted(ids)          # every job once, from every partition
    assert await queue.claim(5, "w1", 30_000) == []
    assert (await queue.counts())[0].running == 12
    assert await queue.renew(claimed, 30_000) == [True] * 12
    for job in claimed[:6]:
        assert await queue.finish(job, b"done", 60_000)
    for job in claimed[6:9]:
        assert await queue.hand_back(job)
    assert await queue.cancel(claimed[9].id) == -1                    # running: abort requested
    assert await queue.place(claimed[10].id) == ("interactive", True)
    assert await queue.place(claimed[0].id) == (None, False)
    [interactive, _] = await queue.counts()
    assert (interactive.waiting, interactive.running) == (3, 3)
    assert await queue.forget([job.id for job in claimed[:6]]) == 6


async def test_a_reap_requeues_expired_leases_in_every_partition(redis: Redis) -> None:
    queue = open_queue(redis, "slotq:queue", LANES, partitions=3)
    ids = ids_in_every_partition(3, per_partition=2)
    for job_id in ids:
        await enqueue(queue, job_id)
    claimed = await queue.claim(6, "dead-worker", 200)
    assert len(claimed) == 6
    await asyncio.sleep(0.4)                           # every lease expires: its worker died
    assert await queue.reap() == 6
    [interactive, _] = await queue.counts()
    assert (interactive.waiting, interactive.running) == (6, 0)
    again = await queue.claim(6, "w2", 30_000)
    assert sorted(job.id for job in again) == sorted(ids)
    assert not any(await queue.renew(claimed, 30_000))          # the dead worker's leases are void
    assert all(await queue.renew(again, 30_000))


async def test_cancel_and_results_are_found_by_job_id(redis: Redis) -> None:
    queue = open_queue(redis, "slotq:queue", LANES, partitions=4)
    ids = ids_in_every_partition(4)
    for job_id in ids:
        await enqueue(queue, job_id)
    assert [await queue.cancel(job_id) for job_id in ids] == [1] * 4
    assert await queue.cancel(ids[0]) == 0
    for job_id in ids:
        await queue.store_result(job_id, "generate", {"text": job_id}, ttl_ms=60_000, serializer=serialize)
    records = await queue.result_records([*ids, "nope"], deserialize)
    assert sorted(records) == sorted(ids)
    record = await queue.result_record(ids[2], deserialize)
    assert record is not None and record.output == {"text": ids[2]}


async def test_an_idle_wait_wakes_on_any_partition_and_loses_no_token(redis: Redis) -> None:
    queue = open_queue(redis, "slotq:queue", LANES, partitions=3)
    assert isinstance(queue, PartitionedQueue)
    for job_id in ids_in_every_partition(3):
        waiting = asyncio.create_task(queue.wait_for_work(10))
        await asyncio.sleep(0.2)                     # blocked on every partition's wake list
        started = time.monotonic()
        await enqueue(queue, job_id)
        assert await waiting and time.monotonic() - started < 2
        assert queue._woken_from == partition_of(job_id, 3)
        [claimed] = await queue.claim(1, "w1", 30_000)
        assert claimed.id == job_id
    # two tokens at once in two partitions: one wait takes one, the other is given back, not lost
    both = ids_in_every_partition(3, prefix="pair")[:2]
    for job_id in both:
        await enqueue(queue, job_id)
    assert await queue.wait_for_work(1) and await queue.wait_for_work(1)
    assert not await queue.wait_for_work(0.2)


async def test_a_pop_left_pending_passes_on_the_token_it_takes_while_its_worker_does_not_wait(redis: Redis) -> None:
    """Worker 1 woke on partition 0's token; its pops on the other partitions stay pending (not cancelled) and
    are first in line there. A token they take while worker 1 does not wait is given back at once, so the
    idle worker 2 behind them still wakes."""
    one, two = (open_queue(redis, "slotq:queue", LANES, partitions=3) for _ in range(2))
    assert isinstance(one, PartitionedQueue) and isinstance(two, PartitionedQueue)
    first, second = ids_in_every_partition(3)[:2]
    waiting = asyncio.create_task(one.wait_for_work(10))
    await asyncio.sleep(0.2)
    await enqueue(one, first)
    assert await waiting and one._woken_from == partition_of(first, 3)
    other = asyncio.create_task(two.wait_for_work(10))
    await asyncio.sleep(0.2)                     # queued behind worker 1's pending pops
    started = time.monotonic()
    await enqueue(one, second)
    assert await other and two._woken_from == partition_of(second, 3)
    assert time.monotonic() - started < 2
    assert await one.wait_for_work(0.3) is False     # worker 1's old pops took nothing it keeps


async def test_preemption_works_within_a_partition(redis: Redis) -> None:
    """A higher lane's job preempts a lower lane's running job of its own partition only (given up: one of
    another partition leaves no preemption token); the token names its partition."""
    queue = open_queue(redis, "slotq:queue", LANES, partitions=3)
    assert isinstance(queue, PartitionedQueue)
    low = "low-0"
    await enqueue(queue, low, lane="bulk")
    [victim] = await queue.claim(1, "w1", 30_000)
    elsewhere, same = (next(job_id for job_id in (f"high-{n}" for n in itertools.count()) if wanted(job_id))
                       for wanted in (lambda j: partition_of(j, 3) != partition_of(low, 3),
                                      lambda j: partition_of(j, 3) == partition_of(low, 3)))
    await enqueue(queue, elsewhere)
    assert await queue.wait_for_busy_token(0.3, below_lane="bulk", fair_lane=None) is None
    waiting = asyncio.create_task(queue.wait_for_busy_token(10, below_lane="bulk", fair_lane=None))
    await asyncio.sleep(0.2)
    await enqueue(queue, same)
    token = await waiting
    assert token is not None and (token.lane, token.fair, token.partition) == ("interactive", False,
                                                                                partition_of(low, 3))
    taken = await queue.preempt(victim.lane, "w1", 30_000)
    assert taken is not None and taken.id in (same, elsewhere)     # any partition's waiting job above


@pytest.mark.parametrize("redis_backend", ["cluster"])
async def test_status_shows_each_shards_partitions(redis: Redis) -> None:
    """``slotq status``'s shard table on a partitioned queue: each primary names the partition whose slot it
    serves and counts that partition's keys among slotq's; a model's queue in the catalog is listed by
    partition on the shards of their slots."""
    queue = open_queue(redis, "slotq:queue", LANES, partitions=3)
    assert isinstance(queue, PartitionedQueue)
    for job_id in ids_in_every_partition(3, per_partition=5):
        await enqueue(queue, job_id)
    offer = CatalogEntry(model="m", queue="slotq:queue:m", kind=JobKind.GENERATION, fingerprint="f")
    await catalog.CatalogPublisher("w1").beat(redis, [offer], ttl_s=60, now=time.time())
    keys = [part.keys.jobs for part in queue.partitions]
    shards = await ShardLoadReader(redis, queue.keys.jobs, partition_keys=keys).read()
    assert sorted(index for shard in shards for index in shard.partitions) == [0, 1, 2]
    assert all(len(shard.partitions) == 1 for shard in shards)                  # one partition per primary
    [home] = [shard for shard in shards if shard.queue_slot is not None]
    assert home.partitions == [0]
    # each partition holds 5 jobs: a record each, and its sets and hashes
    assert all(shard.slotq_keys >= 5 for shard in shards)
    assert sorted(name for shard in shards for name in shard.queues) == sorted(partition_names("slotq:queue:m", 3))
    assert all(len(shard.queues) == 1 for shard in shards)


# ---------------------------------------------------------------------- claims skip the partitions found empty
def test_a_partition_stays_dry_until_work_is_seen_there_or_its_recheck() -> None:
    dry = DryPartitions(3, recheck_s=30)
    dry.claim_sent(1)()                                  # a claim of partition 1 took fewer jobs than it asked
    assert dry.claimable([2, 0, 1]) == [2, 0]
    dry.got_work(1)
    assert dry.claimable([1, 2, 0]) == [1, 2, 0]
    found_fewer = dry.claim_sent(2)
    dry.got_work(2)                                      # a token of partition 2 taken while its claim was on its way
    found_fewer()
    assert dry.claimable([0, 1, 2]) == [0, 1, 2]         # the work may have come after the claim looked
    never = DryPartitions(3, recheck_s=0)
    for i in range(3):
        never.claim_sent(i)()
    assert never.claimable([0, 1, 2]) == [0, 1, 2]


async def pops(redis: Redis, queue: PartitionedQueue) -> int:
    """ZPOPMIN calls on the nodes of ``queue``'s partitions together (``INFO commandstats`` counts a script's
    commands under their own names): the claim scripts' pops, one per lane a claim looks at."""
    if isinstance(redis, RedisCluster):
        nodes = {node.name: node for node in (redis.get_node_from_key(part.keys.jobs) for part in queue.partitions)}
        stats = [await redis.info("commandstats", target_nodes=node) for node in nodes.values()]
    else:
        stats = [await redis.info("commandstats")]
    return sum(int(node_stats.get("cmdstat_zpopmin", {}).get("calls", 0)) for node_stats in stats)


async def claimed_with_pops(redis: Redis, queue: PartitionedQueue, max_jobs: int) -> tuple[list[str], int]:
    """The ids ``queue.claim(max_jobs)`` took, and how many partitions it claimed from (by their pops)."""
    before = await pops(redis, queue)
    claimed = await queue.claim(max_jobs, "w1", 30_000)
    visited, rest = divmod(await pops(redis, queue) - before, len(LANES))
    assert rest == 0, "each claim that finds fewer jobs than it asks looks at every lane"
    return [job.id for job in claimed], visited


async def test_a_claim_skips_the_partitions_found_empty_until_a_token_of_theirs_is_taken(redis: Redis,
                                                                                         redis_backend: str) -> None:
    """Each claim that took fewer jobs than it asked marks its partition dry for this worker: the next claim
    sends nothing there, and nothing at all when every partition is dry. A wake token taken from a dry
    partition (a job enqueued by another process) makes it claimable at once, and so does a token given back
    (taken in the same instant as the first, or while nobody waited)."""
    worker = open_queue(redis, "slotq:queue", LANES, partitions=3, dry_recheck_s=30)
    producer = open_queue(redis, "slotq:queue", LANES, partitions=3)
    assert isinstance(worker, PartitionedQueue) and isinstance(producer, PartitionedQueue)
    first, second, _ = ids_in_every_partition(3)
    await enqueue(producer, first)
    assert await claimed_with_pops(redis, worker, 4) == ([first], 3)      # each partition gave fewer than 4
    assert await claimed_with_pops(redis, worker, 4) == ([], 0)           # every one dry: nothing sent

    await enqueue(producer, second)
    assert await claimed_with_pops(redis, worker, 4) == ([], 0)           # not seen yet: no token taken
    assert await worker.wait_for_work(5) and worker._woken_from == partition_of(second, 3)
    assert await claimed_with_pops(redis, worker, 4) == ([second], 1)     # that partition alone

    # two tokens at once: the wait takes one; the other partition's pop gives its token back, and that
    # partition is claimable too
    both = ids_in_every_partition(3, prefix="pair")[:2]
    for job_id in both:
        await enqueue(producer, job_id)
    assert await worker.wait_for_work(5)
    await asyncio.sleep(0.2)                           # the other pop took its token and gave it back
    claimed, visited = await claimed_with_pops(redis, worker, 4)
    assert sorted(claimed) == sorted(both) and visited == 2


async def test_a_job_this_worker_hands_back_or_reaps_is_claimable_at_once(redis: Redis) -> None:
    worker = open_queue(redis, "slotq:queue", LANES, partitions=3, dry_recheck_s=30)
    assert isinstance(worker, PartitionedQueue)
    ids = ids_in_every_partition(3)
    for job_id in ids:
        await enqueue(worker, job_id)
    claimed = await worker.claim(6, "w1", 300)         # every partition dry
    assert len(claimed) == 3
    assert await worker.hand_back(claimed[0])
    assert await claimed_with_pops(redis, worker, 6) == ([claimed[0].id], 1)
    await asyncio.sleep(0.4)                           # the other two leases expire
    assert await worker.reap() == 2
    claimed_again, visited = await claimed_with_pops(redis, worker, 6)
    assert sorted(claimed_again) == sorted(job.id for job in claimed[1:]) and visited == 2


async def test_a_retry_due_in_a_dry_partition_is_claimed_once_its_mark_is_a_recheck_old(redis: Redis) -> None:
    """A retry that falls due gets no wake token (only a claim or a reap moves it to waiting), so a dry
    partition is still claimed once its mark is ``dry_recheck_s`` old."""
    recheck_s = 0.6
    worker = open_queue(redis, "slotq:queue", LANES, partitions=3, dry_recheck_s=recheck_s)
    assert isinstance(worker, PartitionedQueue)
    await enqueue(worker, "flaky")
    [job] = await worker.claim(2, "w1", 30_000)        # every partition dry
    marked = time.monotonic()
    assert await worker.retry_later(job, 100)
    assert not await worker.wait_for_work(0.3)         # due by now, and no token says so
    assert await claimed_with_pops(redis, worker, 2) == ([], 0)
    await asyncio.sleep(marked + recheck_s - time.monotonic())
    assert await claimed_with_pops(redis, worker, 2) == (["flaky"], 3)


async def test_the_claim_loop_runs_a_retry_in_a_dry_partition_within_a_poll_of_its_due_time(redis: Redis) -> None:
    """The worker's loop (:class:`QueueRuntime`) on a partitioned queue whose claims skip dry partitions for a
    poll delay: a job that asks for a retry in 0.2 s runs again within about a poll of that, as an idle
    worker's poll claims it on one queue."""
    poll_s = 1.0
    queue = open_queue(redis, "slotq:queue", LANES, partitions=3, dry_recheck_s=poll_s)
    started: list[float] = []

    async def flaky(attempt: Attempt, payload: object) -> str:
        started.append(time.monotonic())
        if len(started) == 1:
            raise Retry(defer=0.2)
        return "done"

    runtime = QueueRuntime(function_name="generate", job=flaky, queue=queue, token="w1", lease_ms=30_000, slots=2,
                           job_timeout_s=60, keep_result_s=60, max_tries=5, poll_delay_s=poll_s, serializer=serialize,
                           deserializer=deserialize)
    loop = asyncio.create_task(runtime.run())
    try:
        await asyncio.sleep(0.3)                       # idle: its first claim found every partition empty
        await enqueue(open_queue(redis, "slotq:queue", LANES, partitions=3), "flaky")
        await wait_for_async(lambda: _finished(queue), timeout=10, what="the retried job to finish")
        assert len(started) == 2 and started[1] - started[0] < 0.2 + poll_s + 0.5
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
        await runtime.close()


async def _finished(queue: PartitionedQueue | RedisQueue) -> bool:
    return sum(c.waiting + c.deferred + c.running for c in await queue.counts()) == 0 and bool(
        await queue.result_records(["flaky"], deserialize))


# ---------------------------------------------------------------------- the queue's limit, split
def ids_in_partition(partition: int, count: int, partitions: int = 3) -> list[str]:
    ids = ids_in_every_partition(partitions, per_partition=count, prefix="full")
    return [job_id for job_id in ids if partition_of(job_id, partitions) == partition]


async def test_a_full_partition_is_named_with_its_share_of_the_limit(redis_url: str) -> None:
    """SLOTQ_MAX_QUEUE_LENGTH=4 over 3 partitions: each holds ceil(4 / 3) = 2 waiting jobs. The job that a
    full partition refuses is told which partition, its share and the setting -- not a limit of 2 the user
    never set, beside a queue that holds fewer than 4 -- and the other partitions still take jobs."""
    settings = settings_for(redis_url, queue_partitions=3, max_queue_length=4)
    async with await SlotqClient.connect(redis_url, settings) as client:
        held, refused = ids_in_partition(2, 2), ids_in_partition(2, 3)[2]
        for job_id in held:
            await client.enqueue(job_request(idempotency_key=job_id))
        with pytest.raises(QueueFull) as full:
            await client.enqueue(job_request(idempotency_key=refused))
        error = full.value
        assert (error.depth, error.limit, error.partition, error.partitions, error.max_queue_length) == (2, 2, 2, 3, 4)
        assert str(error) == (
            "queue is full: partition 2 of 3 holds 2 jobs waiting, its share (ceil(4 / 3) = 2) of "
            "SLOTQ_MAX_QUEUE_LENGTH=4 under SLOTQ_QUEUE_PARTITIONS=3 (partitions 0..2: a job's partition is its "
            "id's, so one may fill before the others)")
        assert await client.status(refused) == JobStatus.NOT_FOUND
        [elsewhere] = ids_in_partition(0, 1)
        assert (await client.enqueue(job_request(idempotency_key=elsewhere))).created


@pytest.mark.timeout(30)
@pytest.mark.parametrize("redis_backend", ["single"])
async def test_the_gateway_answers_a_full_partition_with_its_message(redis_url: str, tmp_path: Path) -> None:
    """The gateway's 429 for that refusal carries the same words (OpenAI's error shape, ``queue_full``,
    Retry-After unchanged)."""
    redis = Redis.from_url(redis_url)
    try:
        now = time.time()
        await registry.beat(redis, WorkerInfo(id="w1", queue="slotq:queue", model="m", slots_total=1, slots_busy=1,
                                              waiting=0, generated_tokens=0, started_at=now, updated_at=now,
                                              partitions=3), interval_s=60)
    finally:
        await redis.aclose()
    settings = GatewaySettings(_env_file=None, gateway_files_dir=tmp_path, queue_partitions=3, max_queue_length=4)
    app = create_app(settings, redis_url)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as http:
        async def post(key: str) -> httpx.Response:
            return await http.post("/v1/jobs", json={"model": "m", "prompt": "hi", "max_tokens": 1},
                                   headers={"Idempotency-Key": key}, timeout=10)

        for job_id in ids_in_partition(1, 2):
            assert (await post(job_id)).status_code == 202
        answer = await post(ids_in_partition(1, 3)[2])
    assert answer.status_code == 429
    assert answer.headers["retry-after"] == str(settings.gateway_retry_after_s)
    error = answer.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_exceeded", "queue_full")
    assert error["message"].startswith(
        "queue is full: partition 1 of 3 holds 2 jobs waiting, its share (ceil(4 / 3) = 2) of "
        "SLOTQ_MAX_QUEUE_LENGTH=4 under SLOTQ_QUEUE_PARTITIONS=3")
