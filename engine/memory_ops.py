"""The KV operations a :class:`~slotq.engine.scheduler.SchedulerOutput` asks for, on any KV cache.

The scheduler decides which cells each slot keeps, reuses or copies; these two functions carry
its decisions out with llama.cpp's two memory calls, in the order the KV ledger assumes. The
runner runs them on the llama_context (:class:`~slotq.engine.llama_model.LlamaModel`), the
scheduler tests' simulator on a fake cache, so the tests check the code that runs in production
rather than a copy of it.
"""

from __future__ import annotations

from typing import Protocol

from slotq.engine.scheduler import SchedulerOutput


class KVCache(Protocol):
    """The two memory calls the scheduler's plan needs (``LlamaModel`` is the real one)."""

    def kv_remove(self, seq_id: int, start: int = -1) -> None:
        """Drop ``seq_id``'s cells from position ``start`` on (-1: all of them)."""

    def kv_copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Give the empty ``dst`` ``src``'s cells for positions [0, n)."""


def apply_admissions(kv: KVCache, out: SchedulerOutput) -> None:
    """Before the decode: clear the prefix caches the scheduler evicted, then give each admitted
    slot its starting KV (its own cache cut to ``keep`` cells, then ``n_reused`` cells copied from
    ``copy_from``). Evictions go first: a sequence admitted in the same step may take the slot of a
    cache evicted in it, and must keep what it is given."""
    for seq_id in out.evicted_caches:
        kv.kv_remove(seq_id)
    for adm in out.admitted:
        slot = adm.seq.slot
        kv.kv_remove(slot, adm.keep if adm.keep > 0 else -1)
        if adm.copy_from is not None:
            kv.kv_copy_prefix(adm.copy_from, slot, adm.n_reused)


def apply_forks(kv: KVCache, out: SchedulerOutput) -> None:
    """After :meth:`~slotq.engine.scheduler.Scheduler.commit`: each fork's slot gets its leader's
    first ``n_tokens`` cells, which the decode just computed, in place of any partial reuse."""
    for fork in out.forks:
        kv.kv_remove(fork.seq.slot)
        kv.kv_copy_prefix(fork.leader.slot, fork.seq.slot, fork.n_tokens)
