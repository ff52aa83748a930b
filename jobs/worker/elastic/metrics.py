"""Prometheus metrics of the elastic worker (same registry as jobs/worker/metrics.py, same /metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from slotq.jobs.worker.elastic.controller import Change, Degradation, Observation

SLOTS_ACTIVE = Gauge("slotq_slots_active",
                     "Active slots: the most sequences this worker runs now (<= slotq_slots_total)")
SLOT_CHANGES = Counter("slotq_slot_changes", "Changes of the active slot count", ["direction", "cause"])
DEGRADATION_LEVEL = Gauge("slotq_degradation_level",
                          "Degradation step in force: 0 none, 1 small batch, 2 max_tokens cap, 3 refusing new jobs")
DEGRADATION_STEP = Gauge("slotq_degradation_step", "1 while this degradation step is in force", ["step"])
DEGRADATION_CHANGES = Counter("slotq_degradation_changes", "Degradation steps taken (up) and undone (down)",
                              ["direction"])
MEMORY_USED = Gauge("slotq_memory_used_bytes", "Resident memory of the worker process")
MEMORY_LIMIT = Gauge("slotq_memory_limit_bytes", "Memory limit the worker adapts to (setting, cgroup or RAM)")
MEMORY_RATIO = Gauge("slotq_memory_usage_ratio", "slotq_memory_used_bytes / slotq_memory_limit_bytes")
STREAM_SPEED = Gauge("slotq_stream_decode_tokens_per_second",
                     "Decode speed of each generating stream over the last observation (0 when none generated)")
JOBS_REFUSED = Counter("slotq_jobs_refused", "Jobs handed back unstarted because the worker was refusing new jobs")
JOBS_CAPPED = Counter("slotq_jobs_max_tokens_capped", "Jobs whose max_tokens was capped by degradation")
WORKER_READY = Gauge("slotq_worker_ready", "1 once the worker has warmed up and may claim jobs")
LOOP_RESTARTS = Counter("slotq_background_loop_restarts", "Background loops restarted after a failure", ["loop"])


def observed(obs: Observation) -> None:
    MEMORY_USED.set(obs.memory_used_bytes)
    MEMORY_LIMIT.set(obs.memory_limit_bytes)
    MEMORY_RATIO.set(obs.memory_ratio)
    STREAM_SPEED.set(obs.stream_tokens_per_s or 0.0)


def applied(target_slots: int, level: Degradation) -> None:
    SLOTS_ACTIVE.set(target_slots)
    DEGRADATION_LEVEL.set(int(level))
    for step in Degradation:
        if step != Degradation.NONE:
            DEGRADATION_STEP.labels(step=step.label).set(1 if level >= step else 0)


def changed(change: Change) -> None:
    direction = "up" if change.new > change.old else "down"
    if change.kind == "slots":
        SLOT_CHANGES.labels(direction=direction, cause=change.cause).inc()
    else:
        DEGRADATION_CHANGES.labels(direction=direction).inc()
