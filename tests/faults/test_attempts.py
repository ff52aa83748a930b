"""How a job's attempts are counted and reported (issue 23, and two bookkeeping edges of issue 18).

Tries count failures, not interruptions: an attempt lost with its worker after delivering new
tokens spends no try, while one lost before delivering anything new spends one, so a job that
kills every worker it touches still reaches the dead-letter queue after ``SLOTQ_MAX_TRIES``. The
kill tests run real ``slotq worker`` processes that SIGKILL themselves at an exact token
(``slotq.jobs.worker.fault_injection.JobFaults``), restarted as a supervisor would, on a Valkey of their own.
"""

from __future__ import annotations

import asyncio
import io
import json
import time

import jsonschema
import pytest
from rich.console import Console

from slotq.jobs.cli.status_view import render
from slotq.jobs.producer.client import JobHandle, SlotqClient
from slotq.jobs.protocol import dead_letters
from slotq.jobs.protocol.keys import retry_counter_key, stream_key
from slotq.jobs.protocol.redis_queue import AttemptOutcomes
from slotq.jobs.protocol.schemas import (
    EntryKind,
    JobRequest,
    JobResult,
    JobStatus,
    QueueInfo,
    StreamEntry,
    assemble_tool_calls,
)
from slotq.jobs.protocol.streams import encode_entry
from slotq.jobs.protocol.wire import FinishReason, Usage
from tests.support.faults import ON_EVERY_FAULT_BACKEND, Fleet, check_job, worker_env
from tests.support.jobs import chunks, collect_stream, job_request, raw_entries

MAX_TRIES = 2
# These kills hit every job of the worker: the tries are under test here, not the worker deaths that
# dead-letter a job sooner (SLOTQ_MAX_WORKER_DEATHS, tests/faults/test_poison.py).
MAX_WORKER_DEATHS = 10
JOB_TOKENS = 300


def _rendered(info: QueueInfo) -> str:
    """``slotq status`` as a terminal shows it."""
    console = Console(width=400, record=True, file=io.StringIO())
    console.print(render(info))
    return console.export_text()


async def _run_with_restarts(fleet: Fleet, job: JobHandle, timeout: float = 90) -> tuple[JobResult, int]:
    """Keep one worker running, starting a new one whenever the last died (as a supervisor
    would), until the job has a result. Returns the result and how many workers died."""
    deaths = 0
    current = fleet.spawn()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        finished = await fleet.client.finished([job.id])
        if job.id in finished:
            return finished[job.id], deaths
        if current.proc.poll() is not None:
            deaths += 1
            current = fleet.spawn()
        await asyncio.sleep(0.05)
    raise TimeoutError(f"job {job.id} had no result after {timeout} s and {deaths} worker deaths:\n{fleet.logs()}")


async def _kill_scenario(client: SlotqClient, redis_url: str, model, tmp_path, **faults: int) -> tuple[JobResult, int]:
    env = worker_env(redis_url, model, max_tries=MAX_TRIES, max_worker_deaths=MAX_WORKER_DEATHS, poll_delay_s=0.2,
                     **{f"fault_{name}": value for name, value in faults.items()})
    fleet = Fleet(client, env, tmp_path)
    try:
        job = await client.enqueue(job_request("interrupted, not failed", max_tokens=JOB_TOKENS))
        return await _run_with_restarts(fleet, job)
    finally:
        fleet.stop_all()


@pytest.mark.fault
@ON_EVERY_FAULT_BACKEND
async def test_a_job_killed_after_each_bit_of_progress_still_succeeds(fclient, fsync_redis, tiny_model_path, tmp_path):
    """Every attempt streams 80 new tokens, then its worker is killed with -9: three kills, one
    more than max_tries, and the job still succeeds, its stream equal to its result."""
    result, deaths = await _kill_scenario(fclient, fsync_redis.url, tiny_model_path, tmp_path, kill_after_new_tokens=80)
    assert deaths == 3 > MAX_TRIES
    assert result.status == JobStatus.SUCCEEDED, result
    assert (result.attempts, result.interruptions) == (4, 3), result      # one try spent: the last attempt
    s = await check_job(fclient, result, max_tokens=JOB_TOKENS)
    assert s.attempts == [1, 2, 3, 4]
    assert await fclient.queue.attempt_outcomes() == AttemptOutcomes(interrupted=3, failed=0)
    summary = _rendered(await fclient.queue_info())
    assert "3 attempts interrupted (no try spent), 0 failed" in summary, summary


