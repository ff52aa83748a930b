"""The paths beside the claim path, on a real Valkey Cluster with one replica per primary
(docs/cluster.md): a cancel reaches the running job's worker, an enqueue waits for its replica
(``SLOTQ_REDIS_WAIT_REPLICAS``), the queue's counts age its jobs by its own node's clock, and dead
letters are recorded, listed, requeued and removed. A cluster refuses a script whose keys span
slots and a transaction, so each call passing is a check of the layout."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import cast

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import RedisError

from slotq.jobs.errors import RedisUnavailable
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol import dead_letters
from slotq.jobs.protocol.connection import connect
from slotq.jobs.protocol.keys import DeadLetterKeys
from slotq.jobs.protocol.payload import encode_payload
from slotq.jobs.protocol.redis_queue import Enqueued, RedisQueue, ReplicasBehind, WaitReplicas
from slotq.jobs.protocol.serialization import serialize
from slotq.jobs.protocol.wire import ErrorInfo
from slotq.jobs.redis_cluster import LocalValkeyCluster
from slotq.jobs.settings import ClientSettings
from tests.support.jobs import job_request
from tests.support.processes import frozen

LANES = ("interactive", "bulk")


async def enqueue(queue: RedisQueue, job_id: str, wait_replicas: WaitReplicas | None = None) -> Enqueued:
    return await queue.enqueue(job_id, "generate", {}, lane="bulk", max_waiting=None, serializer=serialize,
                               wait_replicas=wait_replicas)


@pytest.mark.slow
async def test_a_cancel_reaches_the_worker_running_the_job(replicated_redis: Redis) -> None:
    queue = RedisQueue(replicated_redis, "slotq:queue", LANES)
    assert await enqueue(queue, "long") == Enqueued.CREATED
    [job] = await queue.claim(1, "w1", 30_000)
    aborted = asyncio.Event()

    async def on_abort() -> None:
        aborted.set()

    following = asyncio.create_task(queue.follow_aborts("w1", on_abort))
    try:
        channel = queue.keys.abort_channel("w1")
        async with queue_node(replicated_redis, queue) as primary, asyncio.timeout(30):
            while not (await primary.pubsub_numsub(channel))[0][1]:
                await asyncio.sleep(0.05)        # subscribed on the queue's node, where CANCEL publishes
            assert await queue.cancel(job.id) == -1
            await aborted.wait()
    finally:
        following.cancel()


def queue_port(replicated_redis: Redis, queue: RedisQueue) -> int:
    """The port of the primary that holds the queue's keys, by the client's slot map."""
    node = cast(RedisCluster, replicated_redis).get_node_from_key(queue.keys.jobs)
    assert node is not None
    return int(node.port)


def queue_node(replicated_redis: Redis, queue: RedisQueue) -> Redis:
    """A plain client of the primary that holds the queue's keys."""
    return Redis(port=queue_port(replicated_redis, queue))


async def test_an_enqueue_waits_for_its_replica_on_the_queues_node(replicated_cluster: LocalValkeyCluster,
        replicated_redis: Redis) -> None:
    queue = RedisQueue(replicated_redis, "slotq:queue", LANES)
    assert await enqueue(queue, "a", wait_replicas=WaitReplicas(1, 10_000)) == Enqueued.CREATED
    assert await enqueue(queue, "a", wait_replicas=WaitReplicas(1, 10_000)) == Enqueued.EXISTS
    with pytest.raises(ReplicasBehind) as behind:            # one replica per primary: one acknowledges
        await enqueue(queue, "b", wait_replicas=WaitReplicas(2, 100))
    assert (behind.value.acknowledged, behind.value.wanted) == (1, 2)

    # The queue's replica stopped: the WAIT counts the enqueue's own write, which it has not taken. A WAIT on
    # any other connection (no writes of its own) or node would have said 1 at once.
    async with queue_node(replicated_redis, queue) as primary:
        port = queue_port(replicated_redis, queue)
        shard = next(node.shard for node in replicated_cluster.nodes() if node.port == port)
        [replica] = [node for node in replicated_cluster.nodes() if node.shard == shard and node.role == "replica"]
        with frozen(replica.pid):
            assert await primary.wait(1, 100) == 1
            with pytest.raises(ReplicasBehind) as behind:
                await enqueue(queue, "c", wait_replicas=WaitReplicas(1, 300))
            assert behind.value.acknowledged == 0
    assert await enqueue(queue, "d", wait_replicas=WaitReplicas(1, 10_000)) == Enqueued.CREATED
    assert await queue.in_queue(["a", "b", "c", "d"]) == [True] * 4


async def test_a_producer_with_wait_replicas_enqueues_on_a_cluster(replicated_cluster: LocalValkeyCluster,
        replicated_redis: Redis) -> None:
    for wanted in (1, 2):
        settings = ClientSettings(redis_url=replicated_cluster.url, redis_wait_replicas=wanted,
                                  redis_connect_timeout_s=1)
        async with await SlotqClient.connect(replicated_cluster.url, settings) as client:
            if wanted == 1:
                handle = await client.enqueue(job_request())
                assert await client.queue.in_queue([handle.id]) == [True]
            else:
                with pytest.raises(RedisUnavailable, match="only 1 of 2 replicas acknowledged it"):
                    await client.enqueue(job_request())


