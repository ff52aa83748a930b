"""Connecting to Redis: patient for workers, bounded for producers (no engine import here, so a web
app that only enqueues never loads llama.cpp).

Every command retries with exponential backoff on connection errors, so a Redis restart or
failover is a pause, not an exception. A worker waits it out for about 30 s per command and keeps
trying to make its first connection. A producer is bounded by ``redis_connect_timeout_s``: a web
request or ``slotq enqueue`` against a Redis that is not there fails within that time with
:class:`~slotq.jobs.errors.RedisUnavailable`, which names the URL (password hidden) and the cause.

URLs (``SLOTQ_REDIS_URL``):

* ``redis://[[user]:password@]host[:port][/db]``, ``rediss://...`` for TLS; the server's certificate
  is checked against ``SLOTQ_REDIS_CA_FILE`` (or the system's CAs);
* ``redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]`` (and
  ``rediss+sentinel://``): Redis Sentinel. The hosts are sentinels (port 26379 by default); each
  new connection asks them for the current primary of ``service``, so after a failover the
  retried commands reach the new primary. The password is the primary's; sentinels that need
  their own take ``?sentinel_password=...``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse, urlsplit

from redis._parsers import _AsyncHiredisParser
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection, ConnectionPool, SSLConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from slotq.jobs.errors import RedisUnavailable

log = logging.getLogger(__name__)

SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}     # scheme -> TLS
SENTINEL_PORT = 26379


def redacted(url: str) -> str:
    """The URL with any password replaced by ``***`` (for messages and logs)."""
    url = re.sub(r"(sentinel_password=)[^&]*", r"\1***", url)
    return re.sub(r"^([a-z+]+://[^:@/]*):[^@/]*@", r"\1:***@", url)


@dataclass(frozen=True)
class SentinelUrl:
    sentinels: list[tuple[str, int]]
    service: str
    db: int
    username: str | None
    password: str | None
    sentinel_password: str | None
    tls: bool


@dataclass
class RedisSettings:
    """How to reach Redis and how patiently (:func:`redis_settings`). The fields are those of arq's
    ``RedisSettings`` that slotq sets, under arq's names (slotq built its clients with arq's
    helpers until producers stopped importing arq; the arq baseline benchmark hands them to arq)."""

    host: str | list[tuple[str, int]] = "localhost"     # the sentinels' addresses when ``sentinel``
    port: int = 6379
    unix_socket_path: str | None = None
    database: int = 0
    username: str | None = None
    password: str | None = None
    ssl: bool = False
    ssl_cert_reqs: str = "required"
    ssl_ca_certs: str | None = None
    conn_timeout: int = 1                   # s, each connect
    conn_retries: int = 5                   # retries of the first connection ...
    conn_retry_delay: int = 1               # ... this many s apart
    sentinel: bool = False
    sentinel_master: str = "mymaster"
    retry_on_error: list[type[Exception]] | None = None
    retry: Retry | None = None              # each command's retries

    @classmethod
    def from_url(cls, url: str) -> RedisSettings:
        """A redis://, rediss:// or unix:// URL, read as arq's ``RedisSettings.from_dsn`` reads it
        (the database from ``?db=`` or the path)."""
        parts = urlparse(url)
        if parts.scheme not in {"redis", "rediss", "unix"}:
            raise ValueError("invalid DSN scheme")
        query_db = parse_qs(parts.query).get("db")
        if query_db:
            database = int(query_db[0])
        elif parts.scheme != "unix":
            database = int(parts.path.lstrip("/")) if parts.path else 0
        else:
            database = 0
        return cls(host=parts.hostname or "localhost", port=parts.port or 6379, ssl=parts.scheme == "rediss",
                   username=parts.username, password=parts.password, database=database,
                   unix_socket_path=parts.path if parts.scheme == "unix" else None)


def parse_sentinel_url(url: str) -> SentinelUrl | None:
    """The parts of a ``redis+sentinel://`` URL; None for any other scheme. Raises ValueError,
    naming the URL (password hidden), when it is malformed."""
    parts = urlsplit(url)
    if parts.scheme not in SENTINEL_SCHEMES:
        return None
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":") if userinfo else ("", "", "")
    sentinels = []
    for host in filter(None, hosts.split(",")):
        name, _, port = host.rpartition(":") if ":" in host else (host, "", "")
        if not name or (port and not port.isdigit()):
            raise ValueError(f"{redacted(url)}: bad sentinel address {host!r} (want host[:port])")
        sentinels.append((name, int(port) if port else SENTINEL_PORT))
    path = [p for p in parts.path.split("/") if p]
    if not sentinels or not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"{redacted(url)}: want {parts.scheme}://[[user]:password@]host[:port][,host[:port]...]"
                         "/service[/db]")
    query = parse_qs(parts.query)
    return SentinelUrl(sentinels=sentinels, service=unquote(path[0]), db=int(path[1]) if len(path) == 2 else 0,
                       username=unquote(username) or None, password=unquote(password) or None,
                       sentinel_password=query.get("sentinel_password", [None])[0],
                       tls=SENTINEL_SCHEMES[parts.scheme])


def redis_settings(url: str, *, patient: bool = True, connect_timeout_s: float = 5.0,
                   ca_file: Path | None = None) -> RedisSettings:
    """Settings from a redis://, rediss:// or redis+sentinel:// URL (password and TLS included;
    ``ca_file`` verifies a TLS server's certificate).

    ``patient`` (workers): each command retries about 30 s (0.1 s doubling to 2 s), and the first
    connection is retried for 30 s. Otherwise (producers) both stay within ``connect_timeout_s``.
    """
    sentinel = parse_sentinel_url(url)
    if sentinel is None:
        settings = RedisSettings.from_url(url)
    else:
        settings = RedisSettings(host=sentinel.sentinels, sentinel=True, sentinel_master=sentinel.service,
                                 database=sentinel.db, username=sentinel.username, password=sentinel.password,
                                 ssl=sentinel.tls)
    if ca_file is not None:
        settings.ssl_ca_certs = str(ca_file)
    settings.retry_on_error = [RedisConnectionError, RedisTimeoutError, ConnectionError, OSError]
    if patient:
        settings.conn_retries = 30
        settings.conn_retry_delay = 1
        settings.retry = Retry(ExponentialBackoff(cap=2.0, base=0.1), retries=20)
    else:
        settings.conn_timeout = max(1, math.ceil(min(connect_timeout_s, 5)))
        settings.conn_retries = 0
        # Retries back off within 80% of the bound, so the last error (e.g. "Connection refused") is
        # what the caller sees rather than a bare timeout.
        settings.retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=_retries_within(0.8 * connect_timeout_s))
    return settings


def _retries_within(seconds: float, base: float = 0.05, cap: float = 1.0) -> int:
    """How many retries of the producer's backoff fit in ``seconds``."""
    total, n = 0.0, 0
    while n < 50:
        total += min(cap, base * 2 ** n)
        if total > seconds:
            break
        n += 1
    return n


