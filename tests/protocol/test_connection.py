"""slotq's Redis connections (jobs/protocol/connection.py) on a real Valkey: a pooled connection is
checked for unread data without a socket read per command, and still never hands a stale reply
to the next command; commands are packed with hiredis into the bytes redis-py's own packer makes;
on a single Redis and under Sentinel, a reply is bounded past what a command waits on purpose (a
frozen server is a timeout, not a hang), a new connection's handshake by the connect timeout (a
producer's command on a frozen Redis fails within a stated bound), and a subscription is not. (The
same on a cluster: test_connection_cluster.py.)"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis._parsers import _AsyncHiredisParser
from redis.asyncio import Redis
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError
from redis.exceptions import TimeoutError as RedisTimeoutError

from slotq.jobs.protocol.connection import (
    READ_TIMEOUT_S,
    RetryWithin,
    _HiredisPacking,
    _ReadBound,
    _ReadBoundTCP,
    _SentinelConnection,
    connect,
    redis_settings,
)
from slotq.jobs.redis_server import EmbeddedRedis, valkey_binary
from tests.support.processes import frozen
from tests.support.redis_ha import SentinelCluster


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[Redis]:
    redis = await connect(redis_url, patient=False)
    try:
        yield redis
    finally:
        await redis.aclose()


@pytest.fixture
def socket_checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts redis-py's check that reads the socket under a zero timeout."""
    calls: list[int] = []
    original = _AsyncHiredisParser.can_read_destructive

    async def counted(self: _AsyncHiredisParser) -> Any:
        calls.append(1)
        return await original(self)

    monkeypatch.setattr(_AsyncHiredisParser, "can_read_destructive", counted)
    return calls


async def test_a_clean_connection_is_reused_without_reading_its_socket(client: Redis,
                                                                       socket_checks: list[int]) -> None:
    await client.set("conn:k", "v")
    socket_checks.clear()
    for _ in range(20):
        assert await client.get("conn:k") == b"v"
    assert socket_checks == []
    assert len(client.connection_pool._available_connections) == 1       # the one connection, reused


async def test_a_cancelled_commands_late_reply_never_answers_the_next_command(
        client: Redis, redis_url: str, socket_checks: list[int]) -> None:
    other = await connect(redis_url, patient=False)
    try:
        await client.set("conn:k", "v")
        await client.delete("conn:list")
        blocked = asyncio.create_task(client.blpop(["conn:list"], timeout=10))
        await asyncio.sleep(0.1)                     # the BLPOP is sent and blocks in Valkey
        blocked.cancel()                             # its connection goes back to the pool, reply unread
        await asyncio.gather(blocked, return_exceptions=True)
        await other.rpush("conn:list", "late")       # now Valkey answers the cancelled BLPOP
        await asyncio.sleep(0.1)                     # and the event loop has read that answer
        socket_checks.clear()
        assert await client.get("conn:k") == b"v"   # not [b"conn:list", b"late"]
        assert socket_checks                         # the unread reply sent it to redis-py's check
    finally:
        await other.aclose()


async def test_a_connection_the_server_closed_is_replaced(client: Redis, redis_url: str) -> None:
    other = await connect(redis_url, patient=False)
    try:
        await client.set("conn:k", "v")
        client_id = await client.client_id()
        assert await other.client_kill_filter(_id=client_id) == 1
        await asyncio.sleep(0.1)                     # the close has reached the client's stream
        assert await client.get("conn:k") == b"v"
        assert await client.client_id() != client_id
    finally:
        await other.aclose()


_ARGUMENT = st.one_of(st.text(), st.binary(), st.integers(), st.floats(allow_nan=False))


@given(name=st.sampled_from(["SET", "EVALSHA", "CONFIG GET", b"CLIENT LIST"]), args=st.lists(_ARGUMENT, max_size=12))
def test_commands_are_packed_into_the_same_bytes_as_redis_pys_packer(name: str | bytes, args: list[Any]) -> None:
    ours = _ReadBoundTCP().pack_command(name, *args)
    assert b"".join(ours) == b"".join(Connection().pack_command(name, *args))


@pytest.mark.parametrize("value", [None, True, bytearray(b"x")])
def test_a_value_no_packer_takes_raises_redis_pys_data_error(value: object) -> None:
    with pytest.raises(DataError, match="bytes, str, int or float"):
        _ReadBoundTCP().pack_command("SET", "key", value)      # type: ignore[arg-type]


