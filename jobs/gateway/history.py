"""The dashboard's last 15 minutes: per lane, tokens/s, queue depth and preemptions, sampled by the
gateway every few seconds into a ring buffer (``GET /api/history``).

Why in the gateway: the queue keeps counts, not their history, and the dashboard wants a chart
the moment it opens rather than one that starts empty. A ring buffer of ``HISTORY_S /
SAMPLE_EVERY_S`` samples bounds the memory (180 small dicts), and one sample costs what one poll
of ``/api/fleet`` costs, whether or not anyone watches. Each gateway process keeps its own; a
gateway that restarts starts a fresh history.

What is measured and what is derived:

* **waiting (queue depth), running, preempted** per lane: the queue's own counts (O(1) reads),
  summed over queues. ``preempted`` is the fleet's running total; the chart shows its increase per sample.
* **tokens/s per lane**: the workers advertise their total tokens/s, not per lane, so each queue's
  total is split by the lanes' shares of its running jobs. Every running sequence gets one token
  per decode step, so this is exact while all of them decode and off only while some prefill.
* **waiting jobs per tenant**: the queue's exact per-tenant counters (jobs waiting or deferred,
  kept by the queue scripts that move jobs, ``Q:tenant_waiting``), summed over queues: one
  ``HGETALL`` per queue, O(tenants with waiting jobs).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from typing import Any

from slotq.jobs.gateway.service import Gateway

log = logging.getLogger(__name__)

HISTORY_S = 15 * 60
SAMPLE_EVERY_S = 5.0


class FleetHistory:
    """Samples the fleet every ``every_s`` and keeps the last ``keep_s`` of them."""

    def __init__(self, gateway: Gateway, *, every_s: float = SAMPLE_EVERY_S, keep_s: float = HISTORY_S) -> None:
        self.gateway = gateway
        self.every_s = every_s
        self.keep_s = keep_s
        self.samples: deque[dict[str, Any]] = deque(maxlen=max(1, int(keep_s / every_s)))
        self.tenants_waiting: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="slotq-fleet-history")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                await self.sample()
            except Exception as exc:   # Redis out of reach: a gap in the chart, not a dead sampler
                log.warning("fleet history: no sample (%s: %s)", type(exc).__name__, exc)
            await asyncio.sleep(self.every_s)

    async def sample(self) -> None:
        """One sample of every queue with live workers (and the gateway's own queue)."""
        gateway = self.gateway
        workers = await gateway.client.workers()
        names = sorted({w.queue for w in workers} | {gateway.settings.queue_name})
        clients = [gateway.queue(name) for name in names]
        lanes: dict[str, dict[str, float]] = {}
        tenants: Counter[str] = Counter()
        for client, counts in zip(clients, await asyncio.gather(*(c.queue.counts() for c in clients))):
            tokens_per_s = sum(w.tokens_per_s for w in workers if w.queue == client.settings.queue_name)
            running = sum(c.running for c in counts)
            for c in counts:
                lane = lanes.setdefault(c.lane, {"waiting": 0, "running": 0, "tokens_per_s": 0.0, "preempted": 0})
                lane["waiting"] += c.waiting
                lane["running"] += c.running
                lane["preempted"] += c.preempted
                lane["tokens_per_s"] += tokens_per_s * c.running / running if running else 0.0
            tenants.update(await client.queue.tenants_waiting())
        for lane in lanes.values():
            lane["tokens_per_s"] = round(lane["tokens_per_s"], 1)
        self.samples.append({"time": round(time.time(), 1), "lanes": lanes})
        self.tenants_waiting = dict(tenants.most_common())

    def snapshot(self) -> dict[str, Any]:
        return {"every_s": self.every_s, "keep_s": self.keep_s, "samples": list(self.samples),
                "tenants_waiting": self.tenants_waiting}