async def connect(url: str, *, patient: bool, connect_timeout_s: float = 5.0, ca_file: Path | None = None) -> Redis:
    """A connection pool on ``url`` that answered PING. Raises RedisUnavailable when a producer's
    bound runs out (a worker keeps trying for ~30 s first)."""
    try:
        settings = redis_settings(url, patient=patient, connect_timeout_s=connect_timeout_s, ca_file=ca_file)
    except ValueError as exc:
        raise RedisUnavailable(f"SLOTQ_REDIS_URL {redacted(url)} is not a Redis URL ({exc}); want redis://, "
                               "rediss:// or redis+sentinel://") from None
    sentinel = parse_sentinel_url(url)

    async def make() -> Redis:
        if sentinel is not None:
            return await _sentinel_pool(settings, sentinel.sentinel_password)
        return await _with_quick_ready_check(await _pool(settings))

    try:
        if patient:
            return await make()
        async with asyncio.timeout(connect_timeout_s + settings.conn_timeout):
            return await make()
    except (RedisError, OSError, TimeoutError) as exc:
        cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if isinstance(exc, TimeoutError):
            cause = f"no answer within {connect_timeout_s:g} s"
        raise RedisUnavailable(
            f"cannot reach Redis at {redacted(url)} ({cause}); check SLOTQ_REDIS_URL, or start one with `slotq redis`"
        ) from exc


async def _pool(settings: RedisSettings) -> Redis:
    """A client of ``settings``' server that answered PING, its first connection retried
    ``conn_retries`` times ``conn_retry_delay`` apart (as arq's ``create_pool`` made them)."""
    assert isinstance(settings.host, str), "sentinels are asked through _sentinel_pool"
    attempt = 0
    while True:
        redis = Redis(host=settings.host, port=settings.port, unix_socket_path=settings.unix_socket_path,
                      db=settings.database, username=settings.username, password=settings.password,
                      socket_connect_timeout=settings.conn_timeout, ssl=settings.ssl,
                      ssl_cert_reqs=settings.ssl_cert_reqs, ssl_ca_certs=settings.ssl_ca_certs,
                      retry=settings.retry, retry_on_error=settings.retry_on_error, encoding="utf8")
        try:
            await redis.ping()
            return redis
        except (RedisError, OSError, TimeoutError) as exc:
            await redis.aclose()
            if attempt >= settings.conn_retries:
                raise
            log.warning("redis connection error %s:%s %s %s, %s retries remaining...", settings.host, settings.port,
                        type(exc).__name__, exc, settings.conn_retries - attempt)
            attempt += 1
            await asyncio.sleep(settings.conn_retry_delay)


