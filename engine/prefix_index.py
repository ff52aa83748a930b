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

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

BLOCK_TOKENS = 16       # tokens per hashed block: a lookup walks a 2k-token prompt in 128 hashes


@dataclass(frozen=True)
class PrefixMatch:
    """``slot``'s KV holds the first ``n_tokens`` tokens of the sequence looked up. ``idle``: the
    slot is an idle cache, which the sequence takes over, keeping the cells; otherwise a running
    sequence holds it, and the cells would be copied."""

    slot: int
    n_tokens: int
    idle: bool


class BlockHashes:
    """Chained hashes of a token list's full blocks, as vLLM keys its prefix cache: block ``i``'s
    hash covers ``(hash of block i - 1, tokens of block i)``, so two lists agree on their first
    ``i + 1`` blocks exactly when (barring a collision, which :meth:`PrefixIndex.longest_match`
    checks for) their ``i``-th hashes are equal, and the number of shared blocks is found by a
    binary search instead of a comparison of every token. It follows a list that only grows (a
    sequence's tokens are appended to, never changed), hashing each block once, when it is full."""

    __slots__ = ("block", "hashes", "tokens")

    def __init__(self, tokens: list[int], block: int) -> None:
        self.tokens = tokens
        self.block = block
        self.hashes: list[int] = []

    def update(self, n_tokens: int) -> list[int]:
        """The hashes of the full blocks of the first ``n_tokens`` tokens (hashing any not yet done)."""
        b, tokens, hashes = self.block, self.tokens, self.hashes
        parent = hashes[-1] if hashes else 0
        for start in range(len(hashes) * b, min(n_tokens, len(tokens)) - b + 1, b):
            parent = block_hash(parent, tokens[start:start + b])
            hashes.append(parent)
        return hashes


def block_hash(parent: int, block: list[int]) -> int:
    """One block's chained hash (Python's own tuple hash: a lookup verifies what it finds)."""
    return hash((parent, *block))


@dataclass
class _Holder:
    """A slot whose KV holds ``tokens[:n_held]``, and those tokens' block hashes."""

    slot: int
    idle: bool
    tokens: list[int]
    n_held: int
    chain: BlockHashes


