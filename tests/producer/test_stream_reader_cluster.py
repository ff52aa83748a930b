"""The shared stream reader on a real Valkey Cluster: one blocking XREAD per stream bucket (one
slot each), however many streams are followed, and a follower that outlives the failover of the
primary serving its stream (killed, or frozen), resuming after the last entry it gave, with nothing
repeated."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import cast

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from slotq.jobs.producer.stream_reader import ClusterStreamReader, stream_reader
from slotq.jobs.protocol.connection import connect
from slotq.jobs.protocol.keys import STREAM_BUCKETS, stream_bucket, stream_key
from slotq.jobs.protocol.schemas import EntryKind, StreamEntry
from slotq.jobs.protocol.streams import TTL, JobEntries, StreamAppender, encode_chunk, encode_entry
from slotq.jobs.redis_cluster import LocalValkeyCluster


def chunk(text: str) -> dict[str, str]:
    return encode_chunk(attempt=1, choice=0, text=text, token_ids=[1], n_tokens=1)


def final() -> dict[str, str]:
    return encode_entry(StreamEntry(id="", kind=EntryKind.DONE, attempt=1, final=True))


async def collect(reader: ClusterStreamReader, job_id: str) -> list[str]:
    return [entry.text for entry in [e async for e in reader.follow(job_id)] if entry.kind == EntryKind.CHUNK]


@pytest.mark.slow
async def test_forty_followers_share_one_read_per_bucket(replicated_redis: Redis) -> None:
    reader = stream_reader(replicated_redis)
    assert isinstance(reader, ClusterStreamReader)
    ids = [f"follow-{n}" for n in range(40)]
    followers = [asyncio.create_task(collect(reader, job_id)) for job_id in ids]
    appender = StreamAppender(replicated_redis, writer_id="w", maxlen=1000, ttl_s=60)
    try:
        for n in range(3):
            assert await appender.append(f"w:{n}", [JobEntries(job_id, "", TTL.LIVE, [chunk(f"{job_id}/{n}")])
                                                    for job_id in ids]) == [True] * len(ids)
        await appender.append("w:end", [JobEntries(job_id, "", TTL.FINAL, [final()]) for job_id in ids])
        async with asyncio.timeout(30):
            got = await asyncio.gather(*followers)
        assert got == [[f"{job_id}/{n}" for n in range(3)] for job_id in ids]
        buckets = {stream_bucket(job_id) for job_id in ids}
        assert len(reader._readers) == len(buckets) <= STREAM_BUCKETS    # one reader (one XREAD) per bucket
    finally:
        await reader.close()


async def follow_through(redis: Redis, job_id: str, upset: Callable[[int], Awaitable[None]], *,
                         within_s: float) -> None:
    """A follower of ``job_id``'s stream gets every entry while ``upset(port)`` strikes the primary
    serving it (at that port) between the third and the fourth: the writes after it and the
    follower's end, within ``within_s`` (a hang guard), give all six entries once each."""
    reader = stream_reader(redis)
    assert isinstance(reader, ClusterStreamReader)
    appender = StreamAppender(redis, writer_id="w", maxlen=1000, ttl_s=60)
    seen: list[str] = []

    async def follow() -> None:
        async for entry in reader.follow(job_id):
            if entry.kind == EntryKind.CHUNK:
                seen.append(entry.text)

    following = asyncio.create_task(follow())
    try:
        for n in range(3):
            await appender.append(f"w:{n}", [JobEntries(job_id, "", TTL.LIVE, [chunk(str(n))])])
        async with asyncio.timeout(10):
            while len(seen) < 3:
                await asyncio.sleep(0.02)
        await upset(int(cast(RedisCluster, redis).get_node_from_key(stream_key(job_id, clustered=True)).port))
        async with asyncio.timeout(within_s):
            for n in range(3, 6):      # the writer's patient client reaches the promoted replica
                await appender.append(f"w:{n}", [JobEntries(job_id, "", TTL.LIVE, [chunk(str(n))])])
            await appender.append("w:end", [JobEntries(job_id, "", TTL.FINAL, [final()])])
            await following
        assert seen == [str(n) for n in range(6)]
    finally:
        following.cancel()
        await reader.close()


@pytest.mark.slow
async def test_a_follower_carries_on_after_its_streams_primary_fails_over(replicated_cluster: LocalValkeyCluster,
                                                                          replicated_redis: Redis) -> None:
    async def kill(port: int) -> None:
        await asyncio.to_thread(replicated_cluster.kill_primary, port)
        await asyncio.to_thread(replicated_cluster.wait_for_failover, 30)

    await follow_through(replicated_redis, "through-the-failover", kill, within_s=60)


@pytest.mark.fault          # about 20 s: a cluster of its own, and a read bound (10 s) waited out twice
async def test_a_follower_carries_on_after_its_streams_primary_freezes(tmp_path: Path) -> None:
    """A primary frozen (SIGSTOP: its connections stay open, no reply comes) under a follower's blocking
    XREAD: the read times out past its block time plus the read bound, the reader looks the bucket's
    node up again and follows the stream on the promoted replica, which the writer's patient client
    reached the same way. Without the bound both waited for ever."""
    with LocalValkeyCluster(tmp_path / "frozen", primaries=3, replicas_per_primary=1) as cluster:
        redis = await connect(cluster.url, patient=True)
        frozen: list[int] = []

        async def freeze(port: int) -> None:
            frozen.append(next(node.pid for node in cluster.nodes() if node.port == port))
            os.kill(frozen[0], signal.SIGSTOP)

        try:                            # within_s: a hang guard, as without the bound the writes wait for ever
            await follow_through(redis, "through-the-freeze", freeze, within_s=120)
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
            await redis.aclose()
