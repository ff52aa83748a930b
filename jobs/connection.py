"""Connecting to Redis: patient for workers, bounded for producers (no engine import here, so a web
app that only enqueues never loads llama.cpp).

Every command retries with exponential backoff on connection errors, so a Redis restart or
failover is a pause, not an exception. A worker waits it out for about 30 s per command and keeps
trying to make its first connection. A producer is bounded by ``redis_connect_timeout_s``: a web
request or ``slotq enqueue`` against a Redis that is not there fails within that time with
:class:`~jobs.errors.RedisUnavailable`, which names the URL (password hidden) and the cause.
"""

from __future__ import annotations

import asyncio
import math
from urllib.parse import urlsplit, urlunsplit

from arq.connections import ArqRedis, RedisSettings, create_pool
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from jobs.errors import RedisUnavailable
from jobs.serialization import deserialize, serialize


def redacted(url: str) -> str:
    """The URL with any password replaced by ``***`` (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def redis_settings(url: str, *, patient: bool = True, connect_timeout_s: float = 5.0) -> RedisSettings:
    """arq settings from a redis:// or rediss:// URL (password and TLS included).

    ``patient`` (workers): each command retries about 30 s (0.1 s doubling to 2 s), and the first
    connection is retried for 30 s. Otherwise (producers) both stay within ``connect_timeout_s``.
    """
    settings = RedisSettings.from_dsn(url)
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


async def connect(url: str, *, patient: bool, connect_timeout_s: float = 5.0, queue_name: str = "slotq:queue") -> ArqRedis:
    """A connection pool on ``url`` that answered PING. Raises RedisUnavailable when a producer's
    bound runs out (a worker keeps trying for ~30 s first)."""
    settings = redis_settings(url, patient=patient, connect_timeout_s=connect_timeout_s)
    try:
        if patient:
            return await create_pool(settings, job_serializer=serialize, job_deserializer=deserialize,
                                     default_queue_name=queue_name)
        async with asyncio.timeout(connect_timeout_s + settings.conn_timeout):
            return await create_pool(settings, job_serializer=serialize, job_deserializer=deserialize,
                                     default_queue_name=queue_name)
    except (RedisError, OSError, TimeoutError) as exc:
        cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if isinstance(exc, TimeoutError):
            cause = f"no answer within {connect_timeout_s:g} s"
        raise RedisUnavailable(
            f"cannot reach Redis at {redacted(url)} ({cause}); check SLOTQ_REDIS_URL, or start one with `slotq redis`"
        ) from exc
