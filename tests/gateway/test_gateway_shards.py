"""``GET /api/shards``, the dashboard's cluster shards: the gateway's app in this process (httpx over ASGI)
on the session's Valkey, where there are none, and on its real 3-primary Valkey Cluster, where every slot is
on one primary, one primary holds the queue's slot, a partitioned queue's partitions are listed, and however
many dashboards ask at once the shards are read once, by one reader kept for the process."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as sync_redis
from fastapi import FastAPI
from redis.crc import key_slot

from slotq.jobs.gateway.app import create_app
from slotq.jobs.gateway.settings import GatewaySettings
from slotq.jobs.gateway.shards import ShardsView
from slotq.jobs.protocol.keys import CLUSTER_SLOTS, QueueKeys, partition_names
from slotq.jobs.protocol.shard_load import STREAM_SLOTS
from slotq.jobs.redis_cluster import LocalValkeyCluster


@contextlib.asynccontextmanager
async def gateway(redis_url: str, tmp_path: Path, **settings: Any) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """The gateway's app in this process, its lifespan run (keyless: every loopback caller sees ``/api``),
    and a client of it."""
    app = create_app(GatewaySettings(_env_file=None, gateway_files_dir=tmp_path, **settings), redis_url)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as http:
        yield app, http


async def shards(http: httpx.AsyncClient) -> dict[str, Any]:
    answer = await http.get("/api/shards", timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()  # type: ignore[no-any-return]


def primary_ports(cluster: LocalValkeyCluster) -> list[int]:
    return [node.port for node in cluster.nodes() if node.role == "primary"]


def dbsize_calls(cluster: LocalValkeyCluster) -> dict[int, int]:
    """DBSIZE calls each primary served since its stats were reset: one per read of the shards."""
    calls = {}
    for port in primary_ports(cluster):
        with sync_redis.Redis(port=port) as node:
            calls[port] = int(node.info("commandstats").get("cmdstat_dbsize", {}).get("calls", 0))
    return calls


def reset_stats(cluster: LocalValkeyCluster) -> None:
    for port in primary_ports(cluster):
        with sync_redis.Redis(port=port) as node:
            node.config_resetstat()


@pytest.mark.parametrize("redis_backend", ["single"])
async def test_one_redis_has_no_shards(redis_url: str, tmp_path: Path) -> None:
    async with gateway(redis_url, tmp_path) as (_app, http):
        assert await shards(http) == {"clustered": False, "queue": "slotq:queue", "shards": []}


@pytest.mark.slow
@pytest.mark.parametrize("redis_backend", ["cluster"])
async def test_the_shards_cover_the_slots_and_one_holds_the_queue(redis_url: str, redis_cluster: LocalValkeyCluster,
                                                                   tmp_path: Path) -> None:
    queue_slot = key_slot(QueueKeys("slotq:queue", ("any",), clustered=True).jobs.encode())
    once = dict.fromkeys(primary_ports(redis_cluster), 1)
    async with gateway(redis_url, tmp_path) as (app, http):
        view: ShardsView = app.state.shards
        view.fresh_s = 3600                                  # fresh however slowly this machine runs the test
        reset_stats(redis_cluster)
        answers = await asyncio.gather(*(shards(http) for _ in range(8)))     # eight dashboards at once
        assert dbsize_calls(redis_cluster) == once                            # one read
        read = answers[0]
        assert all(answer == read for answer in answers)
        assert await shards(http) == read                    # and asked again while fresh: as it was
        assert dbsize_calls(redis_cluster) == once
        view.fresh_s = 0                                     # stale at once: the next request reads again
        again = await shards(http)
    assert read["clustered"] and read["queue"] == "slotq:queue" and again["time"] > read["time"]
    listed = read["shards"]
    assert sorted(int(shard["node"].rsplit(":", 1)[1]) for shard in listed) == sorted(primary_ports(redis_cluster))
    ranges = sorted((first, last) for shard in listed for first, last in shard["slots"])
    assert ranges[0][0] == 0 and ranges[-1][1] == CLUSTER_SLOTS - 1
    assert all(later[0] == earlier[1] + 1 for earlier, later in itertools.pairwise(ranges))      # no gap, no overlap
    [home] = [shard for shard in listed if shard["queue_slot"] is not None]
    assert home["queue_slot"] == queue_slot
    assert any(first <= queue_slot <= last for first, last in home["slots"])
    assert sorted(slot for shard in listed for slot in shard["stream_slots"]) == sorted(STREAM_SLOTS)
    assert all(shard["partitions"] == [] for shard in listed)                      # a queue of one partition
    # the same reader read again: each primary's CPU share since the first read (None on a first read)
    assert {shard["cpu_share"] for shard in listed} == {None}
    assert all(shard["cpu_share"] is not None and shard["cpu_share"] >= 0 for shard in again["shards"])


@pytest.mark.slow
@pytest.mark.parametrize("redis_backend", ["cluster"])
async def test_a_partitioned_queues_partitions_are_listed_on_their_shards(redis_url: str, tmp_path: Path) -> None:
    async with gateway(redis_url, tmp_path, queue_partitions=3) as (_app, http):
        listed = (await shards(http))["shards"]
    assert sorted(index for shard in listed for index in shard["partitions"]) == [0, 1, 2]
    [home] = [shard for shard in listed if shard["queue_slot"] is not None]
    assert 0 in home["partitions"]
    for shard in listed:
        for index in shard["partitions"]:
            slot = key_slot(QueueKeys(partition_names("slotq:queue", 3)[index], ("any",), clustered=True).jobs.encode())
            assert any(first <= slot <= last for first, last in shard["slots"]), (index, shard)
