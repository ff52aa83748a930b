"""A worker with its engine in a process of its own (``SLOTQ_ENGINE_PROCESS=true``): jobs through Redis
stream what their results say, a cancel reaches the engine process, an engine process killed
with SIGKILL ends its worker with code 70 while another worker finishes the jobs, nothing lost, and
the engine process of a killed worker exits."""

from __future__ import annotations

import asyncio
import os

import pytest

from slotq.engine.process import EngineProcess
from slotq.jobs.protocol.schemas import EntryKind, JobStatus
from slotq.jobs.protocol.wire import FinishReason
from slotq.jobs.worker.elastic.memory import process_rss_bytes, worker_rss_bytes
from slotq.jobs.worker.worker import EXIT_ENGINE_DIED
from tests.support.faults import Fleet, check_job, engine_process_of, wait_exited, worker_env
from tests.support.jobs import collect_stream, job_request


async def test_jobs_stream_what_their_results_say_and_cancel_reaches_the_engine(client, start_worker):
    worker = await start_worker(engine_process=True, ctx=4096)
    engine = worker.engine
    assert isinstance(engine, EngineProcess) and engine.pid not in (None, os.getpid())
    assert worker_rss_bytes(engine.pid) > process_rss_bytes()      # the elastic loop counts the engine process

    handles = [await client.enqueue(job_request(f"job {i}", max_tokens=48)) for i in range(6)]   # 4 slots: 2 wait
    for handle in handles:
        result = await handle.result(timeout=60)
        entries = await collect_stream(client, handle.id)
        assert result.status == JobStatus.SUCCEEDED and result.finish_reason == FinishReason.LENGTH
        assert result.usage.completion_tokens == 48
        body = [e for e in entries if e.kind == EntryKind.CHUNK]
        assert "".join(e.text for e in body) == result.text
        assert sum(len(e.token_ids) for e in body) == 48
        assert sum(e.final for e in entries) == 1 and entries[-1].final

    job = await client.enqueue(job_request("cancel me", max_tokens=3000))
    async with asyncio.timeout(60):
        async for entry in job.stream():
            if entry.kind == EntryKind.CHUNK:
                break
    assert await job.cancel() is True
    result = await job.result(timeout=60)
    assert result.status == JobStatus.CANCELLED and result.finish_reason == FinishReason.CANCELLED
    entries = await collect_stream(client, job.id)
    assert "".join(e.text for e in entries if e.kind == EntryKind.CHUNK) == result.text
    assert result.usage.completion_tokens < 3000 and result.usage.prompt_tokens > 0   # counted by the child
    async with asyncio.timeout(30):
        while engine.stats().slots_busy:            # the engine process freed the slot
            await asyncio.sleep(0.05)
    assert engine.failure is None


@pytest.mark.fault
async def test_a_killed_engine_process_ends_the_worker_with_70_and_loses_no_job(fclient, fsync_redis,
                                                                               tiny_model_path, tmp_path):
    """SIGKILL of the engine process of `broken` mid-generation: the worker hands its jobs back and
    exits with code 70 (as when its engine thread dies); the healthy worker finishes every job,
    each streamed exactly once, without a try spent."""
    client = fclient
    fleet = Fleet(client, worker_env(fsync_redis.url, tiny_model_path, slots=2, ctx=4096, ubatch=1), tmp_path)
    broken = fleet.spawn("broken", engine_process="true")
    fleet.spawn("healthy")
    try:
        await fleet.wait_ready("broken", "healthy")
        fleet.pause("healthy")                          # the broken worker takes the first jobs
        try:
            handles = [await client.enqueue(job_request(f"job {i} of the kill", max_tokens=1500)) for i in range(3)]
            async with asyncio.timeout(60):
                async for entry in handles[0].stream():
                    if entry.kind == EntryKind.CHUNK:
                        break
            code = await fleet.kill_engine("broken")
        finally:
            fleet.resume("healthy")
        log = broken.log.read_text(errors="replace")
        assert code == EXIT_ENGINE_DIED, log[-3000:]
        assert "the engine process died" in log, log[-3000:]
        async with asyncio.timeout(120):
            results = await asyncio.gather(*(h.result() for h in handles))
        for result in results:
            assert result.status == JobStatus.SUCCEEDED, result
            assert result.worker == "healthy"
            assert result.attempts == 1, result                 # the dead engine used nobody's try
            await check_job(client, result, max_tokens=1500)    # streamed once, seamlessly resumed
        info = await client.queue_info()
        assert info.queued == info.running == info.deferred == 0 and info.dead_letters == 0
    finally:
        fleet.stop_all()


@pytest.mark.fault
async def test_the_engine_process_of_a_killed_worker_exits(fclient, fsync_redis, tiny_model_path, tmp_path):
    """SIGKILL of the worker: its engine process sees its socket close and exits, holding no model."""
    fleet = Fleet(fclient, worker_env(fsync_redis.url, tiny_model_path), tmp_path)
    worker = fleet.spawn("killed", engine_process="true")
    try:
        await fleet.wait_ready("killed")
        engine_pid = engine_process_of(worker.proc.pid)
        fleet.kill("killed")
        await wait_exited(engine_pid, 20)
    finally:
        fleet.stop_all()

