"""Scheduling across the fleet, on the tiny model and a real Valkey: preemption across lanes and
the reserve lent to a tenant (real ``slotq worker`` processes), and deadlines that cannot be met.
The claim scripts' own rules (tenants' fair share, preemption and fair-share tokens) are tested on
Valkey alone in tests/protocol/test_queue_claims.py.

Workers of two slots each are filled with long bulk jobs (more bulk work waits behind them), then
interactive jobs are enqueued. Each must finish while every bulk job that was running when it
arrived is still unfinished -- once it waited for one of them to end. Without a cache slot a bulk
job is handed back for each; with one (the default) the first runs in the worker's reserve beside
the bulk jobs and only the next, while it runs, takes a bulk job's slot. Every bulk job must still
end with exactly its ``max_tokens``, and its stream must spell its result: no token lost or
repeated across a hand-back.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from slotq.jobs.producer.client import JobHandle, SlotqClient
from slotq.jobs.protocol.schemas import JobResult, JobStatus
from tests.support.jobs import WorkerProcess, chunks, clean_env, job_request, raw_entries, wait_for_workers

BULK_TOKENS = 6000       # seconds of decoding on the tiny model: still running when the interactive job ends
HANDED_BACK_RE = re.compile(r"job (\S+) \(bulk\) hands its slot to job (\S+) \(interactive\)")
IN_RESERVE_RE = re.compile(r"job (\S+) \(interactive\) runs in the reserve beside \d+ jobs: a lane above")
LENT_RE = re.compile(r"job (\S+) \(interactive\) runs in the reserve beside \d+ jobs: its tenant has nothing running")


async def running_with_tokens(client: SlotqClient, jobs: list[JobHandle], slots: int = 4,
                              timeout: float = 120) -> list[JobHandle]:
    """Wait until every slot runs a bulk job that has streamed tokens; return those jobs."""
    async with asyncio.timeout(timeout):
        while True:
            running = [j for j in jobs if (await client.queue.place(j.id))[1]]
            if len(running) == slots and all([chunks(await raw_entries(client, j.id)) for j in running]):
                return running
            await asyncio.sleep(0.02)


async def assert_whole(client: SlotqClient, results: dict[str, JobResult], handed_back: set[str]) -> None:
    """Every bulk job ended with exactly its tokens, its stream spelling its result; a job handed
    back spent no try and counts no interruption."""
    for job_id, result in results.items():
        assert result.status == JobStatus.SUCCEEDED and result.usage.completion_tokens == BULK_TOKENS, job_id
        streamed = chunks(await raw_entries(client, job_id))
        assert "".join(e.text for e in streamed) == result.text, job_id              # nothing lost or repeated
        assert sum(len(e.token_ids) for e in streamed) == BULK_TOKENS, job_id
        assert [e.n_tokens for e in streamed] == sorted({e.n_tokens for e in streamed}), job_id
        if job_id in handed_back:
            assert result.attempts == 1 and result.interruptions == 0, result      # no try spent, no interruption


@pytest.mark.slow
async def test_interactive_jobs_preempt_bulk_jobs_on_every_worker(client, redis_url, tiny_model_path, tmp_path: Path):
    env = clean_env(redis_url=redis_url, model=tiny_model_path, slots=2, threads=1, ctx=6144, poll_delay_s=0.2,
                    cache_slots=0)      # no reserve: every interactive job takes a bulk job's slot
    procs = [WorkerProcess(name, env, tmp_path) for name in ("preempt-w1", "preempt-w2")]
    try:
        await wait_for_workers(client, {"preempt-w1", "preempt-w2"}, procs=procs)
        bulk = [await client.enqueue(job_request(f"bulk request {i}", max_tokens=BULK_TOKENS, lane="bulk"))
                for i in range(6)]
        for n in range(2):
            running = await running_with_tokens(client, bulk)
            chat = await client.enqueue(job_request(f"an interactive request {n}", max_tokens=8))
            result = await chat.result(timeout=120)
            assert result.status == JobStatus.SUCCEEDED and result.usage.completion_tokens == 8
            # It finished while every bulk job that ran when it arrived was still unfinished.
            assert all(await client.queue.in_queue([j.id for j in running])), n
        results = {j.id: await j.result(timeout=300) for j in bulk}
        counts = await client.queue.counts()
    finally:
        for p in procs:
            p.stop()
    handed_back = {m[1] for p in procs for m in HANDED_BACK_RE.finditer(p.log_tail(10**7))}
    assert handed_back and {c.lane: c.preempted for c in counts}["bulk"] == 2
    await assert_whole(client, results, handed_back)


@contextlib.asynccontextmanager
async def full_worker(client: SlotqClient, name: str, redis_url: str, model: Path, tmp_path: Path, prompt: str,
                      **fields: Any) -> AsyncIterator[tuple[WorkerProcess, list[JobHandle], list[JobHandle]]]:
    """A worker of two slots and one cache slot (the default), both slots running one of three
    long jobs of ``fields``: the process, the three jobs and the two running; stopped on exit."""
    env = clean_env(redis_url=redis_url, model=model, slots=2, threads=1, ctx=6144, poll_delay_s=0.2)
    proc = WorkerProcess(name, env, tmp_path)
    try:
        await wait_for_workers(client, {name}, procs=[proc])
        jobs = [await client.enqueue(job_request(f"{prompt} {i}", max_tokens=BULK_TOKENS, **fields)) for i in range(3)]
        yield proc, jobs, await running_with_tokens(client, jobs, slots=2)
    finally:
        proc.stop()


@pytest.mark.slow
async def test_a_full_worker_runs_an_interactive_job_in_its_reserve_and_hands_back_for_the_next(
        client, redis_url, tiny_model_path, tmp_path: Path):
    """With a cache slot (the default) the engine has a spare KV stream: an interactive job on a
    worker whose slots all run bulk jobs streams at once beside them, and no bulk job yields. A
    second one, while the first still runs, finds the reserve taken: a bulk job is handed back."""
    async with full_worker(client, "reserve-w", redis_url, tiny_model_path, tmp_path, "bulk request",
                           lane="bulk") as (proc, bulk, running):
        beside = await client.enqueue(job_request("a long interactive request", max_tokens=BULK_TOKENS))
        async with asyncio.timeout(30):
            while not chunks(await raw_entries(client, beside.id)):
                await asyncio.sleep(0.02)
        assert all(await client.queue.in_queue([j.id for j in running]))
        assert {c.lane: c.preempted for c in await client.queue.counts()}["bulk"] == 0
        assert {c.lane: c.running for c in await client.queue.counts()} == {"interactive": 1, "bulk": 2}
        chat = await client.enqueue(job_request("an interactive request", max_tokens=8))
        result = await chat.result(timeout=120)
        assert result.status == JobStatus.SUCCEEDED and result.usage.completion_tokens == 8
        assert {c.lane: c.preempted for c in await client.queue.counts()}["bulk"] == 1
        await beside.cancel()
        results = {j.id: await j.result(timeout=300) for j in bulk}
    log = proc.log_tail(10**7)
    assert [m[1] for m in IN_RESERVE_RE.finditer(log)] == [beside.id]
    handed_back = {m[1] for m in HANDED_BACK_RE.finditer(log)}
    assert len(handed_back) == 1 and handed_back <= set(results)
    await assert_whole(client, results, handed_back)


async def test_a_tenants_first_job_runs_in_the_reserve_beside_another_tenants_full_slots(
        client, redis_url, tiny_model_path, tmp_path: Path):
    """Within a lane nothing is handed back, so a tenant with a backlog holds every slot as its
    jobs turn over. Another tenant's first job runs at once in the worker's reserve beside them:
    it finishes while each of the first tenant's running jobs still runs, none of them yields,
    and the worker logs it as lent for its tenant, not as a higher lane's reserve run."""
    async with full_worker(client, "fair-w", redis_url, tiny_model_path, tmp_path, "tenant a's request",
                           tenant="a") as (proc, flood, running):
        first = await client.enqueue(job_request("tenant b's request", max_tokens=8, tenant="b"))
        result = await first.result(timeout=60)
        assert result.status == JobStatus.SUCCEEDED and result.usage.completion_tokens == 8
        assert all(await client.queue.in_queue([j.id for j in running]))
        assert {c.lane: c.preempted for c in await client.queue.counts()} == {"interactive": 0, "bulk": 0}
        for job in flood:
            await job.cancel()
    log = proc.log_tail(10**7)
    assert [m[1] for m in LENT_RE.finditer(log)] == [first.id] and not IN_RESERVE_RE.search(log)