async def test_every_kind_of_connection_packs_with_hiredis(client: Redis, redis_url: str) -> None:
    """A single Redis's pool packs with hiredis (a script call with an entry's worth of arguments
    round-trips through the real server), and so do Sentinel and cluster connections."""
    assert issubclass(client.connection_pool.connection_class, _HiredisPacking)
    echoed = await client.eval("return ARGV", 0, "text é", b"\x00\xff", 7, 1.5)
    assert echoed == ["text é".encode(), b"\x00\xff", b"7", b"1.5"]
    assert issubclass(_SentinelConnection, _HiredisPacking) and issubclass(_ReadBound, _HiredisPacking)


@dataclass
class Served:
    """A server of the test's own, to freeze: its URL and the pid of the primary it reaches."""

    url: str
    primary_pid: int


@pytest.fixture
def single_redis(tmp_path: Path) -> Iterator[Served]:
    """A single Valkey of the test's own (redis://)."""
    server = EmbeddedRedis(tmp_path / "single", port=0, fsync="no")
    server.start()
    try:
        assert server.pid is not None
        yield Served(server.url, server.pid)
    finally:
        server.stop()


@pytest.fixture(params=["single", "sentinel"])
def served(request: pytest.FixtureRequest) -> Served:
    """A single Valkey (redis://), or a primary, its replica and three sentinels (redis+sentinel://)."""
    if request.param == "sentinel":
        sentinels: SentinelCluster = request.getfixturevalue("sentinel_cluster")
        return Served(sentinels.url, sentinels.procs["primary"].pid)
    single: Served = request.getfixturevalue("single_redis")
    return single


@pytest.mark.slow
async def test_waits_longer_than_the_read_bound_are_not_cut(served: Served) -> None:
    """A reply must come within READ_TIMEOUT_S past what its command waits on purpose: a BLPOP (a worker's
    wait for work), an XREAD BLOCK (a stream reader's), a pipeline's WAIT (an enqueue's wait for replicas;
    here for more than there are) and a subscription's next message, each longer than the bound, all end
    as their server ends them, not as a read timeout."""
    redis = await connect(served.url, patient=False)
    wait_s = READ_TIMEOUT_S + 1
    try:
        async def waited() -> list[Any]:
            async with redis.pipeline(transaction=False) as pipe:
                pipe.set("long:k", "v")
                pipe.wait(5, int(wait_s * 1000))
                return await pipe.execute()

        async def heard() -> Any:
            async with redis.pubsub() as pubsub:
                await pubsub.subscribe("slotq:test:quiet")
                await asyncio.sleep(wait_s)
                await redis.publish("slotq:test:quiet", "late")
                async for message in pubsub.listen():
                    if message["type"] == "message":
                        return message["data"]

        started = time.monotonic()
        popped, read, (was_set, replicas), message = await asyncio.gather(
            redis.blpop(["long:list"], timeout=wait_s), redis.xread({"long:stream": "$"}, block=int(wait_s * 1000)),
            waited(), heard())
        assert (popped, read, was_set, message) == (None, [], True, b"late")
        assert replicas < 5
        assert time.monotonic() - started >= wait_s           # they did wait past the bound
    finally:
        await redis.aclose()


