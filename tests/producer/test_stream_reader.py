"""The client's shared stream reader (jobs/producer/stream_reader.py): one XREAD for many followers, real
Valkey, entries written by the worker's StreamWriter. No worker or model: only the stream protocol.

The reader's block time is set far beyond the tests' timeouts where it matters, so a follower that
only got its entries when a blocked read timed out would fail the test instead of passing slowly."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from slotq.jobs.errors import StreamGone
from slotq.jobs.producer.stream_reader import StreamReader, format_id, parse_id
from slotq.jobs.protocol.schemas import EntryKind, StreamEntry
from slotq.jobs.worker.stream_writer import StreamWriter

NEVER_MS = 600_000       # a blocked read that times out on its own would outlast every test


def chunk(text: str, n: int, final: bool = False) -> StreamEntry:
    return StreamEntry(id="", kind=EntryKind.CHUNK, attempt=1, text=text, token_ids=[n], n_tokens=n, final=final)


def done() -> StreamEntry:
    return StreamEntry(id="", kind=EntryKind.DONE, attempt=1, final=True)


@pytest.fixture
async def redis(redis_url: str):
    r = Redis.from_url(redis_url)
    yield r
    await r.aclose()


@pytest.fixture
async def writer(redis: Redis):
    w = StreamWriter(redis, flush_ms=1, maxlen=1000, ttl_s=60)
    yield w
    await w.close()


async def write(writer: StreamWriter, job_id: str, *entries: StreamEntry) -> None:
    for entry in entries:
        writer.add(job_id, entry)
        await writer.write_all(job_id)      # one entry per flush: the reader sees them arrive one by one


async def texts(reader: StreamReader, job_id: str, last_id: str = "0-0") -> list[str]:
    return [e.text async for e in reader.follow(job_id, last_id=last_id, idle_ms=NEVER_MS) if e.kind == EntryKind.CHUNK]


def test_stream_ids_order_as_redis_orders_them() -> None:
    assert parse_id(b"1700000000000-3") == (1700000000000, 3)
    assert parse_id("5") == (5, 0)
    assert parse_id("10-0") > parse_id("9-99")
    assert format_id(parse_id("12-7")) == "12-7"


async def test_many_followers_share_one_read_and_each_gets_its_own_entries(redis, writer) -> None:
    reader = StreamReader(redis, block_ms=NEVER_MS)
    try:
        jobs = [f"job-{i}" for i in range(6)]
        followers = [asyncio.create_task(texts(reader, job)) for job in jobs]
        for step in range(5):                            # interleaved, as a worker's flushes are
            for job in jobs:
                writer.add(job, chunk(f"{job}:{step}", step + 1))
            await writer.flush()
        for job in jobs:
            writer.add(job, done())
        await writer.flush()
        async with asyncio.timeout(30):
            got = await asyncio.gather(*followers)
        assert got == [[f"{job}:{s}" for s in range(5)] for job in jobs]
    finally:
        await reader.close()


async def test_a_follower_joining_a_blocked_read_is_not_kept_waiting(redis, writer) -> None:
    reader = StreamReader(redis, block_ms=NEVER_MS)
    try:
        quiet = asyncio.create_task(texts(reader, "quiet"))       # the read now blocks on this stream only
        while reader.reads == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        late = asyncio.create_task(texts(reader, "late"))
        await write(writer, "late", chunk("a", 1), chunk("b", 2), done())
        async with asyncio.timeout(30):
            assert await late == ["a", "b"]
        quiet.cancel()
    finally:
        await reader.close()


async def test_two_followers_of_one_stream_resume_from_their_own_ids(redis, writer) -> None:
    reader = StreamReader(redis, block_ms=NEVER_MS)
    try:
        await write(writer, "j", chunk("a", 1), chunk("b", 2))
        ids = [entry_id.decode() for entry_id, _ in await redis.xrange("slotq:stream:{j}")]
        from_start = asyncio.create_task(texts(reader, "j"))
        after_first = asyncio.create_task(texts(reader, "j", last_id=ids[0]))
        await write(writer, "j", chunk("c", 3), done())
        async with asyncio.timeout(30):
            assert await from_start == ["a", "b", "c"]
            assert await after_first == ["b", "c"]
    finally:
        await reader.close()


async def test_a_follower_of_a_job_that_ended_without_a_stream_raises(redis) -> None:
    """Once ``is_live`` says the job is over, a follower with nothing to read says so (StreamGone,
    naming the job) instead of ending as if the stream had been complete."""
    reader = StreamReader(redis, block_ms=50)
    checks = 0

    async def is_live() -> bool:
        nonlocal checks
        checks += 1
        return checks < 2

    try:
        async with asyncio.timeout(30):
            with pytest.raises(StreamGone, match="'nobody'.*does not exist"):
                _ = [e async for e in reader.follow("nobody", idle_ms=50, is_live=is_live)]
        assert checks == 2
    finally:
        await reader.close()


async def test_after_its_connection_is_killed_the_reader_still_unblocks_for_newcomers(client, redis, writer) -> None:
    """A reconnect (the client's retry policy re-sends the read) changes the blocked connection's
    id: the reader learns the new one."""
    reader = StreamReader(client.redis, block_ms=NEVER_MS)
    try:
        first = asyncio.create_task(texts(reader, "first"))
        async with asyncio.timeout(30):
            while reader.reads == 0:
                await asyncio.sleep(0.01)
        old_id = reader._client_id
        assert old_id is not None
        await redis.execute_command("CLIENT", "KILL", "ID", old_id)
        await write(writer, "first", chunk("x", 1))      # the retried read (new connection) returns this
        async with asyncio.timeout(30):
            while reader._client_id == old_id:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        second = asyncio.create_task(texts(reader, "second"))
        await write(writer, "second", chunk("y", 1), done())
        async with asyncio.timeout(30):
            assert await second == ["y"]
        await write(writer, "first", done())
        async with asyncio.timeout(30):
            assert await first == ["x"]
    finally:
        await reader.close()
