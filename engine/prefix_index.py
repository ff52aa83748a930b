"""Which tokens each idle slot's KV still holds, and which slot a new sequence can start from.

A sequence that gives up its slot may leave its cells behind as an *idle cache*: the slot is free,
but its KV still holds the tokens the sequence computed, so a later sequence that starts with those
tokens reuses them instead of recomputing them (:mod:`slotq.engine.scheduler`, rule 4). The index
records, for each idle slot, those tokens, the order in which the slots went idle (least recently
used first: an idle cache is used only by being taken over, which ends it), and whether the
sequence that left was cancelled and may come back for its cells (rule 8).

A running sequence's KV is not recorded here: ``Sequence.tokens[:n_computed]`` already says what it
holds, and stays right through every decode and every rejected draft the runner removes from KV.
A copy of it here would have to follow each step. A lookup is handed the running slots' holdings
instead.

It is kept apart from the scheduler so that the policy reads as decisions (when a cache is kept,
which match is worth taking, which cache is evicted) and this as bookkeeping with tests of its own.
Pure Python: the runner's KV operations follow the scheduler's admissions and evictions, not this
module.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixMatch:
    """``slot``'s KV holds the first ``n_tokens`` tokens of the sequence looked up. ``idle``: the
    slot is an idle cache, which the sequence takes over, keeping the cells; otherwise a running
    sequence holds it, and the cells would be copied."""

    slot: int
    n_tokens: int
    idle: bool


class PrefixIndex:
    def __init__(self) -> None:
        self._held: dict[int, list[int]] = {}    # idle slot -> tokens its KV holds, least recently used first
        self._returning: set[int] = set()        # idle slots whose sequence was cancelled (it may come back)

    def __contains__(self, slot: object) -> bool:
        """Whether ``slot`` is an idle cache."""
        return slot in self._held

    def __len__(self) -> int:
        return len(self._held)

    def idle_slots(self) -> list[int]:
        """The idle caches, least recently used first (a new list: the caller may forget them as it goes)."""
        return list(self._held)

    def is_returning(self, slot: int) -> bool:
        """Whether ``slot`` is the idle cache of a cancelled sequence, which may come back for its cells."""
        return slot in self._returning

    def keep(self, slot: int, tokens: list[int], *, returning: bool = False) -> None:
        """A sequence left ``slot`` and its KV, which holds ``tokens``, stays as an idle cache, the most
        recently used. ``returning``: the sequence was cancelled and may come back for it."""
        self.forget(slot)
        self._held[slot] = tokens
        if returning:
            self._returning.add(slot)

    def forget(self, slot: int) -> None:
        """``slot`` is no idle cache any more: a sequence took it over, or its KV was evicted. A slot
        that was none is left as it is."""
        self._held.pop(slot, None)
        self._returning.discard(slot)

    def longest_match(self, tokens: list[int], *, at_most: int, running: Iterable[tuple[int, list[int]]],
                      min_running_tokens: int = 0) -> PrefixMatch | None:
        """The slot whose KV holds the longest prefix of ``tokens``, counting at most ``at_most`` of
        them; None when no slot holds even the first. ``running``: each running slot with the tokens
        its KV holds, in admission order; a running slot's match counts only when it is at least
        ``min_running_tokens`` long (copying its cells costs something).

        Among equal matches an idle cache wins over a running slot (taking it over copies nothing),
        and then the least recently used cache, or the running slot given first."""
        best: PrefixMatch | None = None
        for slot, held in running:
            n = common_prefix_length(held, tokens, at_most)
            if n >= min_running_tokens and n > (best.n_tokens if best else 0):
                best = PrefixMatch(slot, n, idle=False)
        for slot, held in self._held.items():
            n = common_prefix_length(held, tokens, at_most)
            if n > 0 and (best is None or n > best.n_tokens or (n == best.n_tokens and not best.idle)):
                best = PrefixMatch(slot, n, idle=True)
        return best


def common_prefix_length(a: list[int], b: list[int], at_most: int) -> int:
    """How many first tokens ``a`` and ``b`` share, counting at most ``at_most``."""
    n = min(len(a), len(b), at_most)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
