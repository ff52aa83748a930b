"""The shared stream reader on a real Valkey Cluster: one blocking XREAD per stream bucket (one
slot each), however many streams are followed, and a follower that outlives the failover of the
primary serving its stream, resuming after the last entry it gave, with nothing repeated."""

from __future__ import annotations

import asyncio
from typing import cast

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from slotq.jobs.producer.stream_reader import ClusterStreamReader, stream_reader
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


async def test_a_follower_carries_on_after_its_streams_primary_fails_over(replicated_cluster: LocalValkeyCluster,
                                                                          replicated_redis: Redis) -> None:
    job_id = "through-the-failover"
    reader = stream_reader(replicated_redis)
    assert isinstance(reader, ClusterStreamReader)
    appender = StreamAppender(replicated_redis, writer_id="w", maxlen=1000, ttl_s=60)
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
        node = cast(RedisCluster, replicated_redis).get_node_from_key(stream_key(job_id, clustered=True))
        await asyncio.to_thread(replicated_cluster.kill_primary, int(node.port))
        await asyncio.to_thread(replicated_cluster.wait_for_failover, 30)
        for n in range(3, 6):      # the writer's patient client reaches the promoted replica
            await appender.append(f"w:{n}", [JobEntries(job_id, "", TTL.LIVE, [chunk(str(n))])])
        await appender.append("w:end", [JobEntries(job_id, "", TTL.FINAL, [final()])])
        async with asyncio.timeout(60):
            await following
        assert seen == [str(n) for n in range(6)]
    finally:
        following.cancel()
        await reader.close()
