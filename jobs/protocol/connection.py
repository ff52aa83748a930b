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
  their own take ``?sentinel_password=...``;
* ``redis+cluster://[[user]:password@]host[:port][,host[:port]...][/0]`` (and ``rediss+cluster://``):
  Redis or Valkey Cluster. The hosts are any nodes of the cluster (port 6379 by default); the first
  that answers gives the slot map. A cluster has database 0 only, so the path is empty or ``/0``.

For a cluster URL :func:`connect` returns a ``redis.asyncio.cluster.RedisCluster``, cast to ``Redis``: it
offers the same command methods, and callers keep one type. Where the two differ, callers ask
:func:`is_cluster`: a cluster has no transactions (``pipeline(transaction=True)`` raises; a pipeline is
split per node and retried as a whole), no ``pubsub()`` (use :func:`subscriber`), and a command or script
whose keys lie in two slots fails with a cross-slot error.

A cluster client keeps the same patience as a single Redis, by retrying each command itself
(:class:`_Cluster`): redis-py's cluster client retries a failed command at once, a fixed number of times,
and each connect knocks at one address with the whole backoff policy -- after a failover, at the dead
primary's, for the whole ~30 s of a worker's policy.

Every reply must come within :data:`READ_TIMEOUT_S`, past the time a blocking command waits on purpose
(:class:`_ReadBound`, on single Redis, Sentinel and cluster node connections alike; a subscription's
messages wait without a bound): a server that stops answering without closing its connections (frozen,
or behind a network black hole) fails the command as a timeout, which the retry above sends again on a
new connection. Under Sentinel that connection asks the sentinels, under a cluster it follows a slot map
read anew, so after a failover the command goes on at the promoted replica; a single Redis is tried again
at its address. A new connection's handshake is bounded by the connect timeout instead
(:meth:`_ReadBound.on_connect`), so each retry at a server still frozen fails after that, not after the
read bound again; on a cluster such a failure, like any from a node, makes redis-py drop its slot map and
close every node connection, cutting the commands in flight on other nodes (docs/cluster.md).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import parse_qs, unquote, urlparse, urlsplit

import hiredis
from redis._parsers import AsyncCommandsParser, _AsyncHiredisParser
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, PipelineCommand, RedisCluster
from redis.asyncio.connection import (
    AbstractConnection,
    Connection,
    ConnectionPool,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection
from redis.backoff import AbstractBackoff, ExponentialBackoff, NoBackoff
from redis.exceptions import (
    AskError,
    BusyLoadingError,
    ClusterDownError,
    DataError,
    MasterDownError,
    MovedError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.typing import EncodableT

from slotq.jobs.errors import RedisUnavailable

log = logging.getLogger(__name__)

SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}     # scheme -> TLS
SENTINEL_PORT = 26379
CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}       # scheme -> TLS
REDIS_PORT = 6379
READ_TIMEOUT_S = 10.0   # a reply, past a blocking command's own wait (_ReadBound)
WORKER_RETRY_S = 30.0   # a worker's command is retried this long after its first failure (RetryWithin)
T = TypeVar("T")


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


@dataclass(frozen=True)
class ClusterUrl:
    nodes: list[tuple[str, int]]
    username: str | None
    password: str | None
    tls: bool


@dataclass
class RedisSettings:
    """How to reach Redis and how patiently (:func:`redis_settings`). The fields are those of arq's
    ``RedisSettings`` that slotq sets, under arq's names (slotq built its clients with arq's
    helpers until producers stopped importing arq; the arq baseline benchmark hands them to arq)."""

    host: str | list[tuple[str, int]] = "localhost"     # the sentinels' (``sentinel``) or cluster nodes' addresses
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
    username, password, sentinels = _credentials_and_hosts(url, SENTINEL_PORT, "sentinel")
    path = [p for p in parts.path.split("/") if p]
    if not sentinels or not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"{redacted(url)}: want {parts.scheme}://[[user]:password@]host[:port][,host[:port]...]"
                         "/service[/db]")
    query = parse_qs(parts.query)
    return SentinelUrl(sentinels=sentinels, service=unquote(path[0]), db=int(path[1]) if len(path) == 2 else 0,
                       username=username, password=password,
                       sentinel_password=query.get("sentinel_password", [None])[0],
                       tls=SENTINEL_SCHEMES[parts.scheme])


