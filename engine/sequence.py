"""A sequence: one choice of one request, as the scheduler sees it.

The tokens list is the whole history the KV cache must hold: prompt (plus tokens delivered by an
earlier attempt) followed by what this attempt generated. ``n_computed`` says how much of it is
already in the KV cache. That single invariant makes prefill, decode, prefix reuse and preemption
the same operation: compute ``tokens[n_computed:]``, and sample when the end is reached. A
preempted sequence keeps its tokens and simply drops ``n_computed`` to 0.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from slotq.engine.lora import AdapterSet

_arrival_counter = itertools.count()


class SeqState(StrEnum):
    WAITING = "waiting"      # in the queue, no slot
    RUNNING = "running"      # holds a slot (prefilling or decoding)
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    tokens: list[int]
    n_prompt: int                    # tokens given as input (prompt + resumed tokens)
    max_new_tokens: int              # generation budget of this attempt
    choice: int = 0
    priority_class: int = 0          # compared before priority (the job layer's lane rank)
    priority: int = 0
    lent_reserve: bool = False       # may decode in the reserve though no lower class runs (scheduler rule 6)
    adapters: AdapterSet = ()        # the LoRA adapters it runs under (scheduler rule 10); () = the base model
    arrival: int = field(default_factory=lambda: next(_arrival_counter))
    state: SeqState = SeqState.WAITING
    seq_id: int | None = None
    n_computed: int = 0
    n_reused: int = 0                # prompt tokens whose KV came from the prefix cache
    fork_of: Sequence | None = None  # wait for this sequence to compute our first fork_len tokens, then copy its KV
    fork_len: int = 0
    preemptions: int = 0
    payload: Any = None              # the runner's per-sequence state (sampler, text stream, ...)

    def __post_init__(self) -> None:
        if self.fork_of is not None and self.fork_len == 0:
            self.fork_len = len(self.tokens)     # an n > 1 sibling: copy the whole prompt

    @property
    def slot(self) -> int:
        """The KV sequence id of a sequence that holds a slot (running). Asking a waiting or
        finished one is a bug: its KV operations would land on llama.cpp's sequence ``None``."""
        if self.seq_id is None:
            raise RuntimeError(f"request {self.request_id} choice {self.choice}: the sequence holds no slot")
        return self.seq_id

    @property
    def queue_order(self) -> tuple[int, int, int]:
        """Lower goes first: the higher priority class, then the higher priority, then the older.
        The waiting queue admits in this order, prefill serves it, KV-full preemption takes the last."""
        return -self.priority_class, -self.priority, self.arrival

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - self.n_prompt

    @property
    def n_pending(self) -> int:
        """Tokens that must go through llama_decode before the next sample."""
        return len(self.tokens) - self.n_computed

    @property
    def is_decoding(self) -> bool:
        return self.n_generated > 0 and self.n_pending == 1

    @property
    def kv_still_needed(self) -> int:
        """Cells this sequence will still add to the KV cache in the worst case."""
        return self.n_pending + max(0, self.max_new_tokens - self.n_generated - 1)
