"""A Valkey Cluster's faults met through a network: every node behind a proxy whose port it announces
(tests/support/proxied_cluster.py), so the workers and the producer reach the cluster, and a replica
it promotes, the way clients on other machines do. The chaos run on such a cluster is in
test_chaos.py."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from slotq.jobs.producer.client import JobHandle, SlotqClient
from slotq.jobs.protocol.keys import worker_key
from slotq.jobs.protocol.schemas import JobResult, StreamEntry
from slotq.jobs.redis_cluster import LocalValkeyCluster
from slotq.jobs.worker.worker import EXIT_STOP_OVERDUE
from tests.support.faults import Fleet, check_job, worker_env
from tests.support.jobs import job_request, raw_entries, settings_for
from tests.support.proxied_cluster import ProxiedCluster

pytestmark = pytest.mark.fault

JOBS = 16                   # twice the fleet's 8 slots: the kill finds jobs running and jobs waiting
TOKENS = 500


async def test_the_queues_primary_killed_mid_stream_fails_over_and_nothing_is_lost(
        proxied_cluster: ProxiedCluster, tiny_model_path: Path, tmp_path: Path) -> None:
    """kill -9 of the primary that holds the queue's slot (claims, job records, results and a third
    of the stream buckets) while jobs stream: its replica is promoted, the workers and the producer's
    followers find it through its proxy, and every job completes once, its followers given exactly
    what its stream holds, stream text == result text."""
    url = proxied_cluster.url
    client = await SlotqClient.connect(url, settings_for(url))
    fleet = Fleet(client, worker_env(url, tiny_model_path, slots=4, ctx=1024), tmp_path)
    following: list[asyncio.Task[tuple[list[StreamEntry], JobResult]]] = []
    try:
        names = [fleet.spawn().name for _ in range(2)]
        await fleet.wait_ready(*names)
        proxy_ports = {proxy.port for proxy in proxied_cluster.proxies}
        assert {int(node.port) for node in client.redis.get_nodes()} <= proxy_ports   # type: ignore[attr-defined]

        handles = [await client.enqueue(job_request(f"failover {i}", max_tokens=TOKENS)) for i in range(JOBS)]

        streaming: set[str] = set()        # jobs whose first entry reached their follower, not yet done
        started = asyncio.Condition()

        async def follow(handle: JobHandle) -> tuple[list[StreamEntry], JobResult]:
            entries = []
            async for entry in handle.stream():
                if not entries:
                    async with started:
                        streaming.add(handle.id)
                        started.notify_all()
                entries.append(entry)
            streaming.discard(handle.id)
            return entries, await handle.result(timeout=120)

        following += [asyncio.create_task(follow(handle)) for handle in handles]
        async with asyncio.timeout(60), started:             # mid-stream: half the fleet's slots streaming
            await started.wait_for(lambda: len(streaming) >= 4)
        killed = proxied_cluster.queue_primary(client)
        running = len(streaming)
        failover_s = await proxied_cluster.fail_over_quietly(fleet, killed)
        async with asyncio.timeout(150):
            outcomes = await asyncio.gather(*following)

        assert running > 0
        assert proxied_cluster.queue_primary(client) != killed               # the replica serves the queue now
        for followed, result in outcomes:
            assert followed and followed[-1].final, (result.id, "the stream ended before its final entry")
            stored = await raw_entries(client, result.id)
            assert [e.id for e in followed] == [e.id for e in stored], (result.id, "the follower missed or repeated")
            await check_job(client, result, max_tokens=TOKENS)
        assert sorted(fleet.alive()) == sorted(names), fleet.logs()          # no worker died of the failover
        info = await client.queue_info()
        assert (info.queued, info.running, info.dead_letters) == (0, 0, 0), info
        print(f"cluster failover through proxies: the queue's primary killed with {running} jobs "
              f"streaming, replica promoted after {failover_s:.1f} s; "
              f"attempts {sorted(r.attempts for _, r in outcomes)}")
    finally:
        for task in following:
            task.cancel()
        fleet.stop_all()
        await client.close()


async def test_a_stopping_worker_does_not_wait_for_a_primary_that_never_answers(
        tiny_model_path: Path, tmp_path: Path) -> None:
    """An idle worker SIGTERMed while the primary that holds its registry record is frozen (SIGSTOP: the
    connection stays open and no reply comes, as from a node that died without closing it) exits at
    once with code 0: its farewell writes (registry, catalog, the queue's serving record) are bounded,
    and their records expire with the heartbeat. Found after failovers, where such a farewell's reply
    never came and the worker ran to its exit bound and exited with code 70."""
    with LocalValkeyCluster(tmp_path / "cluster", primaries=3, fsync="always") as cluster:
        client = await SlotqClient.connect(cluster.url, settings_for(cluster.url))
        fleet = Fleet(client, worker_env(cluster.url, tiny_model_path, slots=2, drain_grace_s=1), tmp_path)
        frozen: int | None = None
        try:
            worker = fleet.spawn()
            await fleet.wait_ready(worker.name)
            port = int(client.redis.get_node_from_key(worker_key(worker.name)).port)  # type: ignore[attr-defined]
            frozen = next(node.pid for node in cluster.nodes() if node.port == port)
            os.kill(frozen, signal.SIGSTOP)
            worker.proc.send_signal(signal.SIGTERM)
            # the exit bound is drain_grace_s + EXIT_MARGIN_S = 31 s: waiting longer tells a clean stop from it
            code = await asyncio.to_thread(worker.proc.wait, 45)
            assert code != EXIT_STOP_OVERDUE, fleet.logs()
            assert code == 0, fleet.logs()
            assert "they expire with the heartbeat" in worker.log.read_text()
        finally:
            if frozen is not None:
                os.kill(frozen, signal.SIGCONT)
            fleet.stop_all()
            await client.close()
