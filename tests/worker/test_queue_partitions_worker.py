"""One queue split into partitions (``SLOTQ_QUEUE_PARTITIONS``) served end to end: a real producer and real
workers on the tiny model, on one Valkey and on the session's 3-primary cluster, where the partitions'
claim paths land on the three primaries."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import pytest
from redis.asyncio.cluster import RedisCluster

from slotq.jobs.errors import QueuePartitionsDiffer
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.keys import partition_of
from slotq.jobs.protocol.partitioned_queue import PartitionedQueue
from slotq.jobs.protocol.schemas import JobStatus
from tests.protocol.test_queue_partitions import ids_in_every_partition
from tests.support.jobs import ON_EVERY_BACKEND, collect_stream, job_request, raw_entries, settings_for
from tests.support.tiny_model import write_tiny_llama

PARTITIONS = 3


@pytest.fixture(params=ON_EVERY_BACKEND)
def redis_backend(request: pytest.FixtureRequest) -> str:
    return cast(str, request.param)


@pytest.fixture
async def partitioned_client(redis_url: str) -> AsyncIterator[SlotqClient]:
    client = await SlotqClient.connect(redis_url, settings_for(redis_url, queue_partitions=PARTITIONS))
    try:
        yield client
    finally:
        await client.close()


async def test_one_queue_of_three_partitions_runs_every_job_once(partitioned_client: SlotqClient, start_worker,
                                                                 redis_backend: str) -> None:
    client = partitioned_client
    queue = client.queue
    assert isinstance(queue, PartitionedQueue)
    ids = ids_in_every_partition(PARTITIONS, per_partition=4)
    for job_id in ids:
        await client.enqueue(job_request(max_tokens=4, idempotency_key=job_id))
    cancelled = ids_in_every_partition(PARTITIONS, prefix="cancel")
    for job_id in cancelled:
        await client.enqueue(job_request(max_tokens=4, idempotency_key=job_id))
        assert await client.cancel(job_id)
    if redis_backend == "cluster":
        cluster = cast(RedisCluster, client.redis)
        holding = {cluster.get_node_from_key(part.keys.jobs).name for part in queue.partitions
                   if await cluster.hlen(part.keys.jobs)}
        assert len(holding) == 3, "the queue's jobs are on all three primaries"
    [interactive, _] = await queue.counts()
    assert interactive.waiting == len(ids)
    assert [(await part.counts())[0].waiting for part in queue.partitions] == [4, 4, 4]

    worker = await start_worker(queue_partitions=PARTITIONS, slots=4)
    results = {job_id: await client.result(job_id, timeout=60) for job_id in ids}
    assert all(result.status == JobStatus.SUCCEEDED for result in results.values())
    for job_id in ids:
        entries = await collect_stream(client, job_id)
        assert sum(entry.final for entry in entries) == 1
    assert worker.runtime is not None and worker.runtime.jobs_complete == len(ids)    # each once
    for job_id in cancelled:
        assert (await client.result(job_id, timeout=5)).status == JobStatus.CANCELLED
    assert sum(c.waiting + c.running for c in await queue.counts()) == 0


async def test_an_idle_worker_is_woken_by_a_job_in_any_partition(partitioned_client: SlotqClient,
                                                                  start_worker) -> None:
    """The poll is 30 s: each job picked up within seconds was picked up by its wake token."""
    client = partitioned_client
    await start_worker(queue_partitions=PARTITIONS, poll_delay_s=30)
    await asyncio.sleep(1)                        # the worker's first claim found nothing: it waits
    for job_id in ids_in_every_partition(PARTITIONS, prefix="wake"):
        started = time.monotonic()
        await client.enqueue(job_request(max_tokens=2, idempotency_key=job_id))
        result = await client.result(job_id, timeout=20)
        assert result.status == JobStatus.SUCCEEDED
        assert time.monotonic() - started < 10, f"partition {partition_of(job_id, PARTITIONS)}: not woken"
        await asyncio.sleep(0.5)                  # idle again, blocked on every partition's wake list


async def test_workers_and_producers_of_another_partition_count_refuse(partitioned_client: SlotqClient,
                                                                       start_worker, redis_url: str) -> None:
    await start_worker(queue_partitions=PARTITIONS)
    with pytest.raises(QueuePartitionsDiffer) as refused:
        await start_worker(queue_partitions=2, worker_name="two")
    message = str(refused.value)
    assert "SLOTQ_QUEUE_PARTITIONS=2" in message and "split into 3 partitions" in message

    async with await SlotqClient.connect(redis_url, settings_for(redis_url)) as one_partition:
        with pytest.raises(QueuePartitionsDiffer, match=r"split into 3 partitions .* SLOTQ_QUEUE_PARTITIONS=1"):
            await one_partition.enqueue(job_request(max_tokens=2))
        assert sum(c.waiting for c in await one_partition.queue.counts()) == 0      # nothing enqueued
    handle = await partitioned_client.enqueue(job_request(max_tokens=2))
    assert (await handle.result(timeout=30)).status == JobStatus.SUCCEEDED


@pytest.mark.parametrize("redis_backend", ["single"])
async def test_a_worker_of_two_models_serves_both_partitioned_queues(partitioned_client: SlotqClient, start_worker,
                                                                     tiny_model_path: Path, tmp_path: Path) -> None:
    """Each model's queue is split the same way; the worker switches between them and claims from every
    partition of each."""
    second = write_tiny_llama(tmp_path / "second.gguf", seed=11)
    await start_worker(model=None, models=f"first={tiny_model_path},second={second}", model_idle_s=0.2, slots=2,
                       queue_partitions=PARTITIONS)
    queues = {name: partitioned_client.for_queue(f"slotq:queue:{name}") for name in ("first", "second")}
    wanted = {}
    for model, queue in queues.items():
        for job_id in ids_in_every_partition(PARTITIONS, prefix=model):
            wanted[(await queue.enqueue(job_request(max_tokens=2, idempotency_key=job_id, model=model))).id] = model
    for job_id, model in wanted.items():
        result = await queues[model].result(job_id, timeout=60)
        assert (result.status, result.model) == (JobStatus.SUCCEEDED, model)


async def test_a_running_job_is_cancelled_through_its_partitions_channel(partitioned_client: SlotqClient,
                                                                         start_worker) -> None:
    """The worker follows every partition's cancel channel: a running job of each partition is cancelled at
    once, not at the next poll (30 s here)."""
    client = partitioned_client
    await start_worker(queue_partitions=PARTITIONS, poll_delay_s=30, ctx=4096)
    for job_id in ids_in_every_partition(PARTITIONS, prefix="running"):
        handle = await client.enqueue(job_request(max_tokens=3000, idempotency_key=job_id))
        async with asyncio.timeout(20):
            while not await raw_entries(client, job_id):
                await asyncio.sleep(0.05)
        started = time.monotonic()
        assert await client.cancel(job_id)
        result = await handle.result(timeout=20)
        assert result.status == JobStatus.CANCELLED and time.monotonic() - started < 10
