"""A worker's flush on a real 3-primary Valkey Cluster goes as one script per node (NODE_STREAM_FLUSH,
docs/cluster.md "Flushes by node"), and stays exactly-once and fenced when a bucket's slot moves
under it: the node's call is refused before it writes anything, and its buckets go one by one.

The cluster is this module's own: its tests move slots between primaries."""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import cast

import pytest
import redis as sync_redis
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from slotq.jobs.protocol.connection import connect
from slotq.jobs.protocol.keys import STREAM_BUCKETS, STREAM_TAGS, fences_key, stream_bucket
from slotq.jobs.protocol.scripts.layout import ScriptRunner, lua_source
from slotq.jobs.protocol.scripts.stream_flush import NodeStreamFlush
from slotq.jobs.protocol.streams import TTL, JobEntries, StreamAppender, encode_chunk, read_all
from slotq.jobs.redis_cluster import LocalValkeyCluster
from tests.support.jobs import fences_raised


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalValkeyCluster]:
    with LocalValkeyCluster(tmp_path_factory.mktemp("node-flush"), primaries=3) as local:
        yield local


@pytest.fixture
async def redis(cluster: LocalValkeyCluster) -> AsyncIterator[Redis]:
    client = await connect(cluster.url, patient=False)
    await cast(RedisCluster, client).flushall(target_nodes=RedisCluster.PRIMARIES)
    try:
        yield client
    finally:
        await client.aclose()


def one_job_per_bucket() -> list[str]:
    """A job id in every stream bucket, bucket 0 first."""
    found: dict[int, str] = {}
    for n in range(10_000):
        found.setdefault(stream_bucket(f"job-{n}"), f"job-{n}")
        if len(found) == STREAM_BUCKETS:
            return [found[bucket] for bucket in range(STREAM_BUCKETS)]
    raise AssertionError("no job id for some bucket")


def chunk(text: str) -> dict[str, str]:
    return encode_chunk(attempt=1, choice=0, text=text, token_ids=[1], n_tokens=1)


def primaries(cluster: LocalValkeyCluster) -> list[sync_redis.Redis]:
    return [sync_redis.Redis(port=node.port) for node in cluster.nodes() if node.role == "primary"]


def script_calls(cluster: LocalValkeyCluster) -> dict[int, int]:
    """EVALSHA calls per primary (by port) since the last CONFIG RESETSTAT."""
    calls = {}
    for node in primaries(cluster):
        with contextlib.closing(node):
            stats = node.info("commandstats")
            calls[node.connection_pool.connection_kwargs["port"]] = stats.get("cmdstat_evalsha", {}).get("calls", 0)
    return calls


def reset_stats(cluster: LocalValkeyCluster) -> None:
    for node in primaries(cluster):
        with contextlib.closing(node):
            node.config_resetstat()


def move_slot(cluster: LocalValkeyCluster, slot: int, to_port: int, *, finish: bool = True) -> int:
    """Move ``slot`` (its keys too) to the primary on ``to_port``, as a resharding tool does: IMPORTING on
    the target, MIGRATING on the source, MIGRATE of every key, then the new owner on every primary. With
    ``finish`` False it stops after MIGRATING (keys not moved): the slot is migrating. The source's port."""
    nodes = {node.connection_pool.connection_kwargs["port"]: node for node in primaries(cluster)}
    try:
        ids = {port: node.execute_command("CLUSTER", "MYID").decode() for port, node in nodes.items()}
        owner = next(port for port, node in nodes.items()
                     if any(int(first) <= slot <= int(last) and int(primary[1]) == port
                            for first, last, primary, *_ in node.execute_command("CLUSTER", "SLOTS")))
        source, target = nodes[owner], nodes[to_port]
        target.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[owner])
        source.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[to_port])
        if not finish:
            return owner
        while keys := source.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
            source.execute_command("MIGRATE", "127.0.0.1", to_port, "", 0, 5000, "KEYS", *keys)
        for node in (target, source, *nodes.values()):
            node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[to_port])
        return owner
    finally:
        for node in nodes.values():
            node.close()


def node_of(redis: Redis, bucket: int) -> int:
    node = cast(RedisCluster, redis).get_node_from_key(fences_key(bucket))
    assert node is not None
    return int(node.port)


