"""The elastic controller inside a worker: every ``adapt_interval_s`` observe, decide, apply, export.

Applying a decision means: the engine's active-slot cap, batch and prefill chunk
(``Engine.set_limits``), and the queue runtime's ``slots`` (how many jobs the worker holds), so
the worker claims exactly as many jobs as it has active slots. The max_tokens cap and refusals are
read by each job as it starts (:meth:`ElasticLoop.verdict`). Every change is logged with its reason
and counted in the metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from slotq.engine.process import EngineProcess
from slotq.jobs.worker.elastic import metrics
from slotq.jobs.worker.elastic.admission import Verdict, verdict
from slotq.jobs.worker.elastic.controller import Change, Degradation, Observation, SlotController
from slotq.jobs.worker.elastic.knobs import ElasticKnobs
from slotq.jobs.worker.elastic.memory import resolve_memory_limit, worker_rss_bytes
from slotq.jobs.worker.fault_injection import WorkerFaults

if TYPE_CHECKING:
    from slotq.engine import EngineStats
    from slotq.jobs.protocol.partitioned_queue import Queue
    from slotq.jobs.worker.engine_api import JobEngine
    from slotq.jobs.worker.runtime import QueueRuntime

log = logging.getLogger(__name__)


class ElasticLoop:
    def __init__(self, knobs: ElasticKnobs, *, engine: JobEngine, runtime: QueueRuntime, queue: Queue,
                 faults: WorkerFaults, worker_id: str) -> None:
        self.knobs = knobs
        self.engine = engine
        self.runtime = runtime
        self.queue = queue
        self.faults = faults
        self.worker_id = worker_id
        self.controller = SlotController(knobs, max_slots=engine.config.slots)
        self.memory_limit = resolve_memory_limit(knobs.memory_limit_mb)
        self.last: Observation | None = None
        self._speed_mark: tuple[float, float] | None = None
        floor = knobs.min_stream_tokens_per_s
        log.info("elastic slots %s: %d..%d active slots; memory limit %.2f GiB (%s); shrink at memory %.0f%%, "
                 "KV %.0f%%, %s; refuse new jobs at memory %.0f%%",
                 "on" if knobs.elastic else "off (fixed slots)", knobs.min_slots, engine.config.slots,
                 self.memory_limit.bytes / (1 << 30), self.memory_limit.source, knobs.memory_high * 100,
                 knobs.kv_high * 100, f"streams under {floor:g} tokens/s" if floor else "no decode-speed floor",
                 knobs.memory_refuse * 100)
        metrics.applied(self.controller.target_slots, self.controller.level)

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        while True:
            await self.tick()
            await asyncio.sleep(self.knobs.adapt_interval_s)

    async def tick(self) -> list[Change]:
        self.faults.hold_memory_ballast()
        stats = self.engine.stats()
        engine_pid = self.engine.pid if isinstance(self.engine, EngineProcess) else None
        running = self.runtime.running
        waiting = await self._waiting() if self.knobs.elastic and self.controller.reads_demand(running) else None
        obs = Observation(now=time.monotonic(), memory_used_bytes=worker_rss_bytes(engine_pid),
                          memory_limit_bytes=self.memory_limit.bytes, kv_ratio=stats.kv_active_ratio,
                          stream_tokens_per_s=self._stream_speed(stats), jobs_running=running, jobs_waiting=waiting)
        self.last = obs
        metrics.observed(obs)
        if not self.knobs.elastic:
            return []
        changes = self.controller.observe(obs)
        for change in changes:
            log.log(logging.WARNING if change.worsening else logging.INFO, "%s", change.describe())
            metrics.changed(change)
        if changes:
            self._apply(grew=any(c.kind == "slots" and c.new > c.old for c in changes))
        return changes

    async def _waiting(self) -> int:
        """Jobs waiting in this worker's lanes; 0 while Redis cannot say (no growth on a guess)."""
        try:
            return sum(c.waiting for c in await self.queue.counts())
        except (RedisError, OSError) as exc:
            log.debug("queue counts unavailable (%s); assuming nothing waits", exc)
            return 0

    def _stream_speed(self, stats: EngineStats) -> float | None:
        """Tokens per second of each generating stream since the last tick (None: nothing generated)."""
        mark = (stats.stream_tokens, stats.generating_seconds)
        before, self._speed_mark = self._speed_mark, mark
        if before is None or mark[0] <= before[0] or mark[1] <= before[1]:
            return None
        return (mark[0] - before[0]) / (mark[1] - before[1])

    def _apply(self, *, grew: bool) -> None:
        full = self.engine.full_limits
        target = self.controller.target_slots
        if self.controller.level >= Degradation.SMALL_BATCH:
            fraction = self.knobs.degraded_batch_fraction
            self.engine.set_limits(active_slots=target, n_batch=max(1, int(full.n_batch * fraction)),
                                   prefill_chunk=max(1, int(full.prefill_chunk * fraction)))
        else:
            self.engine.set_limits(active_slots=target, n_batch=full.n_batch, prefill_chunk=full.prefill_chunk)
        self.runtime.slots = target
        metrics.applied(target, self.controller.level)
        if grew or not self.accepting:
            self.runtime.nudge()

    # ------------------------------------------------------------------ what jobs and the worker read
    @property
    def accepting(self) -> bool:
        """False while refusing new jobs: the worker then claims nothing."""
        return self.controller.level < Degradation.REFUSE

    def verdict(self, *, max_tokens: int, resuming: bool) -> Verdict:
        why = "; ".join(self.controller.pressure.values()) or "pressure easing"
        v = verdict(self.controller.level, max_tokens=max_tokens, resuming=resuming,
                    cap_tokens=self.knobs.degraded_max_tokens, worker_id=self.worker_id, why=why)
        if v.refuse is not None:
            metrics.JOBS_REFUSED.inc()
        elif v.cap is not None:
            metrics.JOBS_CAPPED.inc()
        return v

    def heartbeat_fields(self) -> dict[str, str | int | float]:
        obs = self.last
        return {"slots_active": self.controller.target_slots, "degradation": self.controller.level.label,
                "memory_ratio": round(obs.memory_ratio, 3) if obs else 0.0,
                "stream_tokens_per_s": round(obs.stream_tokens_per_s or 0.0, 1) if obs else 0.0}