async def test_a_worker_listens_for_preemption_as_soon_as_its_slots_fill(client, start_worker):
    """The claim that fills a worker's slots goes back to waiting before its jobs run, when there
    is no preemption candidate yet. With a poll delay of a minute, an interactive job must still
    take a bulk job's slot in seconds, not when that wait ends."""
    await start_worker(slots=2, ctx=6144, poll_delay_s=60, cache_slots=0)
    bulk = [await client.enqueue(job_request(f"bulk request {i}", max_tokens=BULK_TOKENS, lane="bulk"))
            for i in range(2)]
    running = await running_with_tokens(client, bulk, slots=2)
    chat = await client.enqueue(job_request("an interactive request", max_tokens=8))
    result = await chat.result(timeout=30)
    assert result.status == JobStatus.SUCCEEDED and all(await client.queue.in_queue([j.id for j in running]))
    assert {c.lane: c.preempted for c in await client.queue.counts()}["bulk"] == 1
    for job in bulk:
        await job.cancel()


async def test_a_deadline_nearer_than_one_decode_step_is_expired_without_running(client, start_worker,
                                                                                 monkeypatch: pytest.MonkeyPatch):
    """The worker's mean decode step is made 30 s: a job due in 10 s could not get even its first
    token, so it fails at once as ``expired`` and its stream says why; one due in 2 minutes runs."""
    worker = await start_worker()
    measured = worker.engine.stats
    monkeypatch.setattr(worker.engine, "stats", lambda: measured().model_copy(
        update={"generating_seconds": 30.0, "generating_steps": 1}))
    late = await client.enqueue(job_request("too late", deadline=time.time() + 10))
    result = await late.result(timeout=30)
    assert result.status == JobStatus.FAILED and result.error.code == "expired", result
    assert result.usage.completion_tokens == 0 and not chunks(await raw_entries(client, late.id))
    on_time = await client.enqueue(job_request("on time", deadline=time.time() + 120))
    assert (await on_time.result(timeout=30)).status == JobStatus.SUCCEEDED