@pytest.mark.fault
@ON_EVERY_FAULT_BACKEND
async def test_a_job_that_kills_its_worker_before_its_first_token_is_dead_lettered(fclient, fsync_redis,
                                                                                  tiny_model_path, tmp_path):
    """No attempt delivers anything: each lost attempt spends a try, and the attempt after the
    last try dead-letters the job, saying none of them was an interruption."""
    result, deaths = await _kill_scenario(fclient, fsync_redis.url, tiny_model_path, tmp_path, kill_before_token=1)
    assert deaths == MAX_TRIES
    assert result.status == JobStatus.FAILED and result.error is not None, result
    assert result.error.code == "tries_exhausted"
    assert (result.attempts, result.interruptions) == (MAX_TRIES + 1, 0), result
    letter = await dead_letters.get(fclient.redis, result.id)
    assert letter is not None and (letter.attempts, letter.interruptions) == (MAX_TRIES + 1, 0), letter
    assert not chunks(await raw_entries(fclient, result.id))
    assert await fclient.queue.attempt_outcomes() == AttemptOutcomes(interrupted=0, failed=MAX_TRIES)


@pytest.mark.fault
@ON_EVERY_FAULT_BACKEND
async def test_a_job_that_kills_its_worker_at_the_same_token_each_time_is_dead_lettered(fclient, fsync_redis,
                                                                                       tiny_model_path, tmp_path):
    """The first attempt delivers 49 tokens (an interruption: no try spent); every later one dies
    before token 50, adding nothing, so each spends a try until the job is dead-lettered."""
    result, deaths = await _kill_scenario(fclient, fsync_redis.url, tiny_model_path, tmp_path, kill_before_token=50)
    assert deaths == MAX_TRIES + 1
    assert result.status == JobStatus.FAILED and result.error is not None, result
    assert result.error.code == "tries_exhausted"
    assert (result.attempts, result.interruptions) == (MAX_TRIES + 2, 1), result
    letter = await dead_letters.get(fclient.redis, result.id)
    assert letter is not None and (letter.attempts, letter.interruptions) == (MAX_TRIES + 2, 1), letter
    assert sum(len(e.token_ids) for e in chunks(await raw_entries(fclient, result.id))) == 49
    assert await fclient.queue.attempt_outcomes() == AttemptOutcomes(interrupted=1, failed=MAX_TRIES)


async def test_a_job_whose_stream_is_complete_gets_the_result_of_the_attempt_that_completed_it(client,
                                                                                               start_worker):
    """Attempt 1 (worker "ghost") streamed everything, final entry included, but its lease expired
    before its finish (a cut longer than the lease). The next attempt writes the result from the
    stream: it names attempt 1 and its worker, and spends no try (max_tries 1 is not exceeded)."""
    job = await client.enqueue(job_request("done before the cut", max_tokens=3))
    assert [claim.id for claim in await client.queue.claim(1, "ghost", lease_ms=100)] == [job.id]
    await client.redis.incr(retry_counter_key(job.id))            # arq's run_job counted attempt 1
    usage = Usage(prompt_tokens=7, completion_tokens=3)
    for entry in (StreamEntry(id="", kind=EntryKind.CHUNK, attempt=1, text="abc", token_ids=[97, 98, 99], n_tokens=3),
                  StreamEntry(id="", kind=EntryKind.DONE, attempt=1, finish_reason=FinishReason.LENGTH, usage=usage,
                              worker="ghost", final=True)):
        await client.redis.xadd(stream_key(job.id), encode_entry(entry))
    await asyncio.sleep(0.2)                                       # the ghost's lease expires
    await start_worker(max_tries=1, worker_name="second")
    result = await job.result(timeout=30)
    assert result.status == JobStatus.SUCCEEDED, result
    assert (result.worker, result.attempts, result.text, result.usage) == ("ghost", 1, "abc", usage), result
    assert await dead_letters.count(client.redis) == 0


