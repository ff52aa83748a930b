"""The local Valkey Cluster (jobs/redis_cluster.py): real valkey-server nodes, formed with redis-py.

A 3-primary cluster forms and spreads keys of different hash tags over its primaries; with a replica
per primary it survives a primary's SIGKILL (the replica is promoted and the killed primary's slots take
writes again through redis-py's own cluster client); stopping it leaves no process behind.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster

from slotq.jobs.redis_cluster import HASH_SLOTS, LocalValkeyCluster, NodeStatus
from slotq.jobs.redis_server import port_is_serving


def cluster_client(cluster: LocalValkeyCluster) -> RedisCluster:
    return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", node.port) for node in cluster.nodes()],
                        decode_responses=True)


def primaries(cluster: LocalValkeyCluster) -> list[NodeStatus]:
    return [node for node in cluster.nodes() if node.role == "primary"]


def keys_on(port: int) -> set[str]:
    with redis.Redis(port=port, decode_responses=True) as node:
        return set(node.keys("*"))


def key_per_shard(cluster: LocalValkeyCluster, prefix: str) -> dict[int, str]:
    """A key with a hash tag of its own in each shard's slot range: shard index -> key."""
    with redis.Redis(port=cluster.nodes()[0].port, decode_responses=True) as node:
        per_shard: dict[int, str] = {}
        for tag in range(100):
            key = f"{prefix}:{{t{tag}}}"
            per_shard.setdefault(int(node.cluster("KEYSLOT", key)) * len(primaries(cluster)) // HASH_SLOTS, key)
    assert len(per_shard) == len(primaries(cluster))
    return per_shard


@pytest.fixture
def three_primaries(tmp_path: Path) -> Iterator[LocalValkeyCluster]:
    with LocalValkeyCluster(tmp_path / "cluster", primaries=3) as cluster:
        yield cluster


def test_a_three_primary_cluster_forms_and_spreads_hash_tags(three_primaries: LocalValkeyCluster) -> None:
    nodes = three_primaries.nodes()
    assert [(node.role, node.shard) for node in nodes] == [("primary", 0), ("primary", 1), ("primary", 2)]
    assert three_primaries.url == "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in nodes)
    for node in nodes:
        with redis.Redis(port=node.port, decode_responses=True) as client:
            info = client.execute_command("CLUSTER", "INFO")
            assert "cluster_state:ok" in info and "cluster_slots_assigned:16384" in info
            assert "cluster_known_nodes:3" in info
    per_shard = key_per_shard(three_primaries, "spread")
    with cluster_client(three_primaries) as client:
        for key in per_shard.values():
            client.set(key, "v")
    assert [keys_on(node.port) for node in nodes] == [{per_shard[0]}, {per_shard[1]}, {per_shard[2]}]


@pytest.mark.slow
def test_a_killed_primary_is_replaced_by_its_replica(tmp_path: Path) -> None:
    with LocalValkeyCluster(tmp_path / "cluster", primaries=3, replicas_per_primary=1) as cluster, \
            cluster_client(cluster) as client:
        assert [node.role for node in cluster.nodes()] == ["primary"] * 3 + ["replica"] * 3
        per_shard = key_per_shard(cluster, "failover")
        for key in per_shard.values():
            client.set(key, "before")
        first_primary = {node.shard: node.port for node in primaries(cluster)}
        with redis.Redis(port=first_primary[1]) as primary:
            assert primary.wait(1, 5000) == 1                  # the replica holds the write before the kill

        killed = cluster.kill_primary(1)
        assert killed == first_primary[1] and not port_is_serving(killed)
        cluster.wait_for_failover(timeout=30)

        after = {node.shard: node for node in cluster.nodes()}
        roles = {(node.shard, node.role) for node in cluster.nodes()}
        assert roles == {(0, "primary"), (0, "replica"), (1, "down"), (1, "primary"), (2, "primary"),
                         (2, "replica")}
        assert after[1].port != killed
        assert client.get(per_shard[1]) == "before"
        for key in per_shard.values():
            client.set(key, "after")
        assert [client.get(key) for key in per_shard.values()] == ["after"] * 3


@pytest.mark.slow
def test_stop_leaves_no_process(tmp_path: Path) -> None:
    cluster = LocalValkeyCluster(tmp_path / "cluster", primaries=3, replicas_per_primary=1)
    cluster.start()
    nodes = cluster.nodes()
    cluster.kill_primary(0)                    # a dead node among the live ones is no obstacle to stop
    cluster.stop()
    for node in nodes:
        with pytest.raises(ProcessLookupError):
            os.kill(node.pid, 0)
        assert not port_is_serving(node.port)
    assert cluster.nodes() == []