async def test_counts_age_a_waiting_job_by_the_queues_clock(replicated_cluster: LocalValkeyCluster,
        replicated_redis: Redis) -> None:
    queue = RedisQueue(replicated_redis, "slotq:queue", LANES)
    assert await enqueue(queue, "waits") == Enqueued.CREATED
    await cast(RedisCluster, replicated_redis).config_resetstat(target_nodes=RedisCluster.PRIMARIES)
    [interactive, bulk] = await queue.counts()
    assert (interactive.waiting, interactive.oldest_waiting_age_s) == (0, None)
    assert bulk.waiting == 1 and bulk.oldest_waiting_age_s is not None and 0 <= bulk.oldest_waiting_age_s < 60
    asked = {node.port: await time_calls(node.port) for node in replicated_cluster.nodes() if node.role == "primary"}
    queue_node_port = queue_port(replicated_redis, queue)
    assert asked == {port: int(port == queue_node_port) for port in asked}    # the queue's node alone


async def time_calls(port: int) -> int:
    """TIME commands the node on ``port`` ran since its statistics were reset."""
    async with Redis(port=port) as node:
        return int((await node.info("commandstats")).get("cmdstat_time", {}).get("calls", 0))


async def test_dead_letters_are_recorded_listed_requeued_and_removed(replicated_cluster: LocalValkeyCluster,
                                                                     replicated_redis: Redis) -> None:
    keys = DeadLetterKeys(clustered=True)
    assert len({key_slot(key.encode()) for key in (keys.record("a"), keys.record("b"), keys.index, keys.reasons)}) == 1
    payload = encode_payload(job_request())
    killed = ErrorInfo(code="killed_its_worker", message="killed 2 workers", retryable=False)
    exhausted = ErrorInfo(code="tries_exhausted", message="tries", retryable=True)
    for job_id, error in [("killer", killed), ("killer", killed), ("flaky", exhausted), ("flakier", exhausted)]:
        await dead_letters.record(replicated_redis, job_id, payload, error, attempts=3, enqueued_at=None,
                                  worker_deaths=2 if error is killed else 0)
    assert sorted(await dead_letters.list_ids(replicated_redis)) == ["flakier", "flaky", "killer"]
    assert await dead_letters.count(replicated_redis) == 3                  # dead-lettered twice: counted once
    assert await dead_letters.by_reason(replicated_redis) == {"killed_its_worker": 1, "tries_exhausted": 2}
    letter = await dead_letters.get(replicated_redis, "killer")
    assert letter is not None and (letter.reason, letter.worker_deaths, letter.attempts) == ("killed_its_worker", 2, 3)

    assert await dead_letters.remove(replicated_redis, "flaky")
    assert not await dead_letters.remove(replicated_redis, "flaky")
    assert await dead_letters.by_reason(replicated_redis) == {"killed_its_worker": 1, "tries_exhausted": 1}

    settings = ClientSettings(redis_url=replicated_cluster.url)
    async with await SlotqClient.connect(replicated_cluster.url, settings) as client:
        assert await client.requeue_dead_letter("flakier")
        assert await client.queue.in_queue(["flakier"]) == [True]
    assert await dead_letters.get(replicated_redis, "flakier") is None
    assert await dead_letters.list_ids(replicated_redis) == ["killer"]
    assert await dead_letters.by_reason(replicated_redis) == {"killed_its_worker": 1}


@pytest.mark.slow
async def test_the_cancel_listener_follows_its_node_through_a_failover(tmp_path: Path) -> None:
    """The subscription's node (the queue's primary) is killed: the listener fails, and started again as the
    worker's supervisor starts it, it subscribes on the promoted replica and hears the next cancel."""
    with LocalValkeyCluster(tmp_path / "ha", primaries=3, replicas_per_primary=1) as ha:
        replicated_redis = await connect(ha.url, patient=False)
        try:
            queue = RedisQueue(replicated_redis, "slotq:queue", LANES)
            for job_id in ("before", "after"):
                assert await enqueue(queue, job_id) == Enqueued.CREATED
            claimed = await queue.claim(2, "w1", 60_000)
            aborts: asyncio.Queue[None] = asyncio.Queue()
            failures: list[Exception] = []

            async def on_abort() -> None:
                aborts.put_nowait(None)

            async def supervised() -> None:               # as the worker's Supervisor restarts a failed loop
                while True:
                    try:
                        await queue.follow_aborts("w1", on_abort)
                    except RedisError as exc:
                        failures.append(exc)
                        await asyncio.sleep(0.1)

            async def subscribed() -> None:
                async with queue_node(replicated_redis, queue) as primary:
                    while not (await primary.pubsub_numsub(queue.keys.abort_channel("w1")))[0][1]:
                        await asyncio.sleep(0.05)

            following = asyncio.create_task(supervised())
            try:
                async with asyncio.timeout(120):
                    await subscribed()
                    assert await queue.cancel(claimed[0].id) == -1
                    await aborts.get()
                    old_primary = queue_port(replicated_redis, queue)
                    ha.kill_primary(old_primary)
                    await asyncio.to_thread(ha.wait_for_failover)
                    while failures == []:
                        await asyncio.sleep(0.05)
                    while True:                           # the queue's own commands find the new primary
                        try:
                            await queue.counts()
                            break
                        except RedisError:
                            await asyncio.sleep(0.1)
                    assert queue_port(replicated_redis, queue) != old_primary
                    await subscribed()
                    assert await queue.cancel(claimed[1].id) == -1
                    await aborts.get()
            finally:
                following.cancel()
        finally:
            await replicated_redis.aclose()
