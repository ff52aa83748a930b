"""Redis connection settings shared by workers and producers (no engine import here, so a web
app that only enqueues never loads llama.cpp)."""

from __future__ import annotations

from arq.connections import RedisSettings


def redis_settings(url: str) -> RedisSettings:
    """arq settings from a redis:// or rediss:// URL (password and TLS included), retrying the
    connection long enough to ride out a Redis restart."""
    settings = RedisSettings.from_dsn(url)
    settings.conn_retries = 30
    settings.conn_retry_delay = 1
    return settings
