"""The elastic worker's settings: one definition, inherited by :class:`slotq.jobs.worker.settings.WorkerSettings`
(so each field is a ``SLOTQ_<NAME>`` variable and a ``slotq worker --<name>`` flag)."""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator


class ElasticKnobs(BaseModel):
    """Thresholds of the slot controller and the degradation steps (see jobs/worker/elastic/controller.py).

    Ratios are of a limit: memory is the worker's resident set against ``memory_limit_mb`` (unset:
    the container's cgroup limit, else the machine's RAM); KV is the cells running sequences hold
    (idle prefix caches excluded) against the whole cache.
    """

    elastic: bool = Field(True, description="adapt active slots and degrade under pressure; off = fixed slots")
    min_slots: int = Field(1, ge=1, le=256, description="active slots never go below this (the maximum is slots)")
    adapt_interval_s: float = Field(1.0, gt=0, le=60, description="how often the worker observes and decides")
    adapt_cooldown_s: float = Field(3.0, ge=0, le=600, description="at least this long between two slot changes")
    memory_limit_mb: int | None = Field(
        None, ge=16, description="memory the worker may use; unset = the cgroup (container) limit, else physical RAM")
    memory_high: float = Field(0.80, gt=0, le=1, description="memory ratio at or above which slots shrink")
    memory_low: float = Field(0.70, gt=0, le=1, description="memory ratio below which slots may grow again")
    memory_refuse: float = Field(0.92, gt=0, le=1,
                                 description="memory ratio at or above which new jobs are refused (they go back to "
                                             "the queue for another worker) before memory runs out")
    kv_high: float = Field(0.90, gt=0, le=1, description="KV use at or above which, held kv_high_for_s, slots shrink")
    kv_low: float = Field(0.70, gt=0, le=1, description="KV use below which slots may grow again")
    kv_high_for_s: float = Field(10.0, ge=0, description="how long KV use must stay high before it counts")
    min_stream_tokens_per_s: float = Field(
        1.0, ge=0, description="per-stream decode speed below which slots shrink (every stream too slow); 0 = off")
    degrade_after_s: float = Field(
        10.0, ge=0, description="pressure held this long at min_slots takes the next degradation step")
    recover_after_s: float = Field(10.0, ge=0, description="pressure gone this long undoes one degradation step")
    degraded_batch_fraction: float = Field(
        0.25, gt=0, lt=1, description="degradation step 1: batch and prefill chunk shrink to this fraction")
    degraded_max_tokens: int = Field(
        256, ge=1, description="degradation step 2: max_tokens of new jobs is capped at this (the result says so)")

    @model_validator(mode="after")
    def _ordered(self) -> ElasticKnobs:
        if not self.memory_low <= self.memory_high <= self.memory_refuse:
            raise ValueError(f"need memory_low ({self.memory_low}) <= memory_high ({self.memory_high}) <= "
                             f"memory_refuse ({self.memory_refuse})")
        slots = getattr(self, "slots", None)       # set when mixed into WorkerSettings with EngineKnobs
        if slots is not None and self.min_slots > slots:
            raise ValueError(f"min_slots ({self.min_slots}) must be <= slots ({slots})")
        if self.kv_low > self.kv_high:
            raise ValueError(f"need kv_low ({self.kv_low}) <= kv_high ({self.kv_high})")
        return self
