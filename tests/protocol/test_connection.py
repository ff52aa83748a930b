"""slotq's Redis connections (jobs/protocol/connection.py) on a real Valkey: a pooled connection is
checked for unread data without a socket read per command, and still never hands a stale reply
to the next command; commands are packed with hiredis into the bytes redis-py's own packer makes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis._parsers import _AsyncHiredisParser
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.exceptions import DataError

from slotq.jobs.protocol.connection import _HiredisPacking, _ReadBound, _SentinelConnection, connect


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
    ours = _HiredisPacking().pack_command(name, *args)
    assert b"".join(ours) == b"".join(Connection().pack_command(name, *args))


@pytest.mark.parametrize("value", [None, True, bytearray(b"x")])
def test_a_value_no_packer_takes_raises_redis_pys_data_error(value: object) -> None:
    with pytest.raises(DataError, match="bytes, str, int or float"):
        _HiredisPacking().pack_command("SET", "key", value)      # type: ignore[arg-type]


async def test_every_kind_of_connection_packs_with_hiredis(client: Redis, redis_url: str) -> None:
    """A single Redis's pool packs with hiredis (a script call with an entry's worth of arguments
    round-trips through the real server), and so do Sentinel and cluster connections."""
    assert issubclass(client.connection_pool.connection_class, _HiredisPacking)
    echoed = await client.eval("return ARGV", 0, "text é", b"\x00\xff", 7, 1.5)
    assert echoed == ["text é".encode(), b"\x00\xff", b"7", b"1.5"]
    assert issubclass(_SentinelConnection, _HiredisPacking) and issubclass(_ReadBound, _HiredisPacking)