@pytest.mark.fault
async def test_a_frozen_single_redis_is_a_timeout_not_a_hang(single_redis: Served) -> None:
    """A Redis that stops answering without closing its connections (SIGSTOP; a VM pause or a network
    black hole does the same) no longer holds a command until TCP gives up. On an open connection the
    reply is overdue after READ_TIMEOUT_S, the connection is closed, and the worker's retry sends the
    command again on a new one, which the server answers once it runs again. A command that needs a new
    connection fails with the timeout of the connection's handshake, after the connect timeout rather
    than READ_TIMEOUT_S (redis-py opens a pooled connection outside the command's retry). A subscription
    on the same server waits through the freeze on its connection and hears what is published after it."""
    redis = await connect(single_redis.url, patient=True)
    try:
        async with redis.pubsub() as pubsub:
            await pubsub.subscribe("slotq:test:frozen")
            assert (await pubsub.get_message(timeout=5) or {}).get("type") == "subscribe"
            listener = pubsub.connection
            before = await redis.client_id()                  # the pool's one open connection, free again

            async def timed_out() -> float:
                started = time.monotonic()
                with pytest.raises(RedisTimeoutError):
                    await redis.get("frozen:k")               # the open connection is taken: a new one
                return time.monotonic() - started

            started = time.monotonic()
            with frozen(single_redis.primary_pid):
                asked = asyncio.create_task(redis.client_id())
                await asyncio.sleep(0.1)                      # it holds the open connection
                async with asyncio.timeout(30):               # a hang guard
                    fresh_s = await timed_out()
                await asyncio.sleep(READ_TIMEOUT_S + 1 - (time.monotonic() - started))   # the first read timed out
            async with asyncio.timeout(30):
                after = await asked
            assert after != before                            # answered on a new connection, not the first
            assert time.monotonic() - started >= READ_TIMEOUT_S
            assert redis_settings(single_redis.url).conn_timeout <= fresh_s < READ_TIMEOUT_S     # the handshake's bound
            await redis.publish("slotq:test:frozen", "heard")
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
            assert message is not None and message["data"] == b"heard"
            assert pubsub.connection is listener               # the same subscription, never cut
    finally:
        await redis.aclose()


@pytest.mark.fault
async def test_a_producers_command_on_a_frozen_single_redis_fails_within_its_bound(single_redis: Served) -> None:
    """A producer's command on an open connection to a Redis frozen for good (SIGSTOP): its reply is overdue
    after READ_TIMEOUT_S, its retries start only within 0.8 x connect_timeout_s of that first failure, and
    each retry's new connection waits for its handshake only the connect timeout, so the timeout reaches
    the caller within READ_TIMEOUT_S + 0.8 x connect_timeout_s + one handshake's bound (RetryWithin). While
    the retries were counted (8 at 5 s) it took 49.7 s at the default 5 s; while each handshake also waited
    out the read bound, 84.9 s."""
    connect_timeout_s = 5.0
    settings = redis_settings(single_redis.url, patient=False, connect_timeout_s=connect_timeout_s)
    bound_s = READ_TIMEOUT_S + 0.8 * connect_timeout_s + settings.conn_timeout
    redis = await connect(single_redis.url, patient=False, connect_timeout_s=connect_timeout_s)
    try:
        await redis.set("frozen:k", "v")                      # the pool's connection is open
        with frozen(single_redis.primary_pid):
            started = time.monotonic()
            async with asyncio.timeout(120):                  # a hang guard
                with pytest.raises(RedisTimeoutError):
                    await redis.get("frozen:k")
            failed_s = time.monotonic() - started
        print(f"producer, frozen single Redis: the command failed after {failed_s:.1f} s (bound {bound_s:.1f} s)")
        assert READ_TIMEOUT_S <= failed_s < bound_s + 5      # the margin: a loaded machine's slow event loop
    finally:
        await redis.aclose()


@pytest.mark.fault
async def test_a_single_redis_that_wakes_within_a_producers_retries_answers_them(single_redis: Served) -> None:
    """The same Redis frozen under a producer's command, and woken after the first reply was overdue, while
    the retries open new connections: the command is answered there rather than failed by its bounds."""
    redis = await connect(single_redis.url, patient=False)   # retries ~40 s past the first reply's bound
    try:
        await redis.set("frozen:k", "v")
        with frozen(single_redis.primary_pid):
            asked = asyncio.create_task(redis.get("frozen:k"))
            await asyncio.sleep(READ_TIMEOUT_S + 1)           # the reply on the open connection timed out
            assert not asked.done()
        async with asyncio.timeout(30):                       # a hang guard
            assert await asked == b"v"
    finally:
        await redis.aclose()


@pytest.mark.fault
async def test_under_sentinel_a_frozen_primarys_command_goes_on_at_the_promoted_replica(
        sentinel_cluster: SentinelCluster) -> None:
    """A primary frozen under a worker's command (SIGSTOP): the sentinels promote its replica, the reply
    on the frozen primary is overdue after READ_TIMEOUT_S, and the retry, asking the sentinels again,
    sends the command to the promoted replica. Without the bound it waited on the frozen primary for ever."""
    redis = await connect(sentinel_cluster.url, patient=True)
    try:
        await redis.set("frozen:n", 0)
        assert await redis.wait(1, 5000) == 1                  # the replica holds it
        started = time.monotonic()
        with frozen(sentinel_cluster.procs["primary"].pid):
            async with asyncio.timeout(90):                   # a hang guard
                incremented = await redis.incr("frozen:n")
            went_on_s = time.monotonic() - started
            assert sentinel_cluster.primary_address()[1] == sentinel_cluster.replica_port
        assert incremented == 1
        assert went_on_s >= READ_TIMEOUT_S
        print(f"sentinel, frozen primary: the command went on at the promoted replica after {went_on_s:.1f} s")
    finally:
        await redis.aclose()