class PrefixIndex:
    """``block_tokens``: the tokens per hashed block (any size gives the same matches; a small one
    hashes more, a large one compares more tokens one by one past the last shared block)."""

    def __init__(self, block_tokens: int = BLOCK_TOKENS) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens: must be at least 1, got {block_tokens}")
        self._block = block_tokens
        self._held: dict[int, BlockHashes] = {}     # idle slot -> the tokens its KV holds, least recently used first
        self._returning: set[int] = set()           # idle slots whose sequence was cancelled (it may come back)
        self._namespaces: dict[int, Hashable] = {}  # idle slot -> what else its KV depends on (LoRA adapters)
        self._running: dict[int, BlockHashes] = {}  # running slot -> its tokens' hashes, kept from lookup to lookup
        self._query: BlockHashes | None = None      # the last lookup's: its sequence is likely admitted next

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

    def keep(self, slot: int, tokens: list[int], *, returning: bool = False, namespace: Hashable = ()) -> None:
        """A sequence left ``slot`` and its KV, which holds ``tokens``, stays as an idle cache, the most
        recently used. ``returning``: the sequence was cancelled and may come back for it.
        ``namespace``: what else its cells depend on (the LoRA adapters they were computed under):
        a lookup in another namespace never matches it."""
        self.forget(slot)
        self._namespaces[slot] = namespace
        chain = self._held[slot] = BlockHashes(tokens, self._block)
        running = self._running.get(slot)
        if running is not None and running.tokens[:len(tokens)] == tokens:     # the sequence that ran there
            chain.hashes = running.hashes[:len(tokens) // self._block]
        chain.update(len(tokens))
        if returning:
            self._returning.add(slot)

    def forget(self, slot: int) -> None:
        """``slot`` is no idle cache any more: a sequence took it over, or its KV was evicted. A slot
        that was none is left as it is."""
        self._held.pop(slot, None)
        self._returning.discard(slot)
        self._namespaces.pop(slot, None)

    def longest_match(self, tokens: list[int], *, at_most: int, running: Iterable[tuple[int, list[int], int]],
                      min_running_tokens: int = 0, namespace: Hashable = ()) -> PrefixMatch | None:
        """The slot whose KV holds the longest prefix of ``tokens``, counting at most ``at_most`` of
        them; None when no slot holds even the first. ``running``: each running slot with its
        sequence's tokens and how many of them its KV holds (``n_computed``), in admission order;
        a running slot's match counts only when it is at least ``min_running_tokens`` long
        (copying its cells costs something). Only idle caches kept under ``namespace`` match (a
        running slot of another namespace is given with 0 cells held).

        Among equal matches an idle cache wins over a running slot (taking it over copies nothing),
        and then the least recently used cache, or the running slot given first."""
        holders = self._running_holders(running)
        holders += [_Holder(slot, True, chain.tokens, len(chain.tokens), chain) for slot, chain in self._held.items()
                    if self._namespaces[slot] == namespace]
        return self._best(tokens, at_most, holders, min_running_tokens)

    def longest_running_match(self, tokens: list[int], *, at_most: int,
                              running: Iterable[tuple[int, list[int], int]]) -> PrefixMatch | None:
        """:meth:`longest_match` among the ``running`` slots alone, whatever their KV holds yet:
        which running sequence will hold the longest prefix of ``tokens`` once it has computed
        the first ``n`` tokens given with it (the first given wins a tie)."""
        return self._best(tokens, at_most, self._running_holders(running), 0)

    def _running_holders(self, running: Iterable[tuple[int, list[int], int]]) -> list[_Holder]:
        """The running slots as holders, each with its tokens' hashes: those of the last lookup when
        the slot still runs the same token list (hashing only its blocks filled since), those made
        when the sequence was looked up for its admission, or new ones. Slots not given are forgotten."""
        kept, self._running = self._running, {}
        holders = []
        for slot, tokens, n_held in running:
            chain = kept.get(slot)
            if chain is None or chain.tokens is not tokens:
                chain = self._query if self._query is not None and self._query.tokens is tokens \
                    else BlockHashes(tokens, self._block)
            self._running[slot] = chain
            holders.append(_Holder(slot, False, tokens, n_held, chain))
        return holders

    def _best(self, tokens: list[int], at_most: int, holders: list[_Holder],
              min_running_tokens: int) -> PrefixMatch | None:
        """The best of ``holders`` (running ones first, in order, then idle ones, least recently
        used first) by the rules of :meth:`longest_match`. Each holder's shared length is its
        shared blocks (a binary search of its hashes against the query's) plus the tokens shared
        past them; the winner's blocks are then compared token by token (a list comparison, in C),
        and should two blocks have hashes that collide, every holder is measured token by token."""
        at_most = min(at_most, len(tokens))
        if at_most <= 0 or not holders:
            return None
        if self._query is None or self._query.tokens is not tokens:
            self._query = BlockHashes(tokens, self._block)
        query = self._query.update(at_most)[:at_most // self._block]
        best = self._pick(holders, min_running_tokens,
                          lambda holder: shared_length(holder, tokens, at_most, self._shared_blocks(holder, query)))
        if best is not None and best[1].tokens[:best[0].n_tokens] != tokens[:best[0].n_tokens]:   # a collision
            best = self._pick(holders, min_running_tokens, lambda holder: shared_length(holder, tokens, at_most, 0))
        return None if best is None else best[0]

    @staticmethod
    def _pick(holders: list[_Holder], min_running_tokens: int,
              length_of: Callable[[_Holder], int]) -> tuple[PrefixMatch, _Holder] | None:
        best: tuple[PrefixMatch, _Holder] | None = None
        for holder in holders:
            n = length_of(holder)
            top = best[0] if best else None
            if holder.idle:
                better = n > 0 and (top is None or n > top.n_tokens or (n == top.n_tokens and not top.idle))
            else:
                better = n >= min_running_tokens and n > (top.n_tokens if top else 0)
            if better:
                best = PrefixMatch(holder.slot, n, idle=holder.idle), holder
        return best

    def _shared_blocks(self, holder: _Holder, query: list[int]) -> int:
        """Tokens in the full blocks ``holder`` shares with the query, by their chained hashes."""
        hashes = holder.chain.update(holder.n_held)
        low, high = 0, min(len(query), len(hashes), holder.n_held // self._block)
        while low < high:                   # the first blocks agree, the rest do not: bisect for the boundary
            mid = (low + high + 1) // 2
            if hashes[mid - 1] == query[mid - 1]:
                low = mid
            else:
                high = mid - 1
        return low * self._block

def shared_length(holder: _Holder, tokens: list[int], at_most: int, start: int) -> int:
    """How many first tokens ``holder`` holds of ``tokens`` (at most ``at_most``), its first
    ``start`` being known to be shared."""
    return start + common_prefix_length(holder.tokens, tokens, min(at_most, holder.n_held), start=start)


def common_prefix_length(a: list[int], b: list[int], at_most: int, *, start: int = 0) -> int:
    """How many tokens ``a`` and ``b`` share from ``start`` on, counting at most ``at_most - start``."""
    n = min(len(a), len(b), at_most)
    for i in range(start, n):
        if a[i] != b[i]:
            return i - start
    return max(n - start, 0)
