"""kill -9 of a worker of a partitioned queue (``SLOTQ_QUEUE_PARTITIONS=3``) on a 3-primary cluster of its
own: the dead worker's jobs, in every partition, are reaped from their partitions and finished by the other
worker; nothing lost, nothing run twice to the end, stream == result (``slotq worker`` subprocesses on the
tiny model, as tests/faults/test_faults_workers.py)."""

from __future__ import annotations

import asyncio

import pytest

from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.keys import partition_of
from slotq.jobs.protocol.schemas import JobStatus
from tests.protocol.test_queue_partitions import ids_in_every_partition
from tests.support.faults import Fleet, check_job, worker_env
from tests.support.jobs import job_request, raw_entries, settings_for

pytestmark = pytest.mark.fault

PARTITIONS = 3
TOKENS = 1500


@pytest.fixture
def fault_backend() -> str:
    return "cluster"


async def test_a_killed_workers_jobs_in_every_partition_finish_on_the_other(fsync_redis, tiny_model_path,
                                                                            tmp_path) -> None:
    url = fsync_redis.url
    async with await SlotqClient.connect(url, settings_for(url, queue_partitions=PARTITIONS)) as client:
        fleet = Fleet(client, worker_env(url, tiny_model_path, slots=3, ctx=2048, ubatch=1,
                                         queue_partitions=PARTITIONS), tmp_path)
        fleet.spawn("victim")
        try:
            await fleet.wait_ready("victim")
            ids = ids_in_every_partition(PARTITIONS, prefix="killed")
            handles = [await client.enqueue(job_request(f"job {job_id}", max_tokens=TOKENS, idempotency_key=job_id))
                       for job_id in ids]
            assert sorted(partition_of(h.id, PARTITIONS) for h in handles) == list(range(PARTITIONS))
            async with asyncio.timeout(60):                 # the victim streams all three
                while not all([await raw_entries(client, h.id) for h in handles]):
                    await asyncio.sleep(0.05)
            fleet.kill("victim")
            fleet.spawn("survivor")
            results = [await h.result(timeout=120) for h in handles]
            for result in results:
                assert result.status == JobStatus.SUCCEEDED and result.worker == "survivor", result
                assert result.attempts >= 2
                await check_job(client, result, TOKENS)
            assert sum(c.waiting + c.running for c in await client.queue.counts()) == 0
        finally:
            fleet.stop_all()