async def test_a_job_whose_stream_was_trimmed_starts_over_instead_of_resuming_from_a_wrong_prefix(client,
                                                                                                   start_worker):
    """Attempt 1 ("ghost") streamed two chunks and lost its lease; SLOTQ_STREAM_MAXLEN then trimmed the
    first away. What the stream holds is no longer the prefix the job delivered (before, the next attempt
    resumed from the second chunk's tokens, silently): it writes a RESTART entry, which tells the
    stream's readers to discard what came before, and generates from scratch -- its reply is the one a
    fresh run of the same request gives."""
    request = job_request("trimmed away", max_tokens=6)
    job = await client.enqueue(request)
    assert [claim.id for claim in await client.queue.claim(1, "ghost", lease_ms=100)] == [job.id]
    await client.redis.incr(retry_counter_key(job.id))            # arq's run_job counted attempt 1
    for text, ids in (("ab", [97, 98]), ("cd", [99, 100])):
        await client.redis.xadd(stream_key(job.id), encode_entry(StreamEntry(
            id="", kind=EntryKind.CHUNK, attempt=1, text=text, token_ids=ids, n_tokens=ids[-1] - 96)))
    await client.redis.xtrim(stream_key(job.id), maxlen=1, approximate=False)
    await asyncio.sleep(0.2)                                       # the ghost's lease expires
    await start_worker(worker_name="second")
    result = await job.result(timeout=60)
    fresh = await (await client.enqueue(request)).result(timeout=60)
    assert result.status == fresh.status == JobStatus.SUCCEEDED, (result, fresh)
    assert (result.text, result.usage.completion_tokens) == (fresh.text, 6), (result, fresh)
    kinds = [entry.kind for entry in await raw_entries(client, job.id)]
    assert kinds[:2] == [EntryKind.CHUNK, EntryKind.RESTART] and kinds[-1] == EntryKind.DONE, kinds


async def test_a_cancelled_running_job_reports_the_tokens_it_computed(client, start_worker):
    """Usage of a job cancelled mid-generation: its prompt and every token it delivered, in the
    result and in its final stream entry (billing and metrics read them)."""
    await start_worker(ctx=4096)
    job = await client.enqueue(job_request("count what was computed", max_tokens=2000))
    async with asyncio.timeout(60):
        async for entry in job.stream():
            if entry.kind == EntryKind.CHUNK:
                break
    assert await job.cancel()
    entries = await collect_stream(client, job.id)
    result = await job.result(timeout=60)
    assert result.status == JobStatus.CANCELLED, result
    streamed = sum(len(e.token_ids) for e in chunks(await raw_entries(client, job.id)))
    assert 0 < streamed < 2000
    assert result.usage.completion_tokens == streamed, (result.usage, streamed)
    assert result.usage.prompt_tokens > 0, result.usage
    final = entries[-1]
    assert final.final and final.finish_reason == FinishReason.CANCELLED and final.usage == result.usage, final


@pytest.mark.fault
async def test_a_tool_call_cut_by_worker_kills_streams_each_piece_once(fclient, fsync_redis, tiny_model_path, tmp_path):
    """A forced call (about 80 tokens on the byte-level tiny model) whose worker is killed every 20
    new tokens: each resumed attempt replays the delivered tokens through the reply parser, so the
    stream read from the start holds each call once, with one id, its pieces adding up to the
    result's arguments, which validate."""
    env = worker_env(fsync_redis.url, tiny_model_path, ctx=2048, max_worker_deaths=MAX_WORKER_DEATHS,
                     poll_delay_s=0.2, fault_kill_after_new_tokens=20)
    fleet = Fleet(fclient, env, tmp_path)
    parameters = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                  "properties": {"city": {"enum": ["Paris", "Tokyo"]},
                                 "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
    try:
        job = await fclient.enqueue(JobRequest(
            messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=200, tool_choice="required",
            tools=[{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}],
            sampling={"temperature": 0}))
        result, deaths = await _run_with_restarts(fleet, job)
    finally:
        fleet.stop_all()
    assert deaths >= 2 and result.status == JobStatus.SUCCEEDED, (deaths, result)
    assert result.finish_reason == FinishReason.TOOL_CALLS
    [call] = result.choices[0].tool_calls
    jsonschema.validate(json.loads(call.function.arguments), parameters)
    pieces = [d for e in await collect_stream(fclient, job.id) for d in e.tool_calls]
    assert [d.id for d in pieces if d.id is not None] == [call.id]
    assert assemble_tool_calls(pieces) == [call]
