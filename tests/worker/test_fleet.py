"""The claim path with a fleet bigger than arq's old ``queue_read_limit``: real SlotqWorkers on
simulated engines (``bench/sim_engine.py``, the fleet benchmark's stand-in for llama.cpp) and a
real Valkey.

Before the redesign, running jobs stayed at the head of arq's queue and every poll read at most
1000 entries: with more than 1000 jobs running, a newly enqueued job was invisible to every
worker until enough of them finished. Here 1250 long jobs run and a new one is still claimed at
once by a worker with a free slot."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bench.sim_engine import SimulatedEngine, SimulationParams
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.redis_queue import ClaimedJob
from slotq.jobs.worker.worker import SlotqWorker
from tests.support.jobs import job_request, settings_for

OLD_QUEUE_READ_LIMIT = 1000
WORKERS, SLOTS = 5, 256                      # 1280 slots
LONG_JOBS = 1250
FALLBACK_TICK_S = 30.0                       # so only the wake-up can claim the new job quickly
# A job that runs for the whole test: 1 token/s, one simulated decode step every 5 s.
SLOW = SimulationParams(tokens_per_s=1, step_s=5)


@pytest.fixture
async def fleet(redis_url: str, tiny_model_path: Path) -> AsyncIterator[list[SlotqWorker]]:
    workers = [SlotqWorker(settings_for(redis_url, model=str(tiny_model_path), slots=SLOTS, ctx=4096,
                                        poll_delay_s=FALLBACK_TICK_S, worker_name=f"sim-{i}"),
                           redis_url, engine_factory=SimulatedEngine.factory(SLOW))
               for i in range(WORKERS)]
    tasks = [asyncio.create_task(w.run(handle_signals=False)) for w in workers]
    try:
        async with asyncio.timeout(60):
            await asyncio.gather(*(w.ready.wait() for w in workers))
        yield workers
    finally:
        for w in workers:
            w.request_stop("test teardown", grace_s=0)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(60):
                await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_new_job_is_claimed_at_once_with_more_running_than_the_old_read_limit(
        fleet: list[SlotqWorker], client: SlotqClient) -> None:
    for start in range(0, LONG_JOBS, 250):
        await asyncio.gather(*(client.enqueue(job_request(f"long job {i}", max_tokens=1000))
                               for i in range(start, start + 250)))
    async with asyncio.timeout(60):
        while (await client.queue_info()).running < LONG_JOBS:
            await asyncio.sleep(0.1)
    assert LONG_JOBS > OLD_QUEUE_READ_LIMIT

    claimed_by: list[str] = []
    claimed = asyncio.Event()
    for w in fleet:
        assert w.runtime is not None
        observed = w.runtime.on_job_started

        def on_job_started(job: ClaimedJob, w: SlotqWorker = w, observed=observed) -> None:
            if observed is not None:
                observed(job)
            if job.id == "newcomer":
                claimed_by.append(w.id)
                claimed.set()

        w.runtime.on_job_started = on_job_started
    free_before = {w.id: w.settings.slots - len(w.runtime.claimed) for w in fleet if w.runtime is not None}
    assert sum(free_before.values()) == WORKERS * SLOTS - LONG_JOBS

    started = time.monotonic()
    await client.enqueue(job_request("newcomer", idempotency_key="newcomer", max_tokens=1000))
    # Well under the 30 s fallback tick: only the wake-up path can be this quick. arq's poll would
    # never have seen the job while more than 1000 others ran.
    async with asyncio.timeout(5):
        await claimed.wait()
    waited = time.monotonic() - started

    info = await client.queue_info()
    assert info.running == LONG_JOBS + 1 and info.queued == 0       # the long jobs all still run
    assert len(claimed_by) == 1 and free_before[claimed_by[0]] > 0  # one worker, one that had room
    assert waited < 5


async def test_concurrent_enqueues_share_one_read_of_the_workers(client: SlotqClient) -> None:
    """Each enqueue checks max_tokens against the workers' advertised context, read at most every
    few seconds. Enqueues that find that read stale together share one read: at hundreds of
    enqueues a second, each starting its own read stampeded Redis. The read itself is one range of
    the worker index, never a scan of the keyspace."""
    await client.redis.config_resetstat()
    await asyncio.gather(*(client.enqueue(job_request(f"job {i}")) for i in range(200)))
    stats = await client.redis.info("commandstats")
    assert stats["cmdstat_zrangebyscore"]["calls"] == 1     # one read of the worker index, not 200
    assert "cmdstat_scan" not in stats