async def test_a_flush_is_one_script_per_node_and_a_resend_is_not_written_twice(
        cluster: LocalValkeyCluster, redis: Redis) -> None:
    ids = one_job_per_bucket()
    appender = StreamAppender(redis, writer_id="w", maxlen=1000, ttl_s=60)
    flush = [JobEntries(job_id, "", TTL.LIVE, [chunk(job_id), chunk("!")]) for job_id in ids]
    assert await appender.append("w:0", flush) == [True] * len(ids)       # loads the scripts
    reset_stats(cluster)
    flush = [JobEntries(job_id, "", TTL.KEEP, [chunk("+")]) for job_id in ids]
    assert await appender.append("w:1", flush) == [True] * len(ids)
    assert await appender.append("w:1", flush) == [True] * len(ids)       # re-sent: answered from the marks
    assert set(script_calls(cluster).values()) == {2}, "one call per node per flush, 48 buckets on 3 nodes"
    assert sorted(Counter(node_of(redis, bucket) for bucket in range(STREAM_BUCKETS)).values()) == [16, 16, 16]
    for job_id in ids:
        assert [e.text for e in await read_all(redis, job_id)] == [job_id, "!", "+"]


async def test_a_node_call_is_fenced_per_job_as_a_bucket_call_is(redis: Redis) -> None:
    ids = one_job_per_bucket()
    old = {job_id: f"w1#{10 + n}" for n, job_id in enumerate(ids)}
    assert await fences_raised(redis, old) == dict.fromkeys(ids, True)
    newer = ids[::3]                                   # a newer claim of every third job: the old one lost it
    assert await fences_raised(redis, {job_id: f"w2#{100 + n}" for n, job_id in enumerate(newer)}) == \
        dict.fromkeys(newer, True)
    appender = StreamAppender(redis, writer_id="w1", maxlen=1000, ttl_s=60)
    written = await appender.append("w1:0", [JobEntries(job_id, old[job_id], TTL.LIVE, [chunk("a")]) for job_id in ids])
    assert written == [job_id not in newer for job_id in ids]
    for job_id in ids:
        assert [e.text for e in await read_all(redis, job_id)] == ([] if job_id in newer else ["a"])


async def test_a_moved_bucket_makes_its_node_refuse_whole_and_the_buckets_go_one_by_one(
        cluster: LocalValkeyCluster, redis: Redis, caplog: pytest.LogCaptureFixture) -> None:
    """The client's slot map still gives bucket b to node A after b's slot moved to B: A's node call,
    which carries b, is refused before anything is written. The same flush sent again (its reply lost
    before the move) is answered from the call's flush mark, not written twice; a new one goes bucket by
    bucket (no entry of A's other buckets twice), reaching b on B through MOVED. The next flush groups by
    the map the client has learnt."""
    ids = one_job_per_bucket()
    appender = StreamAppender(redis, writer_id="w", maxlen=1000, ttl_s=60)
    first = [JobEntries(j, "", TTL.LIVE, [chunk("a")]) for j in ids]
    assert await appender.append("w:0", first) == [True] * len(ids)
    moved = next(b for b in range(1, STREAM_BUCKETS) if node_of(redis, b) == node_of(redis, 0))
    target = next(node.port for node in cluster.nodes() if node.port != node_of(redis, moved))
    slot = key_slot(STREAM_TAGS[moved].encode())
    owner = move_slot(cluster, slot, target)
    try:
        assert node_of(redis, moved) != target, "the client has not learnt of the move yet"
        assert await appender.append("w:0", first) == [True] * len(ids)          # re-sent: answered, not written
        assert "sent bucket by bucket" not in caplog.text
        with caplog.at_level(logging.INFO, logger="slotq.jobs.protocol.streams"):
            assert await appender.append("w:1", [JobEntries(j, "", TTL.KEEP, [chunk("b")]) for j in ids]) == \
                [True] * len(ids)
        assert "sent bucket by bucket" in caplog.text
        assert node_of(redis, moved) == target, "MOVED taught the client the bucket's new node"
        assert await appender.append("w:2", [JobEntries(j, "", TTL.KEEP, [chunk("c")]) for j in ids]) == \
            [True] * len(ids)
        for job_id in ids:
            assert [e.text for e in await read_all(redis, job_id)] == ["a", "b", "c"]
    finally:
        move_slot(cluster, slot, owner)


