"""Fault injection on Redis: the server is SIGKILLed mid-run and restarted on the same port.

The server fsyncs every write before acknowledging it (``appendfsync always``), so a SIGKILL
loses nothing that a client was told is written; workers and producers retry their commands for
about 30 s, so the outage is a pause. Every job must end succeeded with a stream whose chunk text
equals its result text and holds one token per completion token.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from slotq.jobs.protocol.schemas import EntryKind, JobStatus
from tests.support.faults import FaultyProxy, Fleet, check_job, report, stream_summary, worker_env
from tests.support.jobs import job_request, raw_entries

pytestmark = pytest.mark.fault

N_JOBS = 20
MAX_TOKENS = 600


async def _streams_started(client, job_ids: list[str], at_least: int, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        started = 0
        for job_id in job_ids:
            if any(e.kind == EntryKind.CHUNK for e in await raw_entries(client, job_id)):
                started += 1
        if started >= at_least:
            return started
        await asyncio.sleep(0.005)
    raise TimeoutError(f"fewer than {at_least} jobs started streaming within {timeout} s")


async def _any_retried(client, job_ids: list[str]) -> bool:
    for job_id in job_ids:
        if any(e.attempt > 1 for e in await raw_entries(client, job_id)):
            return True
    return False


async def test_redis_sigkill_and_restart_mid_run_loses_nothing(fclient, fsync_redis, tiny_model_path, tmp_path):
    """Two workers (default 15 s job lock), 20 jobs; Redis is SIGKILLed once four jobs stream, and
    restarted on the same port a second later. (The workers are held still for the instant of the
    kill, so that no write is in flight -- test_stream_write_whose_reply_is_lost_is_not_duplicated
    covers that case deterministically.)"""
    client = fclient
    fleet = Fleet(client, worker_env(fsync_redis.url, tiny_model_path, slots=4, ctx=1024, lock_ttl_s=15), tmp_path)
    fleet.spawn("r1"), fleet.spawn("r2")
    try:
        await fleet.wait_ready("r1", "r2")
        handles = [await client.enqueue(job_request(f"redis outage job {i}", max_tokens=MAX_TOKENS))
                   for i in range(N_JOBS)]
        ids = [h.id for h in handles]
        await _streams_started(client, ids, at_least=4)

        await fleet.kill_redis_quietly(fsync_redis)
        killed = time.monotonic()
        await asyncio.sleep(1.0)
        await asyncio.to_thread(fsync_redis.restart)
        outage = time.monotonic() - killed

        async with asyncio.timeout(120):
            results = await asyncio.gather(*(h.result() for h in handles))
        wall = time.monotonic() - killed
        assert sorted(fleet.alive()) == ["r1", "r2"], fleet.logs()
        failed = [(r.id, r.status, r.error, r.attempts) for r in results if r.status != JobStatus.SUCCEEDED]
        assert not failed, (failed, fleet.logs())
        for result in results:
            await check_job(client, result, max_tokens=MAX_TOKENS)
        info = await client.queue_info()
        assert info.queued == info.running == info.deferred == 0, info
        assert info.dead_letters == 0
        report(f"REDIS_RESTART jobs={N_JOBS} outage_s={outage:.2f} all_done_s_after_kill={wall:.2f} "
               f"retried={sum(r.attempts > 1 for r in results)} lost=0")
    finally:
        codes = fleet.stop_all()
    assert all(code == 0 for code in codes.values()), (codes, fleet.logs())


async def test_redis_outage_longer_than_job_lock_runs_no_job_twice(fclient, fsync_redis, tiny_model_path, tmp_path):
    """An outage longer than the 3 s job lock: when Redis returns, the running jobs' locks have
    expired. Whichever worker reconnects first may claim the other's jobs (about one run in three);
    here r1 is held (SIGSTOP) until r2 has done so, which makes the race deterministic. No job may
    then run twice or stream twice (fenced leases), and r1 lives on."""
    client = fclient
    fleet = Fleet(client, worker_env(fsync_redis.url, tiny_model_path, slots=4, ctx=2048, lock_ttl_s=3), tmp_path)
    fleet.spawn("r1"), fleet.spawn("r2")
    try:
        await fleet.wait_ready("r1", "r2")
        fleet.pause("r2")                     # r1 claims the first four jobs
        try:
            handles = [await client.enqueue(job_request(f"long outage job {i}", max_tokens=1500)) for i in range(4)]
            await _streams_started(client, [h.id for h in handles], at_least=4)
        finally:
            fleet.resume("r2")
        handles += [await client.enqueue(job_request(f"long outage job {i}", max_tokens=1500)) for i in range(4, 8)]
        ids = [h.id for h in handles]

        await fleet.kill_redis_quietly(fsync_redis)
        fleet.pause("r1")
        try:
            await asyncio.sleep(5.0)
            await asyncio.to_thread(fsync_redis.restart)
            # r2 reconnects, finishes its own jobs, then finds r1's jobs unlocked and claims them
            async with asyncio.timeout(60):
                while not await _any_retried(client, ids):
                    await asyncio.sleep(0.01)
        finally:
            fleet.resume("r1")

        async with asyncio.timeout(120):
            results = await asyncio.gather(*(h.result() for h in handles))
        failed = [(r.id, r.status, r.error, r.attempts) for r in results if r.status != JobStatus.SUCCEEDED]
        assert not failed, (failed, fleet.logs())
        problems = []
        for result in results:
            entries = await raw_entries(client, result.id)
            s = stream_summary(entries)
            if s.finals != 1 or s.text != result.text or len(s.token_ids) != result.usage.completion_tokens:
                problems.append(f"{result.id}: attempts {s.attempts}, {s.finals} final entries, "
                                f"{len(s.token_ids)} streamed tokens for {result.usage.completion_tokens}")
        assert not problems, "; ".join(problems)
        assert await _any_retried(client, ids)
        assert sorted(fleet.alive()) == ["r1", "r2"], fleet.logs()
    finally:
        codes = fleet.stop_all()
    assert codes == {"r1": 0, "r2": 0}, fleet.logs()


async def test_stream_write_whose_reply_is_lost_is_not_duplicated(fclient, fsync_redis, tiny_model_path, tmp_path):
    """The worker talks to Redis through a proxy that, once armed, lets one stream write reach
    Redis and then cuts the connection before the reply: the write happened, the worker cannot
    know it. Its retry must not append the entries twice."""
    client = fclient
    proxy = FaultyProxy(fsync_redis.port)
    await proxy.start()
    fleet = Fleet(client, worker_env(proxy.url, tiny_model_path, slots=2, ctx=4096), tmp_path)
    fleet.spawn("p1")
    try:
        await fleet.wait_ready("p1")
        job = await client.enqueue(job_request("lost in transit", max_tokens=3000))
        async with asyncio.timeout(30):
            while not [e for e in await raw_entries(client, job.id) if e.kind == EntryKind.CHUNK]:
                await asyncio.sleep(0.002)
        proxy.arm(b"slotq:stream:", "drop_reply")
        result = await job.result(timeout=60)
        assert proxy.fired.is_set(), "the proxy never cut a stream write"
        assert result.status == JobStatus.SUCCEEDED, result
        assert result.usage.completion_tokens == 3000
        entries = await raw_entries(client, job.id)
        s = stream_summary(entries)
        assert s.finals == 1 and entries[-1].final
        assert len(s.token_ids) == 3000, f"{len(s.token_ids)} streamed tokens for 3000"
        assert s.text == result.text
        assert fleet.procs["p1"].proc.poll() is None
    finally:
        codes = await asyncio.to_thread(fleet.stop_all)     # the proxy runs on this loop: keep it serving
        await proxy.close()
    assert codes == {"p1": 0}, fleet.logs()


async def test_a_result_waited_for_outlasts_an_outage_shorter_than_its_timeout(fclient, fsync_redis):
    """A producer waiting for a job's result keeps waiting through a Redis outage that ends before its
    timeout, although each of its commands gives up after its own bound (0.8 x the 5 s connect timeout):
    the wait reads again, and the job's result, written once a worker runs it, ends it. An outage that
    outlasts the timeout ends the wait with Redis' error, not a hang."""
    handle = await fclient.enqueue(job_request("waits through an outage", max_tokens=2))
    waiting = asyncio.create_task(handle.result(timeout=60))
    await asyncio.sleep(0.5)
    fsync_redis.kill()
    await asyncio.sleep(10.0)                          # longer than a command's own retries (3.5 s), twice over:
    assert not waiting.done(), waiting                 # without the reads again, the wait failed after 8 s
    await asyncio.to_thread(fsync_redis.restart)
    await fclient.cancel(handle.id)                    # ends the job: its result is written
    async with asyncio.timeout(30):
        result = await waiting
    assert result.status == JobStatus.CANCELLED

    second = await fclient.enqueue(job_request("outlasted", max_tokens=2))
    fsync_redis.kill()
    started = time.monotonic()
    with pytest.raises(Exception) as failed:           # redis-py's ConnectionError, raised by the wait
        await second.result(timeout=3)
    assert time.monotonic() - started < 3 + 6, "ends at its timeout plus one command's own retries"
    assert "Error" in type(failed.value).__name__, failed.value
