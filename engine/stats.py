"""Engine counters (written by the engine thread) and the immutable snapshot readers get.

The engine thread owns every live structure (counters, scheduler, KV ledger). Once per loop
iteration it publishes a :class:`StatsSnapshot`, a frozen object swapped in with one reference
assignment, so a reader on another thread (the worker's metrics and heartbeat) never iterates a
structure the engine thread is changing, and always sees one consistent moment. The pydantic
:class:`EngineStats` is built from it on read: readers get their own copy, and the engine thread
builds only a plain dataclass per step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from engine.events import FinishReason

if TYPE_CHECKING:
    from engine.scheduler import Scheduler


@dataclass
class EngineCounters:
    """Plain integers updated only by the engine thread; readers use :meth:`snapshot`'s result."""

    decode_steps: int = 0
    batch_tokens: int = 0
    busy_slot_steps: int = 0          # sum over decode steps of sequences in the batch
    decode_seconds: float = 0.0
    generated: int = 0
    preemptions: int = 0
    kv_full_events: int = 0
    finish_reasons: Counter[str] = field(default_factory=Counter)
    _finished_view: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}), repr=False)

    def decoded(self, n_tokens: int, n_seqs: int, seconds: float) -> None:
        self.decode_steps += 1
        self.batch_tokens += n_tokens
        self.busy_slot_steps += n_seqs
        self.decode_seconds += seconds

    def finished(self, reason: FinishReason) -> None:
        self.finish_reasons[reason.value] += 1
        self._finished_view = MappingProxyType(dict(self.finish_reasons))   # copied only when it changes

    def snapshot(self, scheduler: Scheduler, model: str) -> StatsSnapshot:
        """Engine thread only: the state of this moment, safe to hand to any thread."""
        s = self.decode_steps
        return StatsSnapshot(
            model=model,
            slots_total=scheduler.config.n_slots,
            slots_busy=len(scheduler.running),
            waiting=len(scheduler.waiting),
            decode_steps=s,
            prompt_tokens_processed=scheduler.prompt_tokens_computed,
            prompt_tokens_cached=scheduler.prompt_tokens_reused,
            generated_tokens=self.generated,
            kv_cells_used=scheduler.ledger.used_cells(),
            kv_cells_total=scheduler.config.kv_cells,
            avg_busy_slots_per_decode=self.busy_slot_steps / s if s else 0.0,
            preemptions=scheduler.preemptions,
            kv_full_events=self.kv_full_events,
            decode_seconds=self.decode_seconds,
            finished=self._finished_view,
        )


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    """Frozen: published by the engine thread, read by any thread. Same fields as EngineStats."""

    model: str
    slots_total: int
    slots_busy: int
    waiting: int
    decode_steps: int
    prompt_tokens_processed: int
    prompt_tokens_cached: int
    generated_tokens: int
    kv_cells_used: int
    kv_cells_total: int
    avg_busy_slots_per_decode: float
    preemptions: int
    kv_full_events: int
    decode_seconds: float
    finished: Mapping[str, int]

    def to_stats(self) -> EngineStats:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return EngineStats(**{**values, "finished": dict(self.finished)})


class EngineStats(BaseModel):
    model: str
    slots_total: int
    slots_busy: int
    waiting: int = Field(description="sequences waiting for a slot")
    decode_steps: int
    prompt_tokens_processed: int
    prompt_tokens_cached: int = Field(description="prompt tokens served from the prefix cache instead of computed")
    generated_tokens: int
    kv_cells_used: int
    kv_cells_total: int
    avg_busy_slots_per_decode: float
    preemptions: int
    kv_full_events: int
    decode_seconds: float
    finished: dict[str, int]