def parse_cluster_url(url: str) -> ClusterUrl | None:
    """The parts of a ``redis+cluster://`` URL; None for any other scheme. Raises ValueError, naming
    the URL (password hidden), when it is malformed."""
    parts = urlsplit(url)
    if parts.scheme not in CLUSTER_SCHEMES:
        return None
    username, password, nodes = _credentials_and_hosts(url, REDIS_PORT, "node")
    if not nodes or parts.path.strip("/") not in {"", "0"} or parts.query:
        raise ValueError(f"{redacted(url)}: want {parts.scheme}://[[user]:password@]host[:port][,host[:port]...]"
                         "[/0] (a cluster has database 0 only)")
    return ClusterUrl(nodes=nodes, username=username, password=password, tls=CLUSTER_SCHEMES[parts.scheme])


def _credentials_and_hosts(url: str, default_port: int, what: str) -> tuple[str | None, str | None,
                                                                            list[tuple[str, int]]]:
    """User name, password and the comma-separated ``host[:port]`` list of a URL's network location."""
    userinfo, _, hosts = urlsplit(url).netloc.rpartition("@")
    username, _, password = userinfo.partition(":") if userinfo else ("", "", "")
    addresses = []
    for host in filter(None, hosts.split(",")):
        name, _, port = host.rpartition(":") if ":" in host else (host, "", "")
        if not name or (port and not port.isdigit()):
            raise ValueError(f"{redacted(url)}: bad {what} address {host!r} (want host[:port])")
        addresses.append((name, int(port) if port else default_port))
    return unquote(username) or None, unquote(password) or None, addresses


def redis_settings(url: str, *, patient: bool = True, connect_timeout_s: float = 5.0,
                   ca_file: Path | None = None) -> RedisSettings:
    """Settings from a redis://, rediss://, redis+sentinel:// or redis+cluster:// URL (password and TLS
    included; ``ca_file`` verifies a TLS server's certificate).

    ``patient`` (workers): each command is retried for 30 s from its first failure (0.1 s doubling to
    2 s), and the first connection is retried for 30 s. Otherwise (producers) both stay within
    ``connect_timeout_s``.
    """
    sentinel = parse_sentinel_url(url)
    cluster = parse_cluster_url(url)
    if sentinel is not None:
        settings = RedisSettings(host=sentinel.sentinels, sentinel=True, sentinel_master=sentinel.service,
                                 database=sentinel.db, username=sentinel.username, password=sentinel.password,
                                 ssl=sentinel.tls)
    elif cluster is not None:
        settings = RedisSettings(host=cluster.nodes, username=cluster.username, password=cluster.password,
                                 ssl=cluster.tls)
    else:
        settings = RedisSettings.from_url(url)
    if ca_file is not None:
        settings.ssl_ca_certs = str(ca_file)
    settings.retry_on_error = [RedisConnectionError, RedisTimeoutError, ConnectionError, OSError]
    if patient:
        settings.conn_retries = 30
        settings.conn_retry_delay = 1
        settings.retry = RetryWithin(ExponentialBackoff(cap=2.0, base=0.1), within_s=WORKER_RETRY_S)
    else:
        settings.conn_timeout = max(1, math.ceil(min(connect_timeout_s, 5)))
        settings.conn_retries = 0
        # Retries end within 80% of the bound, so the last error (e.g. "Connection refused") is what the
        # caller sees rather than a bare timeout.
        settings.retry = RetryWithin(ExponentialBackoff(cap=1.0, base=0.05), within_s=0.8 * connect_timeout_s)
    return settings


class RetryWithin(Retry):
    """A command's retries with backoff, for as long as ``within_s`` from its first failure, where
    redis-py's ``Retry`` counts tries. A count does not bound time: each try against a server that
    accepts connections but never answers (frozen, or behind a black hole) waits out its
    connection's handshake bound, so a producer's 8 tries at a 5 s connect timeout took 49.7 s, where
    its backoff alone was meant to span 4. Here a retry starts only while its backoff ends within
    ``within_s`` of the first failure, so a command fails at most one try's bound past that: the first
    try's read bound, ``within_s``, then the last try's handshake bound (docs/operations.md, "A Redis
    that stops answering")."""

    __slots__ = ("within_s",)

    def __init__(self, backoff: AbstractBackoff, *, within_s: float) -> None:
        super().__init__(backoff, retries=-1)
        self.within_s = within_s

    async def call_with_retry(self, do: Callable[[], Awaitable[T]], fail: Callable[[RedisError], Any]) -> T:
        self._backoff.reset()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
        failures = 0
        first_failure = 0.0
        while True:
            try:
                return await do()
            except self._supported_errors as error:
                failures += 1
                await fail(error)
                now = time.monotonic()
                first_failure = first_failure or now
                backoff = self._backoff.compute(failures)
                if now + backoff - first_failure > self.within_s:
                    raise error
                if backoff > 0:
                    await asyncio.sleep(backoff)


