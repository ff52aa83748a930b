"""The load on each shard of a Redis Cluster, as ``slotq status`` shows it.

On a cluster, streaming spreads over every shard (each job's stream hashes by its id) while a queue's
claim path and job records stay on the one shard that serves the queue's hash slot (docs/cluster.md).
So what an operator needs to see is each primary's share: keys, memory, commands per second, CPU,
clients, which shard holds the queue, and which of the stream buckets' slots each holds, with the
keys in the slots slotq uses (the queue's and the buckets') and each shard's share of them and of
the commands. One INFO and one DBSIZE per primary and one ``CLUSTER COUNTKEYSINSLOT`` per slot slotq
uses (49, and one per partition of a partitioned queue), sent side by side; nothing scans keys.

The slot ranges and the queue's shard come from the slot map the client routes by (redis-py's, read
anew when a failover moved slots), so the shard marked as the queue's is the one its commands go to.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, cast

from pydantic import BaseModel, Field
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot

from slotq.jobs.protocol import catalog
from slotq.jobs.protocol.connection import is_cluster
from slotq.jobs.protocol.keys import STREAM_TAGS, QueueKeys, partition_names
from slotq.jobs.protocol.partitioned_queue import Queue, partition_job_keys

STREAM_SLOTS = tuple(key_slot(f"{{{tag}}}".encode()) for tag in STREAM_TAGS)     # one per stream bucket


class ShardLoad(BaseModel):
    """One primary of a cluster and what it carries now."""

    node: str = Field(description="the primary's host:port")
    slots: list[tuple[int, int]] = Field(description="the hash slot ranges it serves (first and last slot of each)")
    replicas: int = Field(description="replicas connected to it (INFO connected_slaves)")
    keys: int = Field(description="keys it holds (DBSIZE)")
    used_memory_bytes: int
    ops_per_s: int = Field(description="commands per second, as the server samples them (instantaneous_ops_per_sec)")
    cpu_share: float | None = Field(
        description="the share of one core the server used since the previous read (1.0: a whole core); "
                    "None on the first read of this node")
    clients: int = Field(description="connected clients")
    ops_share: float | None = Field(
        description="its share of the commands per second of all the primaries (None while none runs any)")
    stream_slots: list[int] = Field(
        description="the hash slots of the stream buckets it serves (every queue's job streams, their fences "
                    "and the writers' flush marks; docs/cluster.md)")
    slotq_keys: int = Field(
        description="keys in the slots slotq uses on it: the queue's slot (on the queue's shard) and its stream "
                    "buckets' slots (CLUSTER COUNTKEYSINSLOT)")
    slotq_keys_share: float | None = Field(
        description="its share of the keys in the slots slotq uses, over all primaries (None while there are none)")
    queue_slot: int | None = Field(
        description="the hash slot of the queue's keys, on the shard that serves it (its claim path and job "
                    "records); None on the other shards")
    queues: list[str] = Field(
        default_factory=list,
        description="the queues of the fleet's models (the catalog's live entries) whose hash slot it serves: "
                    "where each model's claim path lands (docs/cluster.md, 'Several models'); of a partitioned "
                    "queue, each partition (``<queue>#<n>``) whose slot it serves")
    partitions: list[int] = Field(
        default_factory=list,
        description="of a queue split into partitions (SLOTQ_QUEUE_PARTITIONS > 1), the partitions whose hash slot "
                    "it serves (0 is the queue's own slot, queue_slot): its share of the claim path; empty for a "
                    "queue of one partition")


class ShardLoadReader:
    """Reads the load of every primary of a cluster. It remembers each node's CPU time, so each read
    after the first gives the share of a core used in between (``slotq status --watch``)."""

    def __init__(self, redis: Redis, queue_key: str, *, partition_keys: Sequence[str] = ()) -> None:
        """``redis``: a cluster client (:func:`slotq.jobs.protocol.connection.is_cluster`); ``queue_key``:
        any key of the queue (they share one slot); ``partition_keys``: of a queue split into partitions, any
        key of each partition, partition 0's (``queue_key``'s) first. The models' queues are read as split
        into as many."""
        self._redis = redis
        self._cluster = cast(RedisCluster, redis)
        self._queue_key = queue_key
        self._partition_keys = tuple(partition_keys)
        self._cpu_seen: dict[str, tuple[float, int]] = {}       # node -> (CPU seconds, server time in us)

    async def read(self) -> list[ShardLoad]:
        """Every primary that serves slots, in slot order."""
        await self._cluster.initialize()            # reads the slot map again if a failed command dropped it
        primaries, ranges = _slot_ranges(self._cluster.nodes_manager.slots_cache)
        queue_node = self._cluster.get_node_from_key(self._queue_key)
        queue_slot = self._cluster.keyslot(self._queue_key)
        partition_slots = [self._cluster.keyslot(key) for key in self._partition_keys]
        # partition 0's slot is queue_slot; a partition's slot could (rarely) be a stream bucket's
        other_partition_slots = sorted(set(partition_slots) - {queue_slot, *STREAM_SLOTS})
        counted = (*STREAM_SLOTS, queue_slot, *other_partition_slots)
        stream_slots: dict[str, list[int]] = {node.name: [] for node in primaries}
        for slot in sorted(STREAM_SLOTS):
            if serving := self._cluster.nodes_manager.slots_cache.get(slot):       # none: a slot no node serves
                stream_slots[serving[0].name].append(slot)
        figures, counts, models = await asyncio.gather(
            asyncio.gather(*(self._figures(node) for node in primaries)),
            asyncio.gather(*(self._cluster.cluster_countkeysinslot(slot) for slot in counted)),
            catalog.read(self._redis, now=time.time()))
        queues: dict[str, list[str]] = {node.name: [] for node in primaries}
        for queue in sorted({model.queue for model in models.values()}):
            for part in partition_names(queue, max(1, len(partition_slots))):
                # any key of the queue: its lanes do not change its slot
                holder = self._cluster.get_node_from_key(QueueKeys(part, ("any",), clustered=True).jobs)
                if holder is not None and holder.name in queues:
                    queues[holder.name].append(part)
        holding: dict[str, list[int]] = {node.name: [] for node in primaries}
        for index, slot in enumerate(partition_slots):
            if (serving := self._cluster.nodes_manager.slots_cache.get(slot)) and serving[0].name in holding:
                holding[serving[0].name].append(index)
        keys_in = dict(zip(counted, map(int, counts), strict=True))
        slotq_keys = {node.name: sum(keys_in[slot] for slot in stream_slots[node.name]) for node in primaries}
        if queue_node is not None and queue_slot not in STREAM_SLOTS:
            slotq_keys[queue_node.name] = slotq_keys.get(queue_node.name, 0) + keys_in[queue_slot]
        for slot in other_partition_slots:
            if serving := self._cluster.nodes_manager.slots_cache.get(slot):
                slotq_keys[serving[0].name] = slotq_keys.get(serving[0].name, 0) + keys_in[slot]
        all_ops = sum(int(info["instantaneous_ops_per_sec"]) for info, _ in figures)
        all_keys = sum(slotq_keys.values())
        return [ShardLoad(node=node.name, slots=ranges[node.name], replicas=int(info.get("connected_slaves", 0)),
                          keys=keys, used_memory_bytes=int(info["used_memory"]),
                          ops_per_s=int(info["instantaneous_ops_per_sec"]), cpu_share=self._cpu_share(node.name, info),
                          clients=int(info["connected_clients"]),
                          queue_slot=queue_slot if queue_node is not None and node.name == queue_node.name else None,
                          ops_share=int(info["instantaneous_ops_per_sec"]) / all_ops if all_ops else None,
                          stream_slots=stream_slots[node.name], slotq_keys=slotq_keys.get(node.name, 0),
                          queues=queues[node.name], partitions=holding[node.name],
                          slotq_keys_share=slotq_keys.get(node.name, 0) / all_keys if all_keys else None)
                for node, (info, keys) in zip(primaries, figures, strict=True)]

    async def _figures(self, node: ClusterNode) -> tuple[dict[str, Any], int]:
        info, keys = await asyncio.gather(self._cluster.info(target_nodes=node),
                                          self._cluster.dbsize(target_nodes=node))
        return info, int(keys)

    def _cpu_share(self, node: str, info: dict[str, Any]) -> float | None:
        """CPU seconds (system and user, the server's own count) over the server's time since this node's
        last read; None on its first read, or when its count went back (the node restarted)."""
        cpu_s = float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
        at_us = int(info["server_time_usec"])
        seen = self._cpu_seen.get(node)
        self._cpu_seen[node] = (cpu_s, at_us)
        if seen is None or cpu_s < seen[0] or at_us <= seen[1]:
            return None
        return (cpu_s - seen[0]) / ((at_us - seen[1]) / 1e6)


def shard_reader(redis: Redis, queue: Queue) -> ShardLoadReader | None:
    """The reader of the shards under ``queue`` as producers and workers open it (of a queue split into
    partitions, each partition's slot too); None on one Redis or Sentinel, which has no shards. Whoever shows
    the shards (``slotq status``, the gateway's ``/api/shards``) keeps the one it gets for all its reads, so
    each read's CPU shares are since the one before."""
    if not is_cluster(redis):
        return None
    keys = partition_job_keys(queue)
    return ShardLoadReader(redis, queue.keys.jobs, partition_keys=keys if len(keys) > 1 else ())


def _slot_ranges(slots: dict[int, list[ClusterNode]]) -> tuple[list[ClusterNode], dict[str, list[tuple[int, int]]]]:
    """The primaries of a slot map of slot -> [primary, replicas...], in the order of their first slot, and
    each one's runs of consecutive slots, by node name."""
    primaries: list[ClusterNode] = []
    ranges: dict[str, list[tuple[int, int]]] = {}
    for slot in sorted(slots):
        primary = slots[slot][0]
        if primary.name not in ranges:
            primaries.append(primary)
        runs = ranges.setdefault(primary.name, [])
        if runs and runs[-1][1] == slot - 1:
            runs[-1] = (runs[-1][0], slot)
        else:
            runs.append((slot, slot))
    return primaries, ranges
