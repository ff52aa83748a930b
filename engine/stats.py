"""Engine counters (written by the engine thread) and the snapshot the API returns."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pydantic import BaseModel, Field

from engine.events import FinishReason


@dataclass
class EngineCounters:
    """Plain integers updated only by the engine thread; readers take a snapshot."""

    decode_steps: int = 0
    batch_tokens: int = 0
    busy_slot_steps: int = 0          # sum over decode steps of sequences in the batch
    decode_seconds: float = 0.0
    generated: int = 0
    preemptions: int = 0
    kv_full_events: int = 0
    finish_reasons: Counter[str] = field(default_factory=Counter)

    def decoded(self, n_tokens: int, n_seqs: int, seconds: float) -> None:
        self.decode_steps += 1
        self.batch_tokens += n_tokens
        self.busy_slot_steps += n_seqs
        self.decode_seconds += seconds

    def finished(self, reason: FinishReason) -> None:
        self.finish_reasons[reason.value] += 1


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
