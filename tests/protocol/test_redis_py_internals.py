"""Pins the private internals of redis-py (and asyncio) that jobs/protocol/connection.py relies on
to the installed versions' behaviour, on a real connection to a real Valkey. An upgrade that moves
or changes one fails here, with a message naming the attribute, before the ready check
(``_known_ready``) silently falls back to a socket read per command, or trusts a stale buffer.

What connection.py uses, and why each is pinned:

* ``redis._parsers._AsyncHiredisParser``: the parser arq's pools install; only it is judged;
* ``connection._parser``: where a connection keeps its parser;
* ``parser._connected``: True exactly while the parser is attached to an open connection;
* ``parser._stream``: the connection's ``asyncio.StreamReader``, fed by the event loop;
* ``parser._reader``: hiredis's ``Reader``, whose ``has_data()`` says a reply is half parsed;
* ``StreamReader._buffer`` (asyncio): the bytes read off the socket and not yet consumed -- what
  is unread is there, since the event loop reads a socket as soon as it is readable;
* ``ConnectionPool.get_connection`` calls ``ensure_connection`` (overridden by the quick ready
  check and the Sentinel pool), and Sentinel's pool inherits that ``get_connection``;
* ``SentinelManagedConnection.connect`` retries through the connection's ``retry`` attribute
  (swapped for one try by ``_SentinelConnection``).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator

import hiredis
import pytest
import redis
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.asyncio.sentinel import SentinelConnectionPool, SentinelManagedConnection

from slotq.jobs.protocol.connection import _known_ready, _QuickReadyCheck, connect

REDIS_PY = f"redis-py {redis.__version__}"


def _relied_on(what: str) -> str:
    return f"{REDIS_PY}: {what}; jobs/protocol/connection.py relies on it: check it against this version"


@pytest.fixture
async def connection(redis_url: str) -> AsyncIterator[AbstractConnection]:
    """One open connection of a producer's pool, as connect() builds it."""
    client: Redis = await connect(redis_url, patient=False)
    pool = client.connection_pool
    conn = await pool.get_connection()
    try:
        yield conn
    finally:
        await pool.release(conn)
        await client.aclose()


def test_the_parser_is_hiredis_and_kept_as_connection_parser(connection: AbstractConnection) -> None:
    try:
        from redis._parsers import _AsyncHiredisParser
    except ImportError:
        pytest.fail(_relied_on("redis._parsers._AsyncHiredisParser is gone"))
    parser = getattr(connection, "_parser", None)
    assert isinstance(parser, _AsyncHiredisParser), _relied_on(
        f"connection._parser is {type(parser).__name__}, not _AsyncHiredisParser")


def test_an_open_parser_holds_its_stream_and_hiredis_reader(connection: AbstractConnection) -> None:
    parser = connection._parser
    assert getattr(parser, "_connected", None) is True, _relied_on("parser._connected is not True while connected")
    assert isinstance(getattr(parser, "_stream", None), asyncio.StreamReader), _relied_on(
        "parser._stream is not the connection's asyncio.StreamReader")
    reader = getattr(parser, "_reader", None)
    assert isinstance(reader, hiredis.Reader), _relied_on("parser._reader is not a hiredis.Reader")
    assert callable(getattr(reader, "has_data", None)), _relied_on("hiredis.Reader.has_data() is gone")
    stream = parser._stream    # type: ignore[attr-defined]  # _AsyncHiredisParser's, asserted just above
    assert isinstance(getattr(stream, "_buffer", None), bytearray), _relied_on(
        "asyncio.StreamReader._buffer is not a bytearray of the bytes read and not consumed")


async def test_an_unread_reply_is_in_the_stream_buffer_until_read(connection: AbstractConnection) -> None:
    assert _known_ready(connection), _relied_on("a connection with nothing unread is not judged ready")
    await connection.send_command("PING")
    stream = connection._parser._stream           # type: ignore[attr-defined]  # the internal pinned here
    async with asyncio.timeout(10):
        while not stream._buffer:                 # the event loop reads the reply into the buffer
            await asyncio.sleep(0.005)
    assert not _known_ready(connection), _relied_on(
        "StreamReader._buffer holds the unread reply, yet the connection is judged ready")
    assert await connection.read_response() in (b"PONG", "PONG", True)
    assert not stream._buffer, _relied_on("StreamReader._buffer still holds a reply that was read")
    assert not connection._parser._reader.has_data(), _relied_on(  # type: ignore[attr-defined]  # pinned here
        "hiredis.Reader.has_data() says data is left after a whole reply was read")
    assert _known_ready(connection)


async def test_a_disconnected_parser_says_so(connection: AbstractConnection) -> None:
    parser = connection._parser
    await connection.disconnect()
    assert getattr(parser, "_connected", None) is False, _relied_on("parser._connected is not False after disconnect")
    assert not _known_ready(connection)


async def test_the_pool_checks_each_connection_it_hands_out_through_ensure_connection(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[AbstractConnection] = []
    original = _QuickReadyCheck.ensure_connection

    async def counted(self: _QuickReadyCheck, connection: AbstractConnection) -> None:
        checked.append(connection)
        await original(self, connection)

    monkeypatch.setattr(_QuickReadyCheck, "ensure_connection", counted)
    client: Redis = await connect(redis_url, patient=False)
    try:
        checked.clear()
        await client.ping()
        assert checked, _relied_on("ConnectionPool.get_connection no longer calls ensure_connection")
    finally:
        await client.aclose()
    assert SentinelConnectionPool.get_connection is ConnectionPool.get_connection, _relied_on(
        "SentinelConnectionPool overrides get_connection (the Sentinel pool's ensure_connection may be bypassed)")


def test_a_sentinel_connection_connects_through_its_retry_attribute() -> None:
    source = inspect.getsource(SentinelManagedConnection.connect)
    assert "self.retry.call_with_retry" in source, _relied_on(
        "SentinelManagedConnection.connect no longer retries through self.retry")
