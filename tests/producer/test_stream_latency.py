"""A follower never ends early: streams read through a client that sits behind network latency.

The chaos run found streams that ended after part of the text, with every entry already in Redis:
a follower's idle check saw the job finished and returned while the shared XREAD had not yet
delivered the tail. The same race reproduces without any fault, as here: the producer's client
reaches Redis through a proxy that delays every packet (10 ms and 100 ms one way), a few dozen
short jobs wait behind a worker that has not started, their followers go idle, and then the
worker runs them all quickly. Every follower must end with its job's final entry.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from slotq.jobs.errors import StreamGone
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.keys import stream_key
from slotq.jobs.protocol.schemas import EntryKind, JobStatus, StreamEntry
from slotq.jobs.worker.stream_writer import StreamWriter
from tests.support.faults import LatencyProxy
from tests.support.jobs import collect_stream, job_request, settings_for


async def follow_all(client: SlotqClient, job_ids: list[str]) -> list[list[StreamEntry]]:
    """Each job's entries exactly as the README follows them: ``async for e in handle.stream()``."""

    async def follow(job_id: str) -> list[StreamEntry]:
        return [e async for e in client.job(job_id).stream()]

    async with asyncio.timeout(180):
        return await asyncio.gather(*(follow(j) for j in job_ids))


@pytest.mark.slow
@pytest.mark.parametrize(("one_way_ms", "jobs"), [(10, 60), (100, 40)])
async def test_followers_behind_latency_always_reach_the_final_entry(
        redis_url: str, start_worker, one_way_ms: int, jobs: int) -> None:
    proxy = LatencyProxy(int(redis_url.rsplit(":", 1)[1].split("/")[0]), one_way_s=one_way_ms / 1000)
    await proxy.start()
    client = await SlotqClient.connect(proxy.url, settings_for(proxy.url))
    try:
        handles = [await client.enqueue(job_request(f"job {i}", max_tokens=8)) for i in range(jobs)]
        followers = asyncio.create_task(follow_all(client, [h.id for h in handles]))
        await asyncio.sleep(2.5)                # every follower idles and runs its idle check
        await start_worker(slots=8)
        streams = await followers
        ended_early = [h.id for h, entries in zip(handles, streams) if not entries or not entries[-1].final]
        assert not ended_early, f"{len(ended_early)} of {jobs} streams ended without their final entry"
        for entries in streams:
            assert sum(len(e.token_ids) for e in entries if e.kind == EntryKind.CHUNK) == 8
            assert len({e.id for e in entries}) == len(entries)       # no entry given twice
    finally:
        await client.close()
        await proxy.close()


async def test_a_stream_that_expired_raises_naming_the_job_and_the_last_id(client: SlotqClient, worker) -> None:
    job = await client.enqueue(job_request(max_tokens=4))
    entries = await collect_stream(client, job.id)
    assert (await job.result(timeout=30)).status is JobStatus.SUCCEEDED
    await client.redis.delete(stream_key(job.id))       # as its TTL would
    with pytest.raises(StreamGone) as caught:
        await collect_stream(client, job.id, last_id=entries[1].id)
    assert job.id in str(caught.value) and entries[1].id in str(caught.value)


async def test_a_trimmed_stream_raises_rather_than_skip_entries(client: SlotqClient) -> None:
    writer = StreamWriter(client.redis, flush_ms=1, maxlen=1000, ttl_s=60)
    try:
        for entry in [*(StreamEntry(id="", kind=EntryKind.CHUNK, attempt=1, text=f"t{n}", token_ids=[n], n_tokens=n)
                        for n in range(1, 5)), StreamEntry(id="", kind=EntryKind.DONE, attempt=1, final=True)]:
            writer.add("trimmed", entry)
            await writer.write_all("trimmed")          # one entry per write
    finally:
        await writer.close()
    entries = await collect_stream(client, "trimmed")
    assert len(entries) == 5
    await client.redis.xtrim(stream_key("trimmed"), maxlen=2, approximate=False)   # as MAXLEN would
    with pytest.raises(StreamGone) as caught:
        await collect_stream(client, "trimmed", last_id=entries[0].id)
    assert "trimmed" in str(caught.value) and entries[0].id in str(caught.value)
    tail = await collect_stream(client, "trimmed", last_id=entries[3].id)   # still in the stream: nothing lost
    assert [e.id for e in tail] == [entries[4].id]


async def test_a_reader_resuming_after_the_end_gets_nothing_and_returns(client: SlotqClient, worker) -> None:
    job = await client.enqueue(job_request(max_tokens=4))
    entries = await collect_stream(client, job.id)
    started = time.monotonic()
    assert await collect_stream(client, job.id, last_id=entries[-1].id) == []
    assert time.monotonic() - started < 30
