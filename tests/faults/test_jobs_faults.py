"""Failure paths of the Redis job layer: engine errors, cancellation, poison payloads.
Real Valkey, real engine (tiny model)."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest

from slotq.jobs.protocol import dead_letters
from slotq.jobs.protocol.keys import job_record_key
from slotq.jobs.protocol.schemas import EntryKind, JobRequest, JobStatus
from slotq.jobs.protocol.wire import ErrorInfo, FinishReason
from tests.support.jobs import (
    ON_EVERY_BACKEND,
    chunks,
    collect_stream,
    inject_raw_job,
    job_request,
    jobs_in_queue,
    raw_entries,
)


async def _first_chunk(job) -> None:
    async with asyncio.timeout(60):
        async for entry in job.stream():
            if entry.kind == EntryKind.CHUNK:
                return
            assert not entry.final, entry
    raise AssertionError("stream ended without a chunk")


async def _assert_serves(client, max_tokens: int = 6) -> None:
    job = await client.enqueue(job_request("still alive?", max_tokens=max_tokens))
    result = await job.result(timeout=60)
    assert result.status == JobStatus.SUCCEEDED, result
    assert result.usage.completion_tokens == max_tokens
    assert result.attempts == 1


# ---------------------------------------------------------------------- engine errors
async def test_engine_error_fails_once_and_worker_keeps_serving(client, worker):
    job = await client.enqueue(job_request("x" * 3000, max_tokens=20))   # ctx is 512
    entries = await collect_stream(client, job.id)
    result = await job.result(timeout=60)

    final = entries[-1]
    assert final.kind == EntryKind.ERROR and final.final
    assert final.error is not None
    assert final.error.code == "prompt_too_long"
    assert final.error.retryable is False
    assert not chunks(entries)

    assert result.status == JobStatus.FAILED
    assert result.error is not None and result.error.code == "prompt_too_long"
    assert result.finish_reason == FinishReason.ERROR
    assert result.attempts == 1
    assert await job.status() == JobStatus.FAILED
    # not retried, not dead-lettered
    assert await dead_letters.count(client.redis) == 0
    assert (await client.queue_info()).deferred == 0

    await _assert_serves(client)
    assert [e.id for e in await raw_entries(client, job.id)] == [e.id for e in entries]   # nothing appended


# ---------------------------------------------------------------------- cancel
@pytest.mark.parametrize("redis_backend", ON_EVERY_BACKEND)
async def test_cancel_running_job(client, start_worker):
    await start_worker(ctx=4096)
    job = await client.enqueue(job_request("cancel me", max_tokens=2000))
    await _first_chunk(job)
    assert await job.status() == JobStatus.RUNNING
    assert await job.cancel() is True

    entries = await collect_stream(client, job.id)
    final = entries[-1]
    assert final.final and final.kind == EntryKind.DONE
    assert final.finish_reason == FinishReason.CANCELLED
    assert sum(e.final for e in entries) == 1

    result = await job.result(timeout=60)
    assert result.status == JobStatus.CANCELLED
    assert result.finish_reason == FinishReason.CANCELLED
    assert await job.status() == JobStatus.CANCELLED
    streamed = "".join(e.text for e in chunks(await raw_entries(client, job.id)))
    assert result.text == streamed
    assert sum(len(e.token_ids) for e in chunks(entries)) < 2000
    # a finished job cannot be cancelled again
    assert await job.cancel() is False
    await _assert_serves(client)


@pytest.mark.parametrize("redis_backend", ON_EVERY_BACKEND)
async def test_cancel_queued_job_without_worker_never_starts(client, start_worker):
    job = await client.enqueue(job_request("never runs", max_tokens=8))
    assert await job.status() == JobStatus.QUEUED
    assert await job.cancel() is True
    assert await job.status() == JobStatus.CANCELLED
    assert await jobs_in_queue(client) == 0
    assert not await client.redis.exists(job_record_key(client.queue.keys.arq_id(job.id)))

    w = await start_worker()
    await _assert_serves(client)

    result = await job.result(timeout=10)
    assert result.status == JobStatus.CANCELLED
    assert result.finish_reason == FinishReason.CANCELLED
    assert result.text == "" and result.usage.completion_tokens == 0
    entries = await collect_stream(client, job.id, timeout=10)
    assert not chunks(entries)
    assert [(e.kind, e.finish_reason, e.final) for e in entries] == [(EntryKind.DONE, FinishReason.CANCELLED, True)]
    assert w.runtime.jobs_complete == 1      # only the liveness job ran


async def test_cancel_queued_job_while_slots_busy_never_starts(client, start_worker):
    w = await start_worker(slots=1, ctx=4096)
    busy = await client.enqueue(job_request("occupy the only slot", max_tokens=2000))
    await _first_chunk(busy)

    waiting = await client.enqueue(job_request("waits for a slot", max_tokens=8))
    assert await waiting.status() == JobStatus.QUEUED
    assert await waiting.cancel() is True
    # the only slot was busy the whole time, so the waiting job cannot have been claimed
    assert await busy.status() == JobStatus.RUNNING
    assert await waiting.status() == JobStatus.CANCELLED

    assert await busy.cancel() is True
    assert (await busy.result(timeout=60)).status == JobStatus.CANCELLED
    await _assert_serves(client)

    result = await waiting.result(timeout=10)
    assert result.status == JobStatus.CANCELLED and result.text == ""
    assert not chunks(await raw_entries(client, waiting.id))
    assert w.runtime.jobs_complete + w.runtime.jobs_failed == 2     # busy + the liveness job; never `waiting`


# ---------------------------------------------------------------------- poison payloads
async def _inject(client, job_id: str, raw: bytes) -> None:
    await inject_raw_job(client, job_id, raw)


@pytest.mark.parametrize(("raw", "code"), [
    (b"\x00garbage", "poison_payload"),
    (msgpack.packb({"t": 1, "f": "generate", "a": [{"prompt": 5}], "k": {}, "et": 0}), "invalid_payload"),
    (msgpack.packb(["not", "a", "job"]), "poison_payload"),
], ids=["not-msgpack", "invalid-request", "not-a-job-record"])
async def test_bad_payload_is_dead_lettered(client, worker, raw, code):
    job_id = f"bad-{code}"
    await _inject(client, job_id, raw)

    entries = await collect_stream(client, job_id)
    final = entries[-1]
    assert final.kind == EntryKind.ERROR and final.final
    assert final.error is not None and final.error.code == code
    assert final.error.retryable is False
    assert not chunks(entries)

    letter = await dead_letters.get(client.redis, job_id)
    assert letter is not None
    assert letter.error.code == code
    assert letter.attempts == 1
    assert job_id in await dead_letters.list_ids(client.redis)

    result = await client.result(job_id, timeout=30)
    assert result.status == JobStatus.FAILED
    assert result.error is not None and result.error.code == code
    assert result.attempts == 1

    # the worker is unharmed and serves the next job
    await _assert_serves(client)
    assert await dead_letters.count(client.redis) == 1


# ---------------------------------------------------------------------- payload versions
def _record(payload: dict) -> bytes:
    return msgpack.packb({"t": 1, "f": "generate", "a": [payload], "k": {}, "et": int(time.time() * 1000)})


async def test_newer_minor_payload_runs_with_unknown_fields_ignored(client, worker, caplog):
    """A producer upgraded before its workers sends fields this worker does not know."""
    payload = {"schema_version": "1.7", "prompt": "hello", "max_tokens": 4, "ignore_eos": True,
               "shiny_new_option": True, "sampling": {"temperature": 0, "new_sampler_knob": 0.5},
               "messages_style": {"x": 1}}
    await _inject(client, "newer-minor", _record(payload))
    result = await client.result("newer-minor", timeout=30)
    assert result.status == JobStatus.SUCCEEDED, result
    assert result.usage.completion_tokens == 4
    assert await dead_letters.count(client.redis) == 0
    warnings = [r.getMessage() for r in caplog.records if "newer than this worker" in r.getMessage()]
    assert len(warnings) == 1
    assert "shiny_new_option" in warnings[0] and "sampling.new_sampler_knob" in warnings[0]

    await _inject(client, "newer-minor-2", _record(payload))       # the same fields again: logged once
    assert (await client.result("newer-minor-2", timeout=30)).status == JobStatus.SUCCEEDED
    assert len([r for r in caplog.records if "newer than this worker" in r.getMessage()]) == 1


async def test_newer_major_payload_is_dead_lettered_with_its_reason(client, worker):
    await _inject(client, "newer-major", _record({"schema_version": "2.0", "prompt": "hello", "max_tokens": 4}))
    result = await client.result("newer-major", timeout=30)
    assert result.status == JobStatus.FAILED
    assert result.error is not None and result.error.code == "unsupported_payload_version"
    assert "2.0" in result.error.message and "upgrade the workers" in result.error.message
    letter = await dead_letters.get(client.redis, "newer-major")
    assert letter is not None and letter.error.code == "unsupported_payload_version"
    await _assert_serves(client)                                    # the worker carries on


@pytest.mark.parametrize("payload", [
    {"prompt": "hello", "max_tokens": 4},                             # a producer older than versioning
    {"schema_version": "1.0", "prompt": "hello", "max_tokens": 4},
], ids=["unversioned", "same-version"])
async def test_older_and_current_payloads_run_and_stay_strict(client, worker, payload):
    await _inject(client, "old-producer", _record(payload))
    assert (await client.result("old-producer", timeout=30)).status == JobStatus.SUCCEEDED
    await _inject(client, "old-typo", _record({**payload, "max_token": 5}))   # at our version an unknown field is a bug
    result = await client.result("old-typo", timeout=30)
    assert result.error is not None and result.error.code == "invalid_payload"
    assert "max_token" in result.error.message


async def test_enqueued_payloads_carry_the_schema_version(client):
    from slotq.jobs.protocol.payload import SCHEMA_VERSION
    from slotq.jobs.protocol.serialization import deserialize

    job = await client.enqueue(job_request("hello"))
    stored = deserialize(await client.redis.get(job_record_key(job.id)))["a"][0]
    assert stored["schema_version"] == "{}.{}".format(*SCHEMA_VERSION)


async def test_a_dead_letter_is_requeued_on_the_queue_it_ran_on(client):
    await dead_letters.record(client.redis, "dl-other", {"prompt": "hello", "max_tokens": 4},
                              ErrorInfo(code="tries_exhausted", message="test", retryable=True), 5, time.time(),
                              queue="slotq:other-model")
    assert await client.requeue_dead_letter("dl-other")
    other = client.for_queue("slotq:other-model")
    assert await other.status("dl-other") == JobStatus.QUEUED
    assert await client.queue.place("dl-other") == (None, False)       # not on the caller's queue
    assert await dead_letters.get(client.redis, "dl-other") is None


async def test_an_engine_error_names_its_field(client, worker):
    job = await client.enqueue(JobRequest(prompt="word " * 600, max_tokens=8))   # > the 512-token context
    result = await job.result(timeout=30)
    assert result.error is not None and result.error.code == "prompt_too_long"
    assert result.error.field == "prompt"
