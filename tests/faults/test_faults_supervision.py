"""A worker never fails quietly: a dead engine thread and a failing heartbeat, injected into real
`slotq worker` processes through their fault hooks (engine/fault_injection.py,
jobs/worker/fault_injection.py), with a second worker beside them. Nothing may be lost or stuck, and no
attempt may be used by a fault that was not the job's."""

from __future__ import annotations

import asyncio
import time

import pytest

from slotq.jobs.protocol.schemas import JobStatus
from slotq.jobs.worker.worker import EXIT_ENGINE_DIED
from tests.support.faults import Fleet, check_job, worker_env
from tests.support.jobs import job_request

pytestmark = pytest.mark.fault


async def test_engine_death_hands_jobs_back_and_exits_nonzero(fclient, fsync_redis, tiny_model_path, tmp_path):
    """The engine thread of `broken` dies mid-generation (after 300 decode steps): it stops
    claiming, hands its jobs back without using a try, and exits with code 70 within seconds; the
    healthy worker finishes every job, each streamed exactly once."""
    client = fclient
    fleet = Fleet(client, worker_env(fsync_redis.url, tiny_model_path, slots=2, ctx=4096, ubatch=1), tmp_path)
    fleet.spawn("broken", fault_engine_crash_after_steps=300)
    fleet.spawn("healthy")
    try:
        await fleet.wait_ready("broken", "healthy")
        fleet.pause("healthy")                          # the broken worker takes the first jobs
        try:
            handles = [await client.enqueue(job_request(f"job {i} of the crash", max_tokens=1500)) for i in range(4)]
            proc = fleet.procs["broken"]
            code = await asyncio.to_thread(proc.proc.wait, 60)
            died_at = time.monotonic()
        finally:
            fleet.resume("healthy")
        log = proc.log.read_text(errors="replace")
        assert code == EXIT_ENGINE_DIED, log[-3000:]
        assert "the engine thread died" in log and "InjectedFault" in log, log[-3000:]
        async with asyncio.timeout(120):
            results = await asyncio.gather(*(h.result() for h in handles))
        for result in results:
            assert result.status == JobStatus.SUCCEEDED, result
            assert result.worker == "healthy"
            assert result.attempts == 1, result                 # the dead engine used nobody's try
            await check_job(client, result, max_tokens=1500)    # streamed once, seamlessly resumed
        info = await client.queue_info()
        assert info.queued == info.running == info.deferred == 0 and info.dead_letters == 0
        assert [w.id for w in info.workers] == ["healthy"]
        assert time.monotonic() - died_at < 120
    finally:
        fleet.stop_all()


async def test_heartbeat_failure_is_restarted_and_leases_kept(fclient, fsync_redis, tiny_model_path, tmp_path):
    """The heartbeat of `h1` raises on its 3rd beat, while a long job runs there (lease TTL 3 s,
    a beat every second). The supervisor logs it and restarts the loop: the lease is renewed in
    time, so the job finishes on h1 as attempt 1 and `h2` never takes it over."""
    client = fclient
    fleet = Fleet(client, worker_env(fsync_redis.url, tiny_model_path, slots=2, ctx=8192, ubatch=1), tmp_path)
    fleet.spawn("h1", fault_heartbeat_fail_at="3")
    fleet.spawn("h2")
    try:
        await fleet.wait_ready("h1", "h2")
        fleet.pause("h2")
        try:
            job = await client.enqueue(job_request("a long job while the heartbeat trips", max_tokens=5000))
            async with asyncio.timeout(30):
                while "background loop heartbeat failed" not in fleet.procs["h1"].log.read_text(errors="replace"):
                    await asyncio.sleep(0.1)
        finally:
            fleet.resume("h2")
        result = await job.result(timeout=120)
        log = fleet.procs["h1"].log.read_text(errors="replace")
        assert "InjectedFault" in log and "restarting it" in log, log[-3000:]
        assert result.status == JobStatus.SUCCEEDED and result.worker == "h1" and result.attempts == 1, result
        s = await check_job(client, result, max_tokens=5000)
        assert s.attempts == [1]
        assert "no longer this worker's" not in log
    finally:
        codes = fleet.stop_all()
    assert codes == {"h1": 0, "h2": 0}, fleet.logs()