# What a retry can outlast: the server away or not answering, a server that is loading its data, a
# primary demoted or not yet promoted (a failover), a cluster still settling its slots, a script busy
# past its time limit. ``BUSY`` has no class of its own in redis-py.
_TRANSIENT = (RedisConnectionError, RedisTimeoutError, OSError, BusyLoadingError, ReadOnlyError, MasterDownError,
              TryAgainError, ClusterDownError, SlotNotCoveredError, AskError, MovedError)
_TRANSIENT_REPLIES = ("BUSY ", "LOADING", "READONLY", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "NOREPLICAS")


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` is one that trying the same command again can outlast (Redis away, loading, in
    a failover). Every other Redis error is deterministic: a script's Lua error, ``OOM`` (Redis at its
    ``maxmemory`` under ``noeviction``), a bad argument or ``WRONGTYPE``. Sending the same command again
    gets the same answer until someone acts, so callers count it, say it, and give up rather than retry
    it as an outage (``slotq_redis_failures_total``, docs/operations.md)."""
    if isinstance(error, _TRANSIENT):
        return True
    if isinstance(error, RedisClusterException):        # "Redis Cluster cannot be connected"
        return isinstance(error.__cause__, _TRANSIENT)
    return isinstance(error, ResponseError) and str(error).startswith(_TRANSIENT_REPLIES)


async def connect(url: str, *, patient: bool, connect_timeout_s: float = 5.0, ca_file: Path | None = None) -> Redis:
    """A connection pool on ``url`` that answered PING (for a cluster URL, a cluster client whose primaries
    all answered, cast to ``Redis``: see the module's docstring). Raises RedisUnavailable when a producer's
    bound runs out (a worker keeps trying for ~30 s first)."""
    try:
        settings = redis_settings(url, patient=patient, connect_timeout_s=connect_timeout_s, ca_file=ca_file)
    except ValueError as exc:
        raise RedisUnavailable(f"SLOTQ_REDIS_URL {redacted(url)} is not a Redis URL ({exc}); want redis://, "
                               "rediss://, redis+sentinel:// or redis+cluster://") from None
    sentinel = parse_sentinel_url(url)
    cluster = parse_cluster_url(url)

    async def make() -> Redis:
        if sentinel is not None:
            return await _sentinel_pool(settings, sentinel.sentinel_password)
        if cluster is not None:
            return await _cluster_client(settings)
        return await _pool(settings)

    try:
        if patient:
            return await make()
        async with asyncio.timeout(connect_timeout_s + settings.conn_timeout):
            return await make()
    except (RedisError, RedisClusterException, OSError, TimeoutError) as exc:
        cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if isinstance(exc, TimeoutError):
            cause = f"no answer within {connect_timeout_s:g} s"
        raise RedisUnavailable(
            f"cannot reach Redis at {redacted(url)} ({cause}); check SLOTQ_REDIS_URL, or start one with `slotq redis`"
        ) from exc


async def _pool(settings: RedisSettings) -> Redis:
    """A client of ``settings``' server that answered PING (:func:`_first_answer`), whose connections
    bound each reply (:class:`_ReadBound`) and are checked quickly (:func:`_with_quick_ready_check`)."""
    host = settings.host
    assert isinstance(host, str), "sentinels and cluster nodes are asked through _sentinel_pool and _cluster_client"
    redis = await _first_answer(settings, lambda: Redis(
        host=host, port=settings.port, unix_socket_path=settings.unix_socket_path, db=settings.database,
        username=settings.username, password=settings.password, socket_connect_timeout=settings.conn_timeout,
        socket_timeout=READ_TIMEOUT_S, ssl=settings.ssl, ssl_cert_reqs=settings.ssl_cert_reqs,
        ssl_ca_certs=settings.ssl_ca_certs, retry=settings.retry, retry_on_error=settings.retry_on_error,
        encoding="utf8"))
    return await _with_quick_ready_check(redis, _READ_BOUND[redis.connection_pool.connection_class])


async def _first_answer(settings: RedisSettings, make: Callable[[], Redis],
                        ping: Callable[[Redis], Awaitable[object]] = lambda redis: redis.ping()) -> Redis:
    """A client from ``make()`` that answered ``ping``, a new one for each try, the first connection
    retried ``conn_retries`` times ``conn_retry_delay`` apart (as arq's ``create_pool`` made them)."""
    where = settings.host if isinstance(settings.host, list) else f"{settings.host}:{settings.port}"
    attempt = 0
    while True:
        redis = make()
        try:
            await ping(redis)
            return redis
        except (RedisError, RedisClusterException, OSError, TimeoutError) as exc:
            await redis.aclose()
            if attempt >= settings.conn_retries:
                raise
            log.warning("redis connection error %s %s %s, %s retries remaining...", where, type(exc).__name__, exc,
                        settings.conn_retries - attempt)
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


async def _with_quick_ready_check(redis: Redis, connection_class: type[AbstractConnection]) -> Redis:
    """``redis`` with its pool (as built from the settings) replaced by a :class:`_QuickReadyCheck`
    of the same limits and connection settings, its connections of ``connection_class``."""
    built = redis.connection_pool
    redis.connection_pool = _QuickReadyCheck(connection_class=connection_class,
                                             max_connections=built.max_connections, **built.connection_kwargs)
    await built.disconnect()
    return redis


# Where a blocking command says how long it may wait before it replies: its last argument in seconds or in
# milliseconds, its first in seconds, or its BLOCK option (XREAD) in milliseconds. 0 waits for ever.
_BLOCKS_LAST_S = {"BLPOP", "BRPOP", "BRPOPLPUSH", "BLMOVE", "BZPOPMIN", "BZPOPMAX"}
_BLOCKS_LAST_MS = {"WAIT", "WAITAOF"}
_BLOCKS_FIRST_S = {"BLMPOP", "BZMPOP"}
_BLOCKS_OPTION_MS = {"XREAD", "XREADGROUP"}


def _word(arg: EncodableT) -> str:
    return (arg.decode(errors="replace") if isinstance(arg, bytes) else str(arg)).upper()


def _block_s(args: tuple[EncodableT, ...]) -> float | None:
    """How long the command ``args`` may hold its reply back on purpose, in seconds: 0 for a command
    that does not block, None for one that blocks for ever."""
    name = _word(args[0]).split(" ")[0]
    if name in _BLOCKS_LAST_S | _BLOCKS_LAST_MS | _BLOCKS_FIRST_S:
        seconds = float(args[1] if name in _BLOCKS_FIRST_S else args[-1])
        return (seconds / 1000 if name in _BLOCKS_LAST_MS else seconds) or None
    if name in _BLOCKS_OPTION_MS:
        block, _streams = _stream_read_parts(args)
        return 0.0 if block is None else float(block) / 1000 or None
    return 0.0


def _stream_read_parts(args: tuple[EncodableT, ...]) -> tuple[EncodableT | None, tuple[EncodableT, ...]]:
    """An XREAD's or XREADGROUP's BLOCK value (None without one), and what follows STREAMS: its keys,
    then as many ids. The options come before STREAMS; a group's and a consumer's names are no options."""
    block: EncodableT | None = None
    position = 1
    while position < len(args):
        option = _word(args[position])
        if option == "STREAMS":
            return block, args[position + 1:]
        if option == "BLOCK":
            block = args[position + 1]
        position += {"GROUP": 3, "BLOCK": 2, "COUNT": 2}.get(option, 1)     # GROUP <group> <consumer>; NOACK
    return block, ()


class _StreamReadKeys(AsyncCommandsParser):
    """redis-py's key finder for a cluster's commands, which finds an XREAD's keys itself.

    redis-py asks a node (``COMMAND GETKEYS``) for the keys of every command flagged ``movablekeys``,
    XREAD among them: each wait for a job's result paid a second round trip, all of a client's to the same
    node, and failed with that node though its stream was on another (a producer's ``result()`` did in
    the chaos run on a cluster). The keys are the first half of what follows STREAMS."""

    async def get_keys(self, *args: Any) -> tuple[str, ...] | None:
        if _word(args[0]) in _BLOCKS_OPTION_MS:
            _block, streams = _stream_read_parts(args)
            if streams and len(streams) % 2 == 0:
                keys = streams[:len(streams) // 2]
                return tuple(key.decode() if isinstance(key, bytes) else str(key) for key in keys)
        return await super().get_keys(*args)


class _HiredisPacking(AbstractConnection):
    """Packs commands into the Redis protocol with hiredis's packer, written in C (a mixin, as
    :class:`_ReadBound`, which every slotq connection is, builds on).

    redis-py's asyncio connections pack every argument in Python (its sync ones use hiredis when it
    is there). A stream flush is one script call with a few arguments per entry, hundreds of entries
    at many streams: packed in Python it was a sixth of the worker's event loop at 256 streams
    (py-spy, docs/benchmarks.md); hiredis packs the same bytes about 7x faster (1.36 -> 0.21 ms for
    1,800 arguments). A value neither packer takes (None, a bool) raises redis-py's ``DataError``."""

    def pack_command(self, *args: EncodableT) -> list[bytes]:
        name, *rest = args
        if isinstance(name, (str, bytes)) and len(words := name.split()) > 1:   # 'CONFIG GET': a word an argument
            args = (*words, *rest)
        try:
            return [hiredis.pack_command(cast(Any, args))]     # its stub declares a 1-tuple: any length packs
        except TypeError as exc:
            raise DataError(f"{exc} (a command's arguments must be bytes, str, int or float)") from None


class _ReadBound(_HiredisPacking):
    """A connection on which a reply must come within ``socket_timeout`` (:data:`READ_TIMEOUT_S`) past the
    time the commands it waits on block on purpose (``BLPOP``'s timeout, ``XREAD``'s ``BLOCK``, ``WAIT``'s;
    none for one that blocks for ever). Later, redis-py's read fails with a timeout and closes the
    connection. A mixin, put first before a concrete connection class: TCP, TLS, a Unix socket
    (:data:`_READ_BOUND`), Sentinel's (:class:`_SentinelConnection`) and a cluster node's.

    redis-py applies ``socket_timeout`` to every read as it is, so a blocking read longer than it
    failed; here each command (or pipeline) sets the bound of its replies when it is packed, which
    holds once it is sent. (A command is packed before its connection connects, and the connect sends
    commands of its own, with their own bounds: :meth:`on_connect`.) A subscription's messages (reads
    with ``push_request``) come when something is published, however long after: they wait without a bound."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._base_s = self._packed_within_s = self._replies_within_s = self.socket_timeout

    async def on_connect(self) -> None:
        """redis-py's handshake on a new connection (``AUTH`` or ``HELLO``, ``CLIENT SETINFO``, ``SELECT``),
        each reply within the connect timeout (``socket_connect_timeout``, the settings' ``conn_timeout``)
        rather than :data:`READ_TIMEOUT_S`: a handshake never blocks on purpose, and a server that answers
        nothing is not worth waiting on twice. Each retry of a command opens a new connection, and against
        a frozen Redis every handshake waited out the read bound again (a producer's command failed after
        85 s, a worker's after 245 s). Commands already sent keep the read bound: their reply may be the
        slow part of a busy server's work, a handshake's is not."""
        base, self._base_s = self._base_s, self.socket_connect_timeout
        try:
            await super().on_connect()
        finally:
            self._base_s = base

    def pack_command(self, *args: EncodableT) -> list[bytes]:
        self._expect([args])
        return super().pack_command(*args)

    def pack_commands(self, commands: Iterable[Iterable[EncodableT]]) -> list[bytes]:
        batch = [tuple(command) for command in commands]
        packed = super().pack_commands(batch)        # which packs each command with pack_command
        self._expect(batch)
        return packed

    def _expect(self, commands: list[tuple[EncodableT, ...]]) -> None:
        """The bound of the replies to ``commands`` (run one after the other: their block times add up)."""
        blocks = [_block_s(args) for args in commands]
        self._packed_within_s = None if self._base_s is None or None in blocks \
            else self._base_s + sum(cast(list[float], blocks))

    async def send_packed_command(self, command: bytes | str | Iterable[bytes], check_health: bool = True) -> None:
        within = self._packed_within_s          # before a connect packs commands of its own
        # No bound on the write: with one, redis-py writes in a task of its own (asyncio.wait_for), and a
        # connection that a read of the slot map closed meanwhile failed with an AttributeError ('NoneType'
        # has no 'writelines'), which no retry catches (the proxied failover test, tests/faults). A reply
        # overdue is caught by its read's bound all the same.
        self.socket_timeout = None
        await super().send_packed_command(command, check_health)
        self._replies_within_s = within

    # disconnect_on_error: a flag, which redis-py's SentinelManagedConnection annotates Optional[float]
    async def read_response(self, disable_decoding: bool = False, timeout: float | None = None, *,
                            disconnect_on_error: bool | float | None = True, push_request: bool | None = False) -> Any:
        self.socket_timeout = None if push_request else self._replies_within_s
        return await super().read_response(disable_decoding, timeout, disconnect_on_error=bool(disconnect_on_error),
                                           push_request=push_request)


class _ReadBoundTCP(_ReadBound, Connection):
    pass


class _ReadBoundSSL(_ReadBound, SSLConnection):
    pass


class _ReadBoundUnix(_ReadBound, UnixDomainSocketConnection):
    pass


# The bounded class for each connection class redis-py picks from a URL's settings (redis://, rediss://, unix://)
_READ_BOUND: dict[type[AbstractConnection], type[_ReadBound]] = {
    Connection: _ReadBoundTCP, SSLConnection: _ReadBoundSSL, UnixDomainSocketConnection: _ReadBoundUnix}


class _SentinelConnection(_ReadBound, SentinelManagedConnection):
    """Connects once per try to the primary the sentinels name now, and bounds its replies (:class:`_ReadBound`).

    redis-py nests the connection's retry policy: the command retries, its connect retries, and the
    connect to a given address retries again, all with the same policy. After a failover that kept
    a worker knocking at the dead primary's address for the whole policy (~30 s) before it asked
    the sentinels again. Here each connect is one try; the command's retry asks the sentinels anew
    each time, so a command resumes as soon as a replica is promoted, also after its reply timed out
    on a primary that froze."""

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
    """:func:`_pool` for Sentinel: the retry policy, timeouts, the bound on replies and CA file reach the
    primary's connections (arq's own Sentinel path, used before, left them out), and sentinels get their own
    password. A sentinel's connections are bounded as the primary's are (:class:`_ReadBound`), so one that
    froze is passed over for the next rather than asked for ever: after its handshake's bound, the connect
    timeout, where a plain reply bound made each new connection wait out the 10 s read bound. The first PING
    is retried the same way (:func:`_first_answer`)."""
    tls = {"ssl": True, "ssl_ca_certs": settings.ssl_ca_certs, "ssl_cert_reqs": settings.ssl_cert_reqs} \
        if settings.ssl else {}
    sentinel = Sentinel(
        settings.host,
        sentinel_kwargs={"socket_connect_timeout": settings.conn_timeout, "socket_timeout": READ_TIMEOUT_S,
                         "password": sentinel_password, **tls},
        socket_connect_timeout=settings.conn_timeout, socket_timeout=READ_TIMEOUT_S, retry=settings.retry,
        retry_on_error=settings.retry_on_error, db=settings.database, username=settings.username,
        password=settings.password, **tls)
    for client in sentinel.sentinels:        # redis-py takes no connection class for the sentinels' clients
        client.connection_pool.connection_class = _READ_BOUND[client.connection_pool.connection_class]
    return await _first_answer(settings, lambda: sentinel.master_for(
        settings.sentinel_master, redis_class=Redis, connection_pool_class=_SentinelPool,
        connection_class=_SentinelSSLConnection if settings.ssl else _SentinelConnection))


def is_cluster(redis: Redis) -> bool:
    """True for a cluster client (:func:`connect` on a ``redis+cluster://`` URL): no transactions, no
    ``pubsub()``, and no command across slots."""
    return isinstance(redis, RedisCluster)


@asynccontextmanager
async def subscriber(redis: Redis, key: str | None = None) -> AsyncIterator[Redis]:
    """A client whose ``pubsub()`` works, for the block: ``redis`` itself for a single Redis; for a cluster
    (whose async client has no ``pubsub()``), a plain client of one of its primaries (that of ``key``'s
    slot if given), with the cluster's credentials and TLS, closed at the end of the block.

    One node is enough: a classic ``PUBLISH`` in a cluster reaches the subscribers on every node (the
    cluster bus carries it), whichever node it was sent to, through the cluster client or from a script.
    If that node dies, the subscription's connection fails within its :func:`node_client`'s brief
    retries; subscribe again through a new block. A block whose node does not answer tries again with
    the cluster's retry policy, each retry on a slot map read anew, so after a failover it waits for the
    promoted replica rather than knocking at the dead primary's address (which the map it had may still
    name) for the whole policy. Only a retry reads the map: a read replaces the client's nodes, which
    cuts the commands in flight on it."""
    if not is_cluster(redis):
        yield redis
        return
    cluster = cast(_Cluster, redis)
    tries = 0

    async def subscribing_client() -> Redis:
        nonlocal tries
        tries += 1
        return await node_client(redis, key, fresh_map=tries > 1)

    client = await cluster.command_retry.call_with_retry(subscribing_client, _no_cleanup)
    try:
        yield client
    finally:
        await client.aclose()


NODE_RETRY_S = 2.0      # how long a node_client retries its one node before its caller looks the slot up again


async def node_client(redis: Redis, key: str | None, *, fresh_map: bool = False) -> Redis:
    """A plain client of the primary that serves ``key``'s slot (None: redis-py's default node, the
    first primary of the slot map), with the cluster's credentials, TLS and bound on replies
    (:class:`_ReadBound`); the caller closes it. For what a cluster client cannot do on one connection (a
    blocking read that CLIENT UNBLOCK ends, a subscription). It retries its node for only
    :data:`NODE_RETRY_S`, and a reply overdue not at all (each try would wait out the bound again):
    waiting out a failover is its caller's part, with a new client of the slot's node after reading the
    map again (``fresh_map``)."""
    cluster = cast(_Cluster, redis)
    if fresh_map:
        await cluster.read_slot_map()
    else:
        await _connection_errors_retried(cluster.initialize())
    node = cluster.get_default_node() if key is None else cluster.get_node_from_key(key)
    if node is None:        # the slot's primary failed and no replica has taken over yet
        raise RedisConnectionError(f"no primary of the cluster serves the slot of {key} now")
    brief = RetryWithin(ExponentialBackoff(cap=0.5, base=0.05), within_s=NODE_RETRY_S)
    settings = replace(cluster.settings, host=node.host, port=int(node.port), retry=brief, conn_retries=0,
                       retry_on_error=[error for error in cluster.settings.retry_on_error or ()
                                       if error is not RedisTimeoutError])
    return await _pool(settings)


async def _connection_errors_retried(call: Awaitable[T]) -> T:
    """``call``, with redis-py's "Redis Cluster cannot be connected" (no node of the map answered, raised
    as a ``RedisClusterException``, which is no ``RedisError``) raised as the connection error it is."""
    try:
        return await call
    except RedisClusterException as exc:
        if isinstance(exc.__cause__, (RedisConnectionError, RedisTimeoutError, OSError)):
            raise RedisConnectionError(str(exc)) from exc
        raise


class _StartupNodes(dict[str, ClusterNode]):
    """A cluster client's startup nodes, whose values are read as a snapshot. redis-py's read of the slot
    map walks them, waiting on each node, while a command that fails on a node (another task) pops that
    node from the same dict, and :meth:`_Cluster.initialize` puts the URL's back: the walk then failed
    with "dictionary changed size during iteration", a RuntimeError no retry catches, which ended a
    stream follower in the chaos run on a cluster."""

    def values(self) -> list[ClusterNode]:  # type: ignore[override]  # a list: the walk's own copy
        return list(super().values())


class _Cluster(RedisCluster):
    """A cluster client whose commands and pipelines retry with the settings' backoff, each try on the
    slot map as the cluster gives it then.

    redis-py's own retries do not wait out a failover: a failed command is tried again at once
    (``cluster_error_retry_attempts`` times, without backoff), and the connection's retry policy
    applies to each connect, so a command re-routed to the dead primary (the map still names it until
    the replica is promoted) knocked at that address for the whole policy (~30 s for a worker) before
    the map was read again. Here each connect is one try and each command is retried, with the
    backoff, as a whole: after a connection error redis-py drops its slot map, so the next try reads
    the map anew and reaches the new primary as soon as it is promoted.

    Each read of the slot map starts from the URL's nodes too: redis-py drops a node from its startup
    nodes when a command to it fails, and a client whose commands failed on every node at once (the
    whole cluster restarting) had none left to ask, for good.

    Its nodes' connections bound each reply (:class:`_ReadBound`, :data:`READ_TIMEOUT_S`), the slot map's
    reads included: a primary that stops answering without closing its connections fails the command
    as a timeout, after which redis-py drops the map too, and the retry reaches the promoted replica."""

    def __init__(self, settings: RedisSettings) -> None:
        assert isinstance(settings.host, list), "a cluster URL's settings name its nodes"
        assert settings.retry is not None, "redis_settings() sets the retry policy"
        tls = {"ssl": True, "ssl_ca_certs": settings.ssl_ca_certs, "ssl_cert_reqs": settings.ssl_cert_reqs} \
            if settings.ssl else {}
        self._url_nodes = [ClusterNode(host, port) for host, port in settings.host]
        # cluster_error_retry_attempts=1: redis-py's own immediate retries stay out of the way of the backoff
        # below; 0 is no option, as its pipelines run range(cluster_error_retry_attempts) tries (none at 0)
        super().__init__(startup_nodes=self._url_nodes, username=settings.username, password=settings.password,
                         socket_connect_timeout=settings.conn_timeout, socket_timeout=READ_TIMEOUT_S,
                         retry=Retry(NoBackoff(), 0), retry_on_error=settings.retry_on_error,
                         cluster_error_retry_attempts=1, encoding="utf8", **tls)
        # redis-py takes no connection class for its nodes: every node made from here on (a startup node, one
        # of the slot map) gets those of connection_kwargs; the startup nodes made above are made again
        self.connection_kwargs["connection_class"] = _ReadBoundSSL if settings.ssl else _ReadBoundTCP
        self.commands_parser = _StreamReadKeys()
        self.nodes_manager.startup_nodes = _StartupNodes(
            (node.name, ClusterNode(node.host, node.port, **self.connection_kwargs)) for node in self._url_nodes)
        self.settings = settings
        self.command_retry = settings.retry
        self.command_retry.update_supported_errors(
            [*(settings.retry_on_error or []), ClusterDownError, SlotNotCoveredError])

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        once = super().execute_command
        return await self.command_retry.call_with_retry(
            lambda: _connection_errors_retried(once(*args, **kwargs)), _no_cleanup)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        super().pipeline(transaction, shard_hint)        # raises on a transaction, as redis-py's
        # redis-py's command mixins declare a connection_pool (CommandsProtocol) that no cluster client has
        return _ClusterPipeline(self)  # type: ignore[abstract]

    async def initialize(self) -> RedisCluster:
        if self._initialize:                     # the slot map is to be read (again)
            startup = self.nodes_manager.startup_nodes
            for node in self._url_nodes:
                if node.name not in startup:
                    startup[node.name] = ClusterNode(node.host, node.port, **self.connection_kwargs)
        return await super().initialize()

    def get_default_node(self) -> ClusterNode:
        """redis-py's default node, or a connection error while there is none: a command that failed on a
        node drops the slot map, default node included, until the next read. A cluster pipeline whose batch
        to one node failed meanwhile (its connections are closed with the map) looks the default node up
        to replace it, and met None there: an AttributeError that no retry caught failed a worker's stream
        flush, and with it its job, after a network cut. As a connection error the pipeline is retried."""
        node = super().get_default_node()
        if node is None:
            raise RedisConnectionError("the cluster's slot map was dropped after a connection error")
        return node

    async def read_slot_map(self) -> None:
        """Read the slot map again now (a node of it failed: a stream reader looks up the node that serves
        its bucket now), as the next command would after a connection error: from the URL's nodes too, and
        under the client's lock, so callers at once share one read. Reads side by side broke each other: a
        read walks the startup nodes, waiting on each, and one that ends rewrites them, which failed the
        others with "dictionary changed size during iteration". No node answering is a connection error."""
        self._initialize = True
        await _connection_errors_retried(self.initialize())


class _ClusterPipeline(ClusterPipeline):
    """A cluster pipeline retried as a whole with the client's backoff (:class:`_Cluster`), as a single
    Redis's pipeline is: a retry sends every command again, also those a node had already run."""

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        cluster = cast(_Cluster, self._client)
        commands = [(command.args, command.kwargs) for command in self._command_stack]

        async def once() -> list[Any]:
            # redis-py empties the stack after each execute, and pops a command's target from its kwargs
            self._command_stack = [PipelineCommand(position, *args, **kwargs)
                                   for position, (args, kwargs) in enumerate(commands)]
            return await _connection_errors_retried(super(_ClusterPipeline, self).execute(raise_on_error,
                                                                                          allow_redirections))
        return await cluster.command_retry.call_with_retry(once, _no_cleanup)


async def _no_cleanup(error: Exception) -> None:
    """Nothing to undo after a failed try: redis-py has already dropped the client's slot map."""


async def _cluster_client(settings: RedisSettings) -> Redis:
    """A :class:`_Cluster` on the settings' nodes whose primaries all answered PING (:func:`_first_answer`;
    a plain PING would go to the replicas too)."""
    return await _first_answer(
        settings, lambda: cast(Redis, _Cluster(settings)),  # type: ignore[abstract]  # see _Cluster.pipeline
        lambda cluster: cast(RedisCluster, cluster).ping(target_nodes=RedisCluster.PRIMARIES))
