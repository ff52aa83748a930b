"""The queue's protocol on a real 3-primary Valkey Cluster (docs/cluster.md): every script runs in
one slot, the queue's keys share one shard while the job streams spread over all three, and the
stream fence holds across slots. A cluster refuses a script whose keys span slots (CROSSSLOT), so
each call here passing is the check that its keys were laid out right."""

from __future__ import annotations

from typing import cast

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from slotq.jobs.protocol.arq_formats import ABORT_JOBS_SET, result_record
from slotq.jobs.protocol.keys import job_fences_key, stream_key
from slotq.jobs.protocol.redis_queue import Enqueued, RedisQueue
from slotq.jobs.protocol.serialization import deserialize, serialize
from slotq.jobs.protocol.streams import TTL, JobEntries, StreamAppender, encode_chunk, read_all
from tests.support.jobs import fences_raised

LANES = ("interactive", "bulk")


@pytest.fixture
def redis_backend() -> str:
    """Every test here runs on the session's 3-primary cluster (the ``redis`` fixture: slotq's cluster client)."""
    return "cluster"


def chunk(text: str) -> dict[str, str]:
    return encode_chunk(attempt=1, choice=0, text=text, token_ids=[1], n_tokens=1)


async def test_a_job_goes_the_whole_way_with_its_stream_on_its_own_shard(redis: Redis) -> None:
    queue = RedisQueue(redis, "slotq:queue", LANES)
    assert queue.keys.clustered and queue.keys.jobs == "{slotq:queue}:jobs"
    ids = [f"job-{n}" for n in range(12)]
    for job_id in ids:
        assert await queue.enqueue(job_id, "generate", {"n": job_id}, lane="interactive", max_waiting=None,
                                   serializer=serialize) == Enqueued.CREATED
    assert await queue.enqueue(ids[0], "generate", {}, lane="interactive", max_waiting=None,
                               serializer=serialize) == Enqueued.EXISTS
    claimed = await queue.claim(len(ids), "w1", 30_000)
    assert sorted(job.id for job in claimed) == sorted(ids)
    assert await fences_raised(redis, {job.id: job.lease for job in claimed}) == dict.fromkeys(ids, True)

    appender = StreamAppender(redis, writer_id="w", maxlen=1000, ttl_s=60)
    flush = [JobEntries(job.id, job.lease, TTL.LIVE, [chunk(job.id)]) for job in claimed]
    assert await appender.append("w1:0", flush) == [True] * len(ids)
    assert await appender.append("w1:0", flush) == [True] * len(ids)     # re-sent: not written twice
    shards = {cast(RedisCluster, redis).get_node_from_key(stream_key(job_id, clustered=True)).name for job_id in ids}
    assert len(shards) == 3, "the streams of 12 jobs spread over every shard"
    for job_id in ids:
        stream, fence = stream_key(job_id, clustered=True), job_fences_key(job_id, clustered=True)
        assert key_slot(stream.encode()) == key_slot(fence.encode())
        assert [e.text for e in await read_all(redis, job_id)] == [job_id]

    for job in claimed:
        record = result_record(job.id, "generate", {"text": job.id}, queue.keys.queue, queue.wall_ms(), serialize)
        assert await queue.finish(job, record, 60_000)
    found = await queue.result_records(ids, deserialize)        # one MGET: the results share the queue's slot
    assert {job_id: found[job_id].output for job_id in ids} == {job_id: {"text": job_id} for job_id in ids}
    assert sum(c.running + c.waiting for c in await queue.counts()) == 0
    assert await queue.forget(ids) == len(ids)
    assert not await redis.exists(stream_key(ids[0], clustered=True))


async def test_a_newer_claim_fences_off_the_older_attempt_across_slots(redis: Redis) -> None:
    queue = RedisQueue(redis, "slotq:queue", LANES)
    await queue.enqueue("j", "generate", {}, lane="interactive", max_waiting=None, serializer=serialize)
    [old] = await queue.claim(1, "w1", 30_000)
    assert await fences_raised(redis, {"j": old.lease}) == {"j": True}
    assert await queue.hand_back(old)
    [new] = await queue.claim(1, "w2", 30_000)
    assert int(new.lease.split("#")[1]) > int(old.lease.split("#")[1])
    assert await fences_raised(redis, {"j": new.lease}) == {"j": True}
    assert await fences_raised(redis, {"j": old.lease}) == {"j": False}     # late: it lost the job
    appender = StreamAppender(redis, writer_id="w", maxlen=1000, ttl_s=60)
    assert await appender.append("w1:1", [JobEntries("j", old.lease, TTL.KEEP, [chunk("old")])]) == [False]
    assert await appender.append("w2:0", [JobEntries("j", new.lease, TTL.LIVE, [chunk("new")])]) == [True]
    assert [e.text for e in await read_all(redis, "j")] == ["new"]
    assert not await queue.finish(old, None, 60_000)
    assert await queue.finish(new, None, 60_000)


async def test_cancel_notes_the_abort_in_its_own_slot_and_reaches_the_worker_channel(redis: Redis) -> None:
    queue = RedisQueue(redis, "slotq:queue", LANES)
    for job_id in ("waiting", "running"):
        await queue.enqueue(job_id, "generate", {}, lane="bulk", max_waiting=None, serializer=serialize)
    [running] = await queue.claim(1, "w1", 30_000)
    other = "waiting" if running.id == "running" else "running"
    assert await queue.cancel(other) == 1                      # removed before it started: no abort note left
    assert await redis.zscore(ABORT_JOBS_SET, queue.keys.arq_id(other)) is None
    assert await queue.cancel(running.id) == -1                # running: noted for arq, under its arq id
    assert await redis.zscore(ABORT_JOBS_SET, queue.keys.arq_id(running.id)) is not None
    assert await queue.finish(running, None, 60_000)
    assert await redis.zscore(ABORT_JOBS_SET, queue.keys.arq_id(running.id)) is None
    assert await queue.cancel("never") == 0


async def test_a_queue_name_with_its_own_hash_tag_is_kept(redis: Redis) -> None:
    queue = RedisQueue(redis, "{models}:small", LANES)
    assert queue.keys.jobs == "{models}:small:jobs" and queue.keys.arq_id("a") == "{models}:small:a"
    assert await queue.enqueue("a", "generate", {}, lane="bulk", max_waiting=None,
                               serializer=serialize) == Enqueued.CREATED
    assert [job.id for job in await queue.claim(1, "w", 30_000)] == ["a"]


async def test_scripts_sent_together_are_loaded_where_a_node_lacks_them(redis: Redis) -> None:
    """A flush over many buckets goes as one cluster pipeline of EVALSHAs; a node that never ran
    the script (here: every node, after SCRIPT FLUSH; in life, a replica just promoted) answers
    NOSCRIPT, and those calls alone run again, loading it."""
    appender = StreamAppender(redis, writer_id="w", maxlen=1000, ttl_s=60)
    ids = [f"flushed-{n}" for n in range(12)]
    assert await appender.append("w:0", [JobEntries(job_id, "", TTL.LIVE, [chunk("a")]) for job_id in ids]) == \
        [True] * len(ids)
    await cast(RedisCluster, redis).execute_command("SCRIPT FLUSH", target_nodes=RedisCluster.PRIMARIES)
    assert await appender.append("w:1", [JobEntries(job_id, "", TTL.LIVE, [chunk("b")]) for job_id in ids]) == \
        [True] * len(ids)
    for job_id in ids:
        assert [e.text for e in await read_all(redis, job_id)] == ["a", "b"]      # each written once
