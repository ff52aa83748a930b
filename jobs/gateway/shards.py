"""The dashboard's cluster shards (``GET /api/shards``): on a Redis Cluster, each primary and its share of
the gateway's queue, as ``slotq status`` shows them (:mod:`slotq.jobs.protocol.shard_load`).

Why a view of its own per gateway process: a read costs an INFO and a DBSIZE per primary and one
``CLUSTER COUNTKEYSINSLOT`` per slot slotq uses (49, and one per further partition), and every open
dashboard polls. So the answer is kept for ``SHARDS_FRESH_S`` and made once for all requests that ask
while it is read: however many dashboards are open, each gateway process reads the shards at most once
per ``SHARDS_FRESH_S``. The reader is kept for the process's life, because each primary's CPU share is
what it used since the reader's previous read (None on the first). Nothing is read on one Redis.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from slotq.jobs.gateway.service import Gateway
from slotq.jobs.protocol.shard_load import shard_reader

SHARDS_FRESH_S = 4.0        # under the dashboard's 5 s poll: one page gets a fresh read each time, many share it


class ShardsView:
    """The shards under the gateway's own queue (``SLOTQ_QUEUE_NAME``, its partitions included)."""

    def __init__(self, gateway: Gateway, *, fresh_s: float = SHARDS_FRESH_S) -> None:
        self.queue = gateway.settings.queue_name
        self.fresh_s = fresh_s
        self._reader = shard_reader(gateway.client.redis, gateway.client.queue)
        self._answer: dict[str, Any] = {"clustered": False, "queue": self.queue, "shards": []}
        self._read_at = -math.inf            # when the last read started (monotonic)
        self._reading = asyncio.Lock()

    async def answer(self) -> dict[str, Any]:
        """``{"clustered", "queue", "shards"}``, and on a cluster ``time``, when the shards were read. A read
        that fails raises (the caller's error), and the next request reads again."""
        if self._reader is None:
            return self._answer
        async with self._reading:                # who asks while a read is under way gets its answer
            if (started := time.monotonic()) - self._read_at >= self.fresh_s:
                at = time.time()
                shards = await self._reader.read()
                self._answer = {"clustered": True, "queue": self.queue, "time": at,
                                "shards": [shard.model_dump(mode="json") for shard in shards]}
                self._read_at = started
            return self._answer