@pytest.mark.fault
async def test_a_frozen_sentinel_is_passed_over_for_the_next(sentinel_cluster: SentinelCluster) -> None:
    """The first sentinel of the URL frozen (SIGSTOP): a new connection to it gets no answer to its
    handshake, and after the connect timeout it asks the next sentinel instead of waiting for ever (or,
    before the sentinels' handshake had a bound of its own, for READ_TIMEOUT_S: 10 s per connection)."""
    connect_timeout_s = redis_settings(sentinel_cluster.url, patient=True).conn_timeout
    with frozen(sentinel_cluster.procs["sentinel0"].pid):
        started = time.monotonic()
        async with asyncio.timeout(60):                       # a hang guard
            redis = await connect(sentinel_cluster.url, patient=True)
        try:
            assert await redis.set("sentinel:k", "v")
            passed_over_s = time.monotonic() - started
            print(f"a frozen sentinel was passed over after {passed_over_s:.1f} s")
            assert 0.9 * connect_timeout_s <= passed_over_s < READ_TIMEOUT_S   # it did ask the frozen one first
        finally:
            await redis.aclose()


async def test_a_unix_socket_url_is_bounded_on_its_socket(tmp_path: Path) -> None:
    """unix:// keeps redis-py's Unix socket connection, with the bound on replies put in front of it: a
    blocking read's reply is bounded past its block time there too."""
    socket = tmp_path / "valkey.sock"
    server = subprocess.Popen([str(valkey_binary()), "--port", "0", "--unixsocket", str(socket), "--save", "",
                               "--appendonly", "no"], cwd=tmp_path, stdout=subprocess.DEVNULL)
    try:
        async with asyncio.timeout(30):
            while not socket.exists():
                await asyncio.sleep(0.05)
        redis = await connect(f"unix://{socket}", patient=False)
        try:
            wait_s = 0.5
            assert await redis.blpop(["unix:list"], timeout=wait_s) is None
            connection = redis.connection_pool._available_connections[0]
            assert isinstance(connection, UnixDomainSocketConnection) and connection.path == str(socket)
            assert connection.socket_timeout == wait_s + READ_TIMEOUT_S     # the BLPOP's reply was bounded so
        finally:
            await redis.aclose()
    finally:
        server.terminate()
        server.wait(10)


async def test_retries_end_within_their_time_from_the_first_failure_not_after_a_count() -> None:
    """RetryWithin, the policy alone: a command whose every try takes 0.2 s to fail is tried again only
    while the backoff ends within ``within_s`` of its first failure, so it fails about one try past that
    however long each try takes, where a count of retries would multiply the try's time."""
    tries = 0

    async def fails_slowly() -> None:
        nonlocal tries
        tries += 1
        await asyncio.sleep(0.2)
        raise RedisConnectionError("refused")

    async def no_cleanup(error: Exception) -> None:
        pass

    policy = RetryWithin(ExponentialBackoff(cap=1.0, base=0.05), within_s=0.6)   # backoffs 0.1, 0.2, 0.4 s
    started = time.monotonic()
    with pytest.raises(RedisConnectionError):
        await policy.call_with_retry(fails_slowly, no_cleanup)
    took_s = time.monotonic() - started
    assert tries == 3                    # retries end 0.1 and 0.5 s past the first failure; a third, 1.1 > 0.6
    assert 0.9 <= took_s < 0.2 + 0.6 + 0.2 + 0.5   # first try, the window, the last try, a busy machine's margin

    answers = iter([RedisConnectionError("refused"), RedisConnectionError("refused"), None])

    async def answers_third() -> str:
        error = next(answers)
        if error is not None:
            raise error
        return "PONG"

    assert await policy.call_with_retry(answers_third, no_cleanup) == "PONG"   # a fresh window per command