def _known_ready(connection: AbstractConnection) -> bool:
    """True when ``connection`` is open and holds no unread reply, judged from what the event loop
    has already read off its socket; False when that cannot be told (not connected, or a parser
    other than hiredis's, which redis-py installs when hiredis is there), and the pool then asks redis-py's own check.

    redis-py makes sure a pooled connection has nothing left to read (a reply a cancelled command
    never read, or the server's close) before every command, by reading its socket under a zero
    timeout: a cancelled read, and its exception, per command. That was a third of a command's
    client CPU (measured: 49 -> 37 us sequential, 37 -> 25 us with 50 commands in flight) and a
    tenth of the fleet benchmark's worker processes. The event loop reads every socket as soon as
    it is readable, so what is unread is already in the stream's buffer: an empty buffer, no end
    of stream and an empty parser say the same thing without a read."""
    parser = getattr(connection, "_parser", None)
    if not connection.is_connected or not isinstance(parser, _AsyncHiredisParser) or not parser._connected:
        return False
    stream = parser._stream
    reader: Any = parser._reader        # a hiredis.Reader while connected (redis-py declares it None)
    if stream is None:
        return False
    unread = getattr(stream, "_buffer", b"unknown")     # asyncio keeps no public count of buffered bytes
    return not unread and not stream.at_eof() and stream.exception() is None and not reader.has_data()


class _QuickReadyCheck(ConnectionPool):
    """A pool whose check that a connection is ready to send reads no socket when nothing is unread
    (:func:`_known_ready`); anything else goes through redis-py's own check, reconnect included."""

    async def ensure_connection(self, connection: AbstractConnection) -> None:
        if not _known_ready(connection):
            await super().ensure_connection(connection)


async def _with_quick_ready_check(redis: Redis) -> Redis:
    """``redis`` with its pool (as built from the settings) replaced by a :class:`_QuickReadyCheck`
    of the same connections and limits."""
    built = redis.connection_pool
    redis.connection_pool = _QuickReadyCheck(connection_class=built.connection_class,
                                             max_connections=built.max_connections, **built.connection_kwargs)
    await built.disconnect()
    return redis


class _SentinelConnection(SentinelManagedConnection):
    """Connects once per try to the primary the sentinels name now.

    redis-py nests the connection's retry policy: the command retries, its connect retries, and the
    connect to a given address retries again, all with the same policy. After a failover that kept
    a worker knocking at the dead primary's address for the whole policy (~30 s) before it asked
    the sentinels again. Here each connect is one try; the command's retry asks the sentinels anew
    each time, so a command resumes as soon as a replica is promoted."""

    _ONCE = Retry(NoBackoff(), 0)

    async def connect(self) -> None:
        if self.is_connected:
            return
        policy, self.retry = self.retry, self._ONCE
        try:
            # redis-py leaves SentinelManagedConnection.connect unannotated; [tool.mypy]'s untyped_calls_exclude
            # admits its module's functions, but mypy does not apply it to calls made through super()
            await super().connect()  # type: ignore[no-untyped-call]
        finally:
            self.retry = policy


class _SentinelSSLConnection(_SentinelConnection, SSLConnection):
    pass


class _SentinelPool(_QuickReadyCheck, SentinelConnectionPool):
    """Hands out a connection even when it cannot connect it yet.

    redis-py connects a pooled connection in ``get_connection``, outside the command's retry. With
    one try per connect (above), a command that found its pooled connection dead right after a
    failover, while the sentinels were still settling on the new primary, failed at once with
    "No master found". Here such a connection is handed out disconnected: the command's retry
    connects it, asking the sentinels again on each try with the usual backoff."""

    async def ensure_connection(self, connection) -> None:  # type: ignore[no-untyped-def]
        try:
            await super().ensure_connection(connection)
        except (RedisConnectionError, RedisTimeoutError, OSError):
            await connection.disconnect()


async def _sentinel_pool(settings: RedisSettings, sentinel_password: str | None) -> Redis:
    """:func:`_pool` for Sentinel: the retry policy, timeouts and CA file reach the primary's
    connections (arq's own Sentinel path, used before, left them out), and sentinels get their own
    password. The first PING is retried the same way (``conn_retries`` x ``conn_retry_delay``)."""
    tls = {"ssl": True, "ssl_ca_certs": settings.ssl_ca_certs, "ssl_cert_reqs": settings.ssl_cert_reqs} \
        if settings.ssl else {}
    sentinel = Sentinel(
        settings.host,
        sentinel_kwargs={"socket_connect_timeout": settings.conn_timeout, "password": sentinel_password, **tls},
        socket_connect_timeout=settings.conn_timeout, retry=settings.retry, retry_on_error=settings.retry_on_error,
        db=settings.database, username=settings.username, password=settings.password, **tls)
    attempt = 0
    while True:
        redis: Redis = sentinel.master_for(
            settings.sentinel_master, redis_class=Redis, connection_pool_class=_SentinelPool,
            connection_class=_SentinelSSLConnection if settings.ssl else _SentinelConnection)
        try:
            await redis.ping()
            return redis
        except (TimeoutError, RedisError, OSError):
            await redis.aclose()
            if attempt >= settings.conn_retries:
                raise
            attempt += 1
            await asyncio.sleep(settings.conn_retry_delay)
