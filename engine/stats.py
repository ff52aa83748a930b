"""Engine counters (written by the engine thread) and the immutable snapshot readers get.

The engine thread owns every live structure (counters, scheduler, KV ledger). Once per loop
iteration it publishes a :class:`StatsSnapshot`, swapped in with one reference assignment, so a
reader on another thread (the worker's metrics and heartbeat) never iterates a structure the engine
thread is changing, and always sees one consistent moment. Publishing costs O(1) per step: the
values are counters kept as things happen (the KV ledger counts its cells as its segments change),
copied into a dict; the :class:`EngineStats` model is built from it only when someone reads it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from slotq.engine.events import FinishReason

if TYPE_CHECKING:
    from slotq.engine.scheduler import Scheduler


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
    generating_steps: int = 0         # steps in which at least one sequence generated a token
    generating_seconds: float = 0.0   # their wall time, sampling included
    stream_tokens: float = 0.0        # over those steps, the tokens each generating sequence got (mean per step)
    finish_reasons: Counter[str] = field(default_factory=Counter)
    spec: str = "off"                 # where drafts come from: off, ngram or draft (config.SpecMode)
    spec_draft_tokens: int = 0        # draft tokens decoded for verification
    spec_accepted_tokens: int = 0     # of those, the ones verification kept
    lora_switches: int = 0            # decodes run under another LoRA adapter set than the one before
    lora_switch_seconds: float = 0.0  # their llama_decode time (the graph reserved again included)
    _finished: dict[str, int] = field(default_factory=dict)    # finish_reasons as of the last finish (never mutated)

    def decoded(self, n_tokens: int, n_seqs: int, seconds: float) -> None:
        self.decode_steps += 1
        self.batch_tokens += n_tokens
        self.busy_slot_steps += n_seqs
        self.decode_seconds += seconds

    def generating_step(self, seconds: float, tokens_per_stream: float) -> None:
        self.generating_steps += 1
        self.generating_seconds += seconds
        self.stream_tokens += tokens_per_stream

    def finished(self, reason: FinishReason) -> None:
        self.finish_reasons[reason.value] += 1
        self._finished = dict(self.finish_reasons)      # a new dict per finish, not per step: snapshots share it

    def snapshot(self, scheduler: Scheduler, model: str) -> StatsSnapshot:
        """Engine thread only: the values of this moment, safe to hand to any thread. O(1): no
        structure is scanned and no model built (that waits for a reader)."""
        s = self.decode_steps
        limits = scheduler.limits
        kv_used = scheduler.ledger.used_cells()
        return StatsSnapshot(dict(
            model=model,
            slots_total=scheduler.config.n_slots,
            slots_active=limits.active_slots,
            slots_busy=len(scheduler.running),
            waiting=len(scheduler.waiting),
            decode_steps=s,
            prompt_tokens_processed=scheduler.prompt_tokens_computed,
            prompt_tokens_cached=scheduler.prompt_tokens_reused,
            generated_tokens=self.generated,
            kv_cells_used=kv_used,
            kv_cells_cached=kv_used - scheduler.ledger.active_cells(),
            kv_cells_total=scheduler.config.kv_cells,
            avg_busy_slots_per_decode=self.busy_slot_steps / s if s else 0.0,
            preemptions=scheduler.preemptions,
            kv_full_events=self.kv_full_events,
            decode_seconds=self.decode_seconds,
            generating_steps=self.generating_steps,
            generating_seconds=self.generating_seconds,
            stream_tokens=self.stream_tokens,
            batch_limit=limits.n_batch,
            prefill_chunk_limit=limits.prefill_chunk,
            finished=self._finished,
            spec=self.spec,
            spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
            lora_switches=self.lora_switches,
            lora_switch_seconds=self.lora_switch_seconds,
        ))


class StatsSnapshot:
    """One moment's values, published by the engine thread every step, and the :class:`EngineStats`
    they make, built on the first read (on the reader's thread: the values never change; two
    readers racing both build the same model)."""

    __slots__ = ("_stats", "_values")

    def __init__(self, values: dict[str, Any]) -> None:
        self._values = values
        self._stats: EngineStats | None = None

    @property
    def values(self) -> dict[str, Any]:
        """The raw values (plain numbers, strings and a dict): what an engine process sends its owner."""
        return self._values

    def stats(self) -> EngineStats:
        if self._stats is None:
            self._stats = EngineStats(**self._values)
        return self._stats


class EngineStats(BaseModel):
    """What the engine is doing, at one moment. Frozen: shared by every reader."""

    model_config = ConfigDict(frozen=True)

    model: str
    slots_total: int = Field(description="n_seq_max: the most sequences the context can hold")
    slots_active: int = Field(description="the runtime cap on sequences holding a slot (Engine.set_limits)")
    slots_busy: int
    waiting: int = Field(description="sequences waiting for a slot")
    decode_steps: int
    prompt_tokens_processed: int
    prompt_tokens_cached: int = Field(description="prompt tokens served from the prefix cache instead of computed")
    generated_tokens: int
    kv_cells_used: int = Field(description="cells referenced by any sequence, idle prefix caches included")
    kv_cells_cached: int = Field(description="cells only idle prefix caches hold: dropped as soon as space is needed")
    kv_cells_total: int
    avg_busy_slots_per_decode: float
    preemptions: int
    kv_full_events: int
    decode_seconds: float
    generating_steps: int = Field(description="steps in which at least one sequence generated a token")
    generating_seconds: float = Field(
        description="wall time of those steps: generating_steps / generating_seconds is how often a stream "
                    "gets tokens")
    stream_tokens: float = Field(
        0.0, description="tokens a generating sequence got per step (1 without speculative decoding), summed over "
                         "those steps: stream_tokens / generating_seconds is the decode speed of every stream")
    batch_limit: int = Field(description="token budget of one llama_decode now (<= n_batch)")
    prefill_chunk_limit: int = Field(description="prompt tokens of one sequence per step now (<= prefill_chunk)")
    finished: dict[str, int]
    spec: str = Field("off", description="speculative decoding's draft source: off, ngram or draft")
    spec_draft_tokens: int = Field(0, description="draft tokens decoded for verification")
    spec_accepted_tokens: int = Field(0, description="draft tokens verification kept (each one a step saved)")
    lora_switches: int = Field(0, description="decodes run under another LoRA adapter set than the one before "
                                             "(each makes llama.cpp reserve its graph again; scheduler rule 10)")
    lora_switch_seconds: float = Field(
        0.0, description="llama_decode time of those decodes (of decode_seconds): against decode_seconds / "
                         "decode_steps, what a switch costs")

    @property
    def spec_acceptance(self) -> float | None:
        """Accepted / drafted tokens; None before any draft was sent."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else None

    @property
    def kv_active_ratio(self) -> float:
        """KV cells held for running sequences / all cells (idle prefix caches do not count)."""
        return (self.kv_cells_used - self.kv_cells_cached) / self.kv_cells_total if self.kv_cells_total else 0.0
