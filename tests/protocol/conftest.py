"""The Redis protocol (slotq.jobs.protocol) on a real Valkey, without a model: claims, leases, lanes, the
victim rule, Sentinel and TLS connections.

Fixtures from tests/conftest.py (the tiny model, a session Valkey, clients, in-process workers)
apply here too."""

import pytest
import redis.asyncio as aioredis


@pytest.fixture
async def redis(redis_url):
    """A plain async connection to the test's (emptied) session Valkey, for the scripts' tests."""
    r = aioredis.Redis.from_url(redis_url)
    try:
        yield r
    finally:
        await r.aclose()
