"""The gateway's own records (jobs/gateway/records.py) on a single Redis and on a real 3-primary Valkey
Cluster: on the cluster the file and batch scripts keep their keys in one slot each (a cluster refuses a
script across slots, and any transaction), the files' MGET too; on both every operation reads back what
it wrote; on a single Redis the names stay those the gateway always used (but the unfinished batches,
which a tenant named ``active`` collided with)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import cast

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from slotq.jobs.gateway.records import (
    BatchKeys,
    BatchRecords,
    FileKeys,
    FileQuotaExceeded,
    FileRecords,
    JobRecord,
    JobRecords,
    ModelsSeen,
)
from slotq.jobs.protocol.connection import connect, is_cluster


@pytest.fixture(params=["single", "cluster"])
async def redis(request: pytest.FixtureRequest) -> AsyncIterator[Redis]:
    """slotq's client (:func:`connect`) of the session's emptied Valkey, or of the emptied cluster."""
    if request.param == "single":
        client = await connect(request.getfixturevalue("redis_url"), patient=False)
    else:
        client = await connect(request.getfixturevalue("redis_cluster").url, patient=False)
        await cast(RedisCluster, client).flushall(target_nodes=RedisCluster.PRIMARIES)
    yield client
    await client.aclose()


def slots(*keys: str) -> set[int]:
    return {key_slot(key.encode()) for key in keys}


def test_single_redis_names_are_unchanged_and_cluster_names_share_a_slot() -> None:
    files, batches = FileKeys(), BatchKeys()
    assert (files.file("f1"), files.index("default"), files.index("t"), files.bytes("t"), files.expiry) == (
        "slotq:gateway:file:{f1}", "slotq:gateway:files", "slotq:gateway:files:t", "slotq:gateway:file-bytes:t",
        "slotq:gateway:file-expiry")
    assert (batches.batch("b1"), batches.index("default"), batches.index("t"), batches.active, batches.lease("b1")) \
        == ("slotq:gateway:batch:{b1}", "slotq:gateway:batches", "slotq:gateway:batches:t",
            "slotq:gateway:batches-active", "slotq:gateway:batch-lease:{b1}")
    assert batches.index("active") != batches.active                   # a tenant may be named active
    files, batches = FileKeys(clustered=True), BatchKeys(clustered=True)
    assert len(slots(files.file("f1"), files.file("f2"), files.index("default"), files.index("t"), files.bytes("t"),
                     files.expiry)) == 1
    assert len(slots(batches.batch("b1"), batches.batch("b2"), batches.index("default"), batches.index("t"),
                     batches.active)) == 1


async def test_files_are_added_capped_listed_expired_and_removed(redis: Redis) -> None:
    records = FileRecords(redis)
    for n, tenant in enumerate(["t", "t", "default"]):
        await records.add(f"f{n}", tenant, f'{{"id": "f{n}", "bytes": 10}}', created_ms=1000 + n, size=10,
                          expires_at=100 + n if n < 2 else None, caps=(2, 100))
    with pytest.raises(FileQuotaExceeded) as refused:
        await records.add("f3", "t", '{"bytes": 10}', created_ms=2000, size=10, expires_at=None, caps=(2, 100))
    assert refused.value.what == "files"
    with pytest.raises(FileQuotaExceeded) as refused:
        await records.add("f3", "default", '{"bytes": 95}', created_ms=2000, size=95, expires_at=None, caps=(9, 100))
    assert refused.value.what == "bytes"
    await records.add("f1", "t", '{"id": "f1", "bytes": 30}', created_ms=1001, size=30, expires_at=101,
                      caps=(2, 100))              # recorded again (replaced): counts the difference, not a file
    assert await records.usage("t") == (2, 40)
    assert await records.get("f1") == b'{"id": "f1", "bytes": 30}'
    assert await records.get_many(["f0", "nope", "f2"]) == [b'{"id": "f0", "bytes": 10}', None,
                                                            b'{"id": "f2", "bytes": 10}']
    assert await records.rank("t", "f1", newest_first=True) == 0
    assert await records.rank("t", "f1", newest_first=False) == 1
    assert await records.page("t", 0, 10, newest_first=False) == ["f0", "f1"]
    assert await records.expired(now=100.5, count=10) == ["f0"]
    assert await records.remove("f0", "t", 10)
    assert not await records.remove("f0", "t", 10)                  # another call did first: counted once
    assert await records.usage("t") == (1, 30)
    assert await records.expired(now=1000, count=10) == ["f1"]
    await records.forget_expiry("f1")
    assert await records.expired(now=1000, count=10) == []


async def test_batches_are_added_listed_moved_and_driven_under_a_lease(redis: Redis) -> None:
    records = BatchRecords(redis, lease_ms=10_000)
    for n in range(3):
        await records.add(f"b{n}", "t", {"status": "validating", "n": n}, created_ms=1000 + n)
    assert await records.get("b1") == {"status": "validating", "n": 1}
    assert await records.get("nope") == {}
    assert await records.rank("t", "b2") == 0
    assert await records.page("t", 0, 1) == ["b2", "b1"]
    assert await records.active_ids() == ["b0", "b1", "b2"]
    await records.update("b1", {"n": 10})
    assert await records.get_field("b1", "n") == 10
    assert await records.transition("b1", ["validating"], {"status": "in_progress"})
    assert not await records.transition("b1", ["validating"], {"status": "failed"})
    assert await records.get_field("b1", "status") == "in_progress"
    await records.retire("b0")
    assert await records.active_ids() == ["b1", "b2"]
    assert await records.acquire("b1", "gw-1")
    assert not await records.acquire("b1", "gw-2")
    assert await records.renew("b1", "gw-1") and not await records.renew("b1", "gw-2")
    await records.release("b1", "gw-1")
    assert await records.acquire("b1", "gw-2")


async def test_a_tenant_named_active_has_its_batches_and_older_gateways_unfinished_ones_are_driven(
        redis: Redis) -> None:
    """The tenant ``active``'s index was once the name of the unfinished batches' set (a 503 for every batch
    it created). A set left there by an older gateway (a rolling upgrade) is taken over, and a tenant's
    index there is left alone."""
    records = BatchRecords(redis, lease_ms=10_000)
    former = records.keys.former_active
    if former is not None:
        await redis.sadd(former, "old-1", "old-2")                      # listed by an older gateway
    await records.add("b1", "active", {"status": "validating"}, created_ms=1000)
    await records.add("b2", "active", {"status": "validating"}, created_ms=1001)
    assert await records.page("active", 0, 10) == ["b2", "b1"]
    assert await records.active_ids() == ["b1", "b2", *(["old-1", "old-2"] if former else [])]
    await records.retire("b1")
    assert await records.active_ids() == ["b2", *(["old-1", "old-2"] if former else [])]
    assert await records.page("active", 0, 10) == ["b2", "b1"]         # the tenant's index is untouched


async def test_the_records_are_laid_out_for_the_client(redis: Redis) -> None:
    assert FileRecords(redis).keys.clustered == BatchRecords(redis, lease_ms=1).keys.clustered == is_cluster(redis)


async def test_job_records_and_models_seen(redis: Redis) -> None:
    jobs = JobRecords(redis)
    record = JobRecord(queue="slotq:queue", model="m", kind="chat", created=1)
    assert await jobs.put_if_absent("j1", record, ttl_s=60) is None
    assert await jobs.put_if_absent("j1", record.model_copy(update={"model": "other"}), ttl_s=60) == record
    assert await jobs.get("j1") == record
    models = ModelsSeen(redis)
    await models.remember({"m": 12.5})
    assert await models.last_seen("m") == 12.5 and await models.last_seen("other") is None
