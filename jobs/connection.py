"""Redis connection settings shared by workers and producers (no engine import here, so a web
app that only enqueues never loads llama.cpp)."""

from __future__ import annotations

from arq.connections import RedisSettings
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


def redis_settings(url: str) -> RedisSettings:
    """arq settings from a redis:// or rediss:// URL (password and TLS included).

    Every command retries with exponential backoff (0.1 s doubling to 2 s, about 30 s in all) on
    connection errors, so a Redis restart or failover is a pause, not an exception, for workers and
    producers alike; the first connection is retried for 30 s too.
    """
    settings = RedisSettings.from_dsn(url)
    settings.conn_retries = 30
    settings.conn_retry_delay = 1
    settings.retry = Retry(ExponentialBackoff(cap=2.0, base=0.1), retries=20)
    settings.retry_on_error = [RedisConnectionError, RedisTimeoutError, ConnectionError, OSError]
    return settings
