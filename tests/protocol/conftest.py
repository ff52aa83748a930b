"""The Redis protocol (slotq.jobs.protocol) on a real Valkey, without a model: claims, leases, lanes, the
victim rule, Sentinel and TLS connections.

Fixtures from tests/conftest.py (the tiny model, a session Valkey, clients, in-process workers)
apply here too."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from slotq.jobs.protocol.connection import connect
from tests.support.proxied_cluster import proxied_cluster  # noqa: F401  (a fixture of this folder)
from tests.support.redis_ha import SentinelCluster


@pytest.fixture
async def redis(redis_url, redis_backend):
    """A plain async connection to the test's (emptied) session Valkey, for the scripts' tests; slotq's
    cluster client on the "cluster" ``redis_backend``."""
    r = await connect(redis_url, patient=False) if redis_backend == "cluster" else aioredis.Redis.from_url(redis_url)
    try:
        yield r
    finally:
        await r.aclose()


@pytest.fixture
def sentinel_cluster(tmp_path: Path) -> Iterator[SentinelCluster]:
    """A Valkey primary, its replica and three sentinels of the test's own (tests/support/redis_ha.py)."""
    cluster = SentinelCluster(tmp_path / "ha")
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