async def test_a_flush_resent_after_its_first_buckets_slot_moved_is_answered_from_the_mark(
        cluster: LocalValkeyCluster, redis: Redis) -> None:
    """The node call's flush mark lives in its first bucket's slot and moves with it: the call sent again
    follows MOVED to the slot's new node, which answers from the mark before touching anything else."""
    ids = one_job_per_bucket()
    appender = StreamAppender(redis, writer_id="w", maxlen=1000, ttl_s=60)
    flush = [JobEntries(j, "", TTL.LIVE, [chunk("a")]) for j in ids]
    assert await appender.append("w:0", flush) == [True] * len(ids)
    slot = key_slot(STREAM_TAGS[0].encode())
    owner = move_slot(cluster, slot, next(node.port for node in cluster.nodes() if node.port != node_of(redis, 0)))
    try:
        assert await appender.append("w:0", flush) == [True] * len(ids)
        for job_id in ids:
            assert [e.text for e in await read_all(redis, job_id)] == ["a"]
    finally:
        move_slot(cluster, slot, owner)


async def test_a_migrating_slot_refuses_a_node_call_before_it_writes(cluster: LocalValkeyCluster,
                                                                      redis: Redis) -> None:
    """While one bucket's slot is MIGRATING (its keys not moved yet), the node script touching it is
    refused by its checks, before it writes the bucket it carries first; the same flush, sent again once
    the slot is stable, writes both buckets once."""
    ids = one_job_per_bucket()
    first, other = 0, next(b for b in range(1, STREAM_BUCKETS) if node_of(redis, b) == node_of(redis, 0))
    appender = StreamAppender(redis, writer_id="w", maxlen=1000, ttl_s=60)
    pair = [JobEntries(ids[b], "", TTL.LIVE, [chunk("a")]) for b in (first, other)]
    assert await appender.append("w:0", pair) == [True, True]
    slot = key_slot(STREAM_TAGS[other].encode())
    target = next(node.port for node in cluster.nodes() if node.port != node_of(redis, other))
    move_slot(cluster, slot, target, finish=False)
    try:
        call = appender._call("w:1", [(b, [job]) for b, job in zip((first, other), pair, strict=True)])
        assert isinstance(call, NodeStreamFlush)
        [refused] = await ScriptRunner(redis).run_all([call], return_refusals=True)
        assert "non local key" in str(refused)
        assert [e.text for e in await read_all(redis, ids[first])] == ["a"], "nothing written before the refusal"
    finally:
        for node in primaries(cluster):
            with contextlib.closing(node):
                node.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
    assert await appender.append("w:1", pair) == [True, True]        # the same flush, once the slot is stable
    for b in (first, other):
        assert [e.text for e in await read_all(redis, ids[b])] == ["a", "a"]


@pytest.mark.parametrize("primaries", [2, 3, 4, 6, 8, 12, 16])
def test_the_buckets_fall_evenly_on_equal_slot_ranges(primaries: int) -> None:
    """However a tool rounds the ranges' edges (LocalValkeyCluster's split here; each tag lies in the
    middle half of its 48th of the slots, far from any edge)."""
    edges = [n * 16384 // primaries for n in range(primaries + 1)]
    counts = [sum(edges[n] <= key_slot(tag.encode()) < edges[n + 1] for tag in STREAM_TAGS) for n in range(primaries)]
    assert counts == [STREAM_BUCKETS // primaries] * primaries


def test_the_node_script_declares_one_key_and_carries_the_flag() -> None:
    call = NodeStreamFlush(flush_mark="m1", bucket_fences=["f1", "f2"], bucket_jobs=[1, 1],
                           streams=["s1", "s2"], flush_id="x", maxlen=10, live_ttl_s=1, final_ttl_s=2,
                           job_ids=["a", "b"], leases=["", ""], ttls=[0, 0], entry_counts=[0, 0], entries=[])
    assert call.keys() == ["m1"]
    assert lua_source(NodeStreamFlush).startswith("#!lua flags=allow-cross-slot-keys\n")
