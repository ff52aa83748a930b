"""The Redis job path on arq: enqueue -> stream -> result, batching, resumable streams,
idempotency, validation at enqueue and backpressure. Real Valkey, real engine (tiny model); each
test runs on one Valkey and on a 3-primary Valkey Cluster."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from slotq.engine import FinishReason
from slotq.jobs.producer.client import QueueFull, SlotqClient
from slotq.jobs.protocol import streams
from slotq.jobs.protocol.keys import job_record_key
from slotq.jobs.protocol.schemas import EntryKind, JobRequest, JobStatus
from tests.support.jobs import (
    ON_EVERY_BACKEND,
    chunks,
    collect_stream,
    job_request,
    jobs_in_queue,
    raw_entries,
    settings_for,
)


@pytest.fixture(params=ON_EVERY_BACKEND)
def redis_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_enqueue_stream_result_end_to_end(client, worker):
    job = await client.enqueue(job_request("hello world", max_tokens=24))
    assert job.created
    entries = await collect_stream(client, job.id)
    result = await job.result(timeout=60)

    assert result.status == JobStatus.SUCCEEDED
    assert result.id == job.id
    assert result.attempts == 1
    assert result.worker == worker.id
    assert result.finish_reason == FinishReason.LENGTH

    body = chunks(entries)
    assert body, "no chunk entries"
    assert "".join(e.text for e in body) == result.text
    assert sum(len(e.token_ids) for e in body) == result.usage.completion_tokens == 24
    assert body[-1].n_tokens == result.usage.completion_tokens
    assert [e.n_tokens for e in body] == sorted(e.n_tokens for e in body)
    assert result.usage.prompt_tokens > 0
    assert all(e.attempt == 1 for e in entries)

    final = entries[-1]
    assert final.final and final.kind == EntryKind.DONE
    assert final.finish_reason == FinishReason.LENGTH
    assert final.usage is not None and final.usage.completion_tokens == 24
    assert sum(e.final for e in entries) == 1
    assert [e.id for e in entries] == [e.id for e in await raw_entries(client, job.id)]

    assert await job.status() == JobStatus.SUCCEEDED
    # the text() helper yields the same text
    assert "".join([t async for t in job.text()]) == result.text


async def test_a_job_that_fails_after_generating_reports_what_it_generated(client, start_worker):
    """Its prompt and the tokens its reply got before the error, in the result and the final
    entry, as a cancelled job's. Here the reply reaches a 3,000-value enum whose lexer costs more
    per token than SLOTQ_GRAMMAR_STEP_FUEL allows (the request fails, ``invalid_grammar``)."""
    await start_worker(grammar_step_fuel=1_000)
    schema = {"type": "object", "required": ["a", "b"], "properties": {
        "a": {"type": "string", "maxLength": 6}, "b": {"enum": [f"v{i:05d}{'x' * (i % 37)}" for i in range(3000)]}}}
    job = await client.enqueue(job_request("x", max_tokens=64, ignore_eos=False,
                                           sampling={"temperature": 0, "json_schema": schema}))
    result = await job.result(timeout=60)
    entries = await collect_stream(client, job.id)
    generated = sum(len(e.token_ids) for e in chunks(entries))
    assert result.status == JobStatus.FAILED and result.error is not None
    assert result.error.code == "invalid_grammar"
    assert generated > 0 and result.usage.completion_tokens == generated and result.usage.prompt_tokens > 0
    assert entries[-1].kind == EntryKind.ERROR and entries[-1].usage == result.usage


async def test_job_enqueued_while_busy_joins_the_running_batch(client, start_worker):
    await start_worker(slots=4, ctx=2048)
    long_jobs = [await client.enqueue(job_request(f"long job {i}", max_tokens=1900)) for i in range(3)]
    # wait until all three are generating
    for job in long_jobs:
        async with asyncio.timeout(60):
            async for entry in job.stream():
                if entry.kind == EntryKind.CHUNK:
                    break

    late = await client.enqueue(job_request("late job", max_tokens=8))
    async with asyncio.timeout(60):
        async for entry in late.stream():
            if entry.kind == EntryKind.CHUNK:
                break
    # the late job is generating while none of the long jobs has finished
    for job in long_jobs:
        assert await job.status() == JobStatus.RUNNING
        assert not any(e.final for e in await raw_entries(client, job.id))

    late_result = await late.result(timeout=60)
    assert late_result.status == JobStatus.SUCCEEDED
    assert late_result.usage.completion_tokens == 8
    for job in long_jobs:
        result = await job.result(timeout=120)
        assert result.status == JobStatus.SUCCEEDED
        assert result.usage.completion_tokens == 1900
    # the late job finished first even though it was enqueued last
    late_final = (await raw_entries(client, late.id))[-1].id
    for job in long_jobs:
        assert _id_key(late_final) < _id_key((await raw_entries(client, job.id))[-1].id)


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


async def test_stream_reader_resumes_without_gap_or_repeat(client, start_worker):
    await start_worker(ctx=2048)
    job = await client.enqueue(job_request("resume me", max_tokens=1000))

    first: list = []
    async with asyncio.timeout(60):
        async for entry in client.stream(job.id):
            first.append(entry)
            if len(first) == 3:
                break          # the reader "disconnects"
    assert len(first) == 3 and not first[-1].final

    rest = await collect_stream(client, job.id, last_id=first[-1].id)
    result = await job.result(timeout=60)
    full = await collect_stream(client, job.id, last_id="0-0")

    seen = [e.id for e in first + rest]
    assert len(seen) == len(set(seen)), "an entry was delivered twice"
    assert seen == [e.id for e in full], "an entry was missed"
    assert rest[-1].final
    assert "".join(e.text for e in chunks(first + rest)) == result.text
    assert sum(len(e.token_ids) for e in chunks(first + rest)) == result.usage.completion_tokens == 1000


async def test_resume_after_final_entry_ends_at_once(client, worker):
    job = await client.enqueue(job_request("finished", max_tokens=4))
    full = await collect_stream(client, job.id)
    assert full[-1].final
    await job.result(timeout=60)
    assert await collect_stream(client, job.id, last_id=full[-1].id, timeout=5) == []


async def test_idempotent_enqueue(client, start_worker):
    request = job_request("once only", max_tokens=12, idempotency_key="order-42:v1")
    first = await client.enqueue(request)
    second = await client.enqueue(request)
    assert first.id == second.id == "order-42:v1"
    assert first.created is True
    assert second.created is False
    assert await jobs_in_queue(client) == 1

    w = await start_worker()
    result = await first.result(timeout=60)
    assert result.status == JobStatus.SUCCEEDED and result.attempts == 1

    # after completion the key still maps to the same, finished job
    third = await client.enqueue(request)
    assert third.id == first.id and third.created is False
    assert (await third.result(timeout=10)).text == result.text

    # give the worker a moment to (wrongly) run anything else, then check it ran once
    marker = await client.enqueue(job_request("marker", max_tokens=2))
    await marker.result(timeout=60)
    assert w.runtime.jobs_complete == 2          # the idempotent job + the marker
    entries = await raw_entries(client, first.id)
    assert sum(e.final for e in entries) == 1
    assert {e.attempt for e in entries} == {1}
    assert sum(len(e.token_ids) for e in chunks(entries)) == 12


@pytest.mark.parametrize(("field", "fields"), [
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": "many"}),
    ("temperature", {"sampling": {"temperature": -1.0}}),
    ("top_p", {"sampling": {"top_p": 0}}),
    ("idempotency_key", {"idempotency_key": "has spaces!"}),
    ("idempotency_key", {"idempotency_key": "k" * 201}),
    ("priority", {"priority": 1000}),
    ("n", {"n": 0}),
    ("bogus_field", {"bogus_field": 1}),
])
async def test_bad_request_fails_at_enqueue_naming_the_field(client, redis_url, field, fields):
    with pytest.raises(ValidationError) as info:
        await client.enqueue("hello", **fields)
    assert field in str(info.value)

    if field != "bogus_field":   # see test_unknown_override_field_is_rejected
        # the same through the JobRequest + overrides path
        with pytest.raises(ValidationError) as info:
            await client.enqueue(JobRequest(prompt="hello"), **fields)
        assert field in str(info.value)

    assert await jobs_in_queue(client) == 0
    assert await client.redis.dbsize() == 0, await client.redis.keys("*")


async def test_unknown_override_field_is_rejected(client):
    try:
        with pytest.raises(ValidationError, match="max_token"):
            await client.enqueue(JobRequest(prompt="hello"), max_token=5)   # typo of max_tokens
    finally:
        assert await jobs_in_queue(client) == 0


async def test_request_needs_exactly_one_of_prompt_or_messages(client):
    with pytest.raises(ValidationError, match="prompt or messages"):
        await client.enqueue("a", prompt="b")      # a text is a user message: with a prompt, both are given
    with pytest.raises(TypeError, match="messages"):
        await client.enqueue("a", messages=[{"role": "user", "content": "b"}])
    with pytest.raises(ValidationError, match="prompt or messages"):
        await client.enqueue(JobRequest(prompt="a"), prompt=None)
    assert await client.redis.dbsize() == 0


async def test_backpressure_queue_full(redis_url):
    settings = settings_for(redis_url, max_queue_length=3)
    async with await SlotqClient.connect(redis_url, settings) as client:
        handles = [await client.enqueue(job_request(f"job {i}", idempotency_key=f"bp-{i}")) for i in range(3)]
        assert await jobs_in_queue(client) == 3

        with pytest.raises(QueueFull) as info:
            await client.enqueue(job_request("one too many", idempotency_key="bp-3"))
        assert info.value.limit == 3 and info.value.depth == 3
        assert await jobs_in_queue(client) == 3
        assert not await client.redis.exists(job_record_key(client.queue.keys.arq_id("bp-3")))
        assert not await streams.exists(client.redis, "bp-3")
        assert await client.status("bp-3") == JobStatus.NOT_FOUND

        # an idempotent re-enqueue of a job already queued is not new work: no QueueFull
        again = await client.enqueue(job_request("job 0", idempotency_key="bp-0"))
        assert again.id == handles[0].id and again.created is False
        assert await jobs_in_queue(client) == 3
