"""``slotq status`` and ``slotq status --watch``: the fleet view, from a live worker's heartbeat, and
from heartbeats the worker's code builds from engine snapshots (speculative decoding's figures); on a
real 3-primary Valkey Cluster, the load of each shard, with the queue's marked."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as sync_redis
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from rich.console import Console

from slotq.jobs.cli.status_view import Status, render, watch
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol import catalog
from slotq.jobs.protocol.catalog import CatalogEntry
from slotq.jobs.protocol.keys import STREAM_BUCKETS, QueueKeys, partition_names
from slotq.jobs.protocol.schemas import JobKind
from slotq.jobs.protocol.shard_load import STREAM_SLOTS, ShardLoadReader
from slotq.jobs.protocol.streams import TTL, JobEntries, StreamAppender
from slotq.jobs.redis_cluster import LocalValkeyCluster
from tests.support.engine import engine_stats
from tests.support.jobs import SLOTQ_BIN, advertise, clean_env, job_request


async def test_watch_redraws_the_fleet_in_place(start_worker: Any, client: SlotqClient) -> None:
    await start_worker(slots=3, worker_name="view-1")
    console = Console(record=True, width=220, force_terminal=True)
    reads = 0

    async def read() -> Any:
        nonlocal reads
        reads += 1
        return Status(await client.queue_info())

    await watch(read, interval_s=0.05, console=console, rounds=3)
    assert reads == 3
    text = console.export_text()
    for expected in ("view-1", "ready", "busy / active / max slots", "0 / 3 / 3", "drafts kept", "degradation", "none",
                     "interactive", "oldest wait", "fleet: 0/3 active slots busy (3 max) across 1 workers, 1 ready"):
        assert expected in text, expected


def commands_served(conn: sync_redis.Redis) -> int:
    """Commands the server has run for anyone but this probe (its own INFO calls left out)."""
    stats = conn.info("commandstats")
    return sum(int(s["calls"]) for name, s in stats.items() if name != "cmdstat_info")


def test_status_watch_command_runs_until_interrupted(redis_url: str) -> None:
    conn = sync_redis.Redis.from_url(redis_url)
    conn.config_resetstat()
    proc = subprocess.Popen([str(SLOTQ_BIN), "status", "--watch", "--interval", "0.2"],
                            env=clean_env(redis_url=redis_url), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    # Off a terminal the view is drawn once, at the end; that it keeps reading the queue shows it is watching:
    # wait until the server's command count has grown on three separate looks (two rounds at least).
    counts = {commands_served(conn)}
    while len(counts) < 4:
        assert proc.poll() is None, proc.communicate()[0]
        counts.add(commands_served(conn))
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=20)
    conn.close()
    assert proc.returncode == 130, out
    assert b"queue slotq:queue" in out and b"Traceback" not in out


async def test_status_shows_each_workers_draft_source_and_acceptance(client: SlotqClient) -> None:
    await advertise(client.redis, "drafting", engine_stats(spec="ngram", spec_draft_tokens=40, spec_accepted_tokens=30))
    await advertise(client.redis, "plain", engine_stats(spec="off"))
    info = await client.queue_info()
    console = Console(record=True, width=220)
    console.print(render(info))
    rows = [[cell.strip() for cell in re.split("[│┃]", line)[1:-1]] for line in console.export_text().splitlines()
            if line.startswith(("│", "┃"))]
    header = next(row for row in rows if row[0] == "worker")
    drafts = {row[0]: row[header.index("drafts kept")] for row in rows if row[0] in ("drafting", "plain")}
    assert drafts == {"drafting": "ngram 75% (30/40)", "plain": "off"}
    workers = {w["id"]: w for w in info.model_dump(mode="json")["workers"]}       # `slotq status --json`
    assert workers["drafting"] | {"spec": "ngram", "spec_draft_tokens": 40, "spec_accepted_tokens": 30,
                                  "spec_acceptance": 0.75} == workers["drafting"]
    assert workers["plain"]["spec"] == "off" and workers["plain"]["spec_acceptance"] is None


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalValkeyCluster]:
    with LocalValkeyCluster(tmp_path / "cluster", primaries=3, replicas_per_primary=1) as cluster:
        yield cluster


async def _status(*args: str, redis_url: str, **settings: str) -> str:
    """``slotq status ARGS``'s stdout (it must succeed, and say nothing on stderr)."""
    proc = await asyncio.create_subprocess_exec(str(SLOTQ_BIN), "status", *args,
                                                env=clean_env(redis_url=redis_url, **settings),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    assert (proc.returncode, err) == (0, b""), err.decode(errors="replace")
    return out.decode()


@pytest.mark.parametrize("partitions", [1, 3])
async def test_status_names_the_keys_of_the_queues_demand(redis_url: str, partitions: int) -> None:
    """What KEDA's triggers must read (deploy/kubernetes): the jobs hash of each partition of the queue,
    in ``--json`` and under the lanes table."""
    keys = [QueueKeys(name, ("interactive", "bulk")).jobs for name in partition_names("slotq:queue", partitions)]
    shown = json.loads(await _status("--json", redis_url=redis_url, queue_partitions=str(partitions)))
    assert shown["demand_keys"] == keys
    table = await _status(redis_url=redis_url, queue_partitions=str(partitions))
    assert all(key in table for key in keys), table
    assert ("summed" in table) == (partitions > 1)


@pytest.mark.slow
async def test_status_on_a_cluster_shows_each_shards_load_and_marks_the_queues(cluster: LocalValkeyCluster) -> None:
    """Through the documented CLI on a real cluster (``SLOTQ_REDIS_URL=redis+cluster://...``): a row per
    primary, named by its port, with its replica and its keys; the shard of the queue's hash slot, the
    one its claim path loads, is marked, and only it; each holds 16 of the 48 stream buckets' slots,
    and the keys in the slots slotq uses (counted here by scanning every key) and its share of them.

    The job is claimed, not left waiting: the ages of the jobs waiting are read with a pipelined TIME,
    which a cluster client refuses (``RedisQueue.counts``, to be made cluster-correct with that module)."""
    client = await SlotqClient.connect(cluster.url)
    try:
        await client.enqueue(job_request())
        assert len(await client.queue.claim(1, "shard-view", 60_000)) == 1
        await advertise(client.redis, "shard-view", engine_stats())
        queue_key = client.queue.keys.jobs
        appender = StreamAppender(client.redis, writer_id="w", maxlen=100, ttl_s=60)     # streams in many buckets
        await appender.append("w:0", [JobEntries(f"streamed-{n}", "", TTL.LIVE, [{"k": "c"}]) for n in range(40)])
    finally:
        await client.close()
    assert queue_key == "{slotq:queue}:jobs"
    primaries = [node.port for node in cluster.nodes() if node.role == "primary"]
    with RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", port) for port in primaries]) as plain:
        queue_port, queue_slot = plain.get_node_from_key(queue_key).port, plain.keyslot(queue_key)
    keys, slotq_keys = {}, {}
    slotq_slots = {*STREAM_SLOTS, queue_slot}
    for port in primaries:
        with sync_redis.Redis(port=port) as node:
            keys[port] = node.dbsize()
            slotq_keys[port] = sum(key_slot(key) in slotq_slots for key in node.scan_iter(count=1000))

    rows = {int(match[1]): line for line in (await _status(redis_url=cluster.url)).splitlines()
            if (match := re.search(r"127\.0\.0\.1:(\d+)", line))}
    assert set(rows) == set(primaries), rows
    for port, line in rows.items():
        assert ("◀ slot" in line) == (port == queue_port), line
        assert f"16/{STREAM_BUCKETS}" in line, line
    assert f"◀ slot {queue_slot}" in rows[queue_port]

    shown = json.loads(await _status("--json", redis_url=cluster.url))
    assert shown["workers"][0]["id"] == "shard-view" and shown["running"] == 1
    shards = {int(shard["node"].rsplit(":", 1)[1]): shard for shard in shown["shards"]}
    assert set(shards) == set(primaries)
    assert {port: shard["keys"] for port, shard in shards.items()} == keys
    assert {port: shard["replicas"] for port, shard in shards.items()} == dict.fromkeys(primaries, 1)
    assert {port: shard["queue_slot"] for port, shard in shards.items() if shard["queue_slot"] is not None} == \
        {queue_port: queue_slot}
    assert {port: len(shard["stream_slots"]) for port, shard in shards.items()} == dict.fromkeys(primaries, 16)
    assert sorted(slot for shard in shards.values() for slot in shard["stream_slots"]) == sorted(STREAM_SLOTS)
    for shard in shards.values():
        assert all(any(first <= slot <= last for first, last in shard["slots"]) for slot in shard["stream_slots"])
    assert {port: shard["slotq_keys"] for port, shard in shards.items()} == slotq_keys
    assert sum(shard["slotq_keys_share"] for shard in shards.values()) == pytest.approx(1)
    ops_shares = [shard["ops_share"] for shard in shards.values()]
    assert ops_shares == [None] * 3 or sum(ops_shares) == pytest.approx(1), ops_shares
    ranges = sorted((first, last) for shard in shards.values() for first, last in shard["slots"])
    assert [first for first, _ in ranges] == [0] + [last + 1 for _, last in ranges[:-1]] and ranges[-1][1] == 16383


@pytest.mark.slow
async def test_each_read_of_the_shards_after_the_first_gives_their_cpu_share(cluster: LocalValkeyCluster) -> None:
    """``slotq status --watch`` keeps one reader: a shard's CPU is what it used since the look before."""
    client = await SlotqClient.connect(cluster.url)
    try:
        reader = ShardLoadReader(client.redis, client.queue.keys.jobs)
        assert {shard.cpu_share for shard in await reader.read()} == {None}
        shares = [shard.cpu_share for shard in await reader.read()]
    finally:
        await client.close()
    assert all(share is not None and share >= 0 for share in shares), shares


@pytest.mark.slow
async def test_each_models_queue_is_shown_on_the_shard_of_its_slot(cluster: LocalValkeyCluster) -> None:
    """A fleet of several models (their queues in the model catalog): each shard lists the queues whose
    hash slot it serves, the ones whose claim paths it carries (docs/cluster.md, "Several models")."""
    queues = [f"slotq:queue:model-{k}" for k in range(3)]
    client = await SlotqClient.connect(cluster.url)
    try:
        await catalog.CatalogPublisher("w1").beat(client.redis, [
            CatalogEntry(model=queue.rpartition(":")[2], queue=queue, kind=JobKind.GENERATION, fingerprint="f")
            for queue in queues], ttl_s=60, now=time.time())
        shards = await ShardLoadReader(client.redis, client.queue.keys.jobs).read()
    finally:
        await client.close()
    primaries = [node.port for node in cluster.nodes() if node.role == "primary"]
    with RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", port) for port in primaries]) as plain:
        expected = {f"127.0.0.1:{plain.get_node_from_key(f'{{{queue}}}:jobs').port}": queue for queue in queues}
    shown = {queue: shard.node for shard in shards for queue in shard.queues}
    assert sorted(shown) == queues
    assert all(shown[queue] == node for node, queue in expected.items())
    assert len(set(shown.values())) < 3         # model-1 and model-2 share a primary: what docs/cluster.md warns of
