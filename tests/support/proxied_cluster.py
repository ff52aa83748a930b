"""A Valkey Cluster behind a network that the fault tests can cut, for the chaos run on a cluster.

3 primaries with a replica each (every write fsynced), each node behind a :class:`LatencyProxy` of its
own whose port the node announces (:meth:`LocalValkeyCluster.announce_ports`): the slot map, ``MOVED``
and the nodes a client reads streams from all name proxies, so every connection of every client --
a worker's commands, its cancel subscription, a producer's stream reader -- passes one, and a replica
promoted by a failover is reached through its proxy too. Cutting every proxy at once is a network cut
between the clients and the cluster; the nodes' bus is direct, so the cluster itself sees no fault.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis

from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.redis_cluster import LocalValkeyCluster
from tests.support.faults import Fleet, LatencyProxy


class ProxiedCluster:
    """:class:`LocalValkeyCluster` (``primaries`` with a replica each), a proxy before each node. Start
    and stop it on the event loop that runs the proxies (:func:`proxied_cluster`)."""

    def __init__(self, directory: Path, primaries: int = 3) -> None:
        self.cluster = LocalValkeyCluster(directory, primaries=primaries, replicas_per_primary=1, fsync="always")
        self.proxies: list[LatencyProxy] = []

    @property
    def url(self) -> str:
        """Every node's proxy: the only addresses a client of this URL ever connects to."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{proxy.port}" for proxy in self.proxies)

    async def start(self) -> None:
        await asyncio.to_thread(self.cluster.start)
        for node in self.cluster.nodes():
            proxy = LatencyProxy(node.port)
            await proxy.start()
            self.proxies.append(proxy)
        await asyncio.to_thread(self.cluster.announce_ports,
                                {proxy.upstream_port: proxy.port or 0 for proxy in self.proxies})

    async def close(self) -> None:
        for proxy in self.proxies:
            await proxy.close()
        await asyncio.to_thread(self.cluster.stop)

    async def cut(self, hold_s: float) -> int:
        """A network cut between every client and every node (:meth:`LatencyProxy.cut` on each proxy at
        once); the connections dropped."""
        return sum(await asyncio.gather(*(proxy.cut(hold_s) for proxy in self.proxies)))

    def queue_primary(self, client: SlotqClient) -> int:
        """The port of the node that serves ``client``'s queue slot now (its claims, job records and results)."""
        node = client.redis.get_node_from_key(client.queue.keys.jobs)      # type: ignore[attr-defined]
        return self.cluster.node_port(int(node.port))

    async def fail_over_quietly(self, fleet: Fleet, port: int, timeout: float = 30) -> float:
        """SIGKILL the primary on ``port`` once its replica holds every write it acknowledged, the
        workers held still meanwhile (:meth:`Fleet.held`; replication is asynchronous: a write
        acknowledged in the primary's last moment is lost with it, as docs/cluster.md says, and that
        loss is not under test here); then the seconds until its replica serves its slots."""
        async with fleet.held():
            await asyncio.to_thread(self._wait_replicated, port, timeout)
            self.cluster.kill_primary(port)
        return await asyncio.to_thread(self.cluster.wait_for_failover, timeout)

    def _wait_replicated(self, port: int, timeout: float) -> None:
        """Until the replica of the primary on ``port`` has processed its whole replication stream."""
        shard = next(node.shard for node in self.cluster.nodes() if node.port == port)
        replica = next(node.port for node in self.cluster.nodes() if node.shard == shard and node.role == "replica")
        deadline = time.monotonic() + timeout
        with redis.Redis(port=port) as primary, redis.Redis(port=replica) as follower:
            while (follower.info("replication")["master_repl_offset"]
                   < primary.info("replication")["master_repl_offset"]):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the replica on {replica} did not catch up with its primary on {port}")
                time.sleep(0.01)


@pytest.fixture
async def proxied_cluster(tmp_path: Path) -> AsyncIterator[ProxiedCluster]:
    """A :class:`ProxiedCluster` of this test's own."""
    cluster = ProxiedCluster(tmp_path / "cluster")
    try:
        await cluster.start()
        yield cluster
    finally:
        await cluster.close()
