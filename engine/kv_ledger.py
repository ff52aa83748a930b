"""Python-side bookkeeping of the KV cache: which cells each sequence references.

llama.cpp's unified KV cache shares cells between sequences after ``llama_memory_seq_cp``; a cell
is free only when no sequence references it. llama.cpp does not expose the used-cell count any
more, and admission needs it, so the ledger mirrors every memory operation the runner performs.
Each sequence's KV is a list of segments; a segment is a prefix of a *block* of cells created by
one decode. Copies share blocks, so the used count is the sum over blocks of the longest prefix
any sequence still references.

With one KV stream per sequence (``shared_copies=False``) a copy duplicates the cells into the
destination's own stream, so a copied prefix is a new block that the destination owns.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass


@dataclass
class _Segment:
    block: int
    length: int


class _BlockRefs:
    """How many segments reference each length of each block, and the cells that makes: the sum
    over blocks of the longest reference, kept as references come and go (a block's longest is
    a max over its distinct lengths, one per sequence sharing it at most)."""

    def __init__(self) -> None:
        self._lengths: dict[int, Counter[int]] = {}
        self.cells = 0

    def longest(self, block: int) -> int:
        lengths = self._lengths.get(block)
        return max(lengths) if lengths else 0

    def add(self, seg: _Segment) -> None:
        before = self.longest(seg.block)
        self._lengths.setdefault(seg.block, Counter())[seg.length] += 1
        self.cells += max(seg.length - before, 0)

    def discard(self, seg: _Segment) -> None:
        before = self.longest(seg.block)
        lengths = self._lengths[seg.block]
        lengths[seg.length] -= 1
        if not lengths[seg.length]:
            del lengths[seg.length]
        if not lengths:
            del self._lengths[seg.block]
        self.cells -= before - self.longest(seg.block)

    def __contains__(self, block: int) -> bool:
        return block in self._lengths


class KVLedger:
    """The used cells are counted as the segments change (:class:`_BlockRefs`), so reading them
    costs nothing per step, also for the cells only parked sequences (idle prefix caches) hold."""

    def __init__(self, *, shared_copies: bool = True) -> None:
        self.shared_copies = shared_copies
        self._segments: dict[int, list[_Segment]] = {}
        self._block_ids = itertools.count()
        self._block_owner: dict[int, int] = {}   # block -> seq that created it (may extend it)
        self._all = _BlockRefs()                 # every sequence's references
        self._active = _BlockRefs()              # those of the sequences not parked
        self._parked: set[int] = set()

    def length(self, seq_id: int) -> int:
        return sum(s.length for s in self._segments.get(seq_id, ()))

    def extend(self, seq_id: int, n: int) -> None:
        """``n`` new cells were decoded for ``seq_id`` at its next positions."""
        if n <= 0:
            return
        segs = self._segments.setdefault(seq_id, [])
        last = segs[-1] if segs else None
        if last is not None and self._block_owner.get(last.block) == seq_id and self._is_block_tail(last):
            grown = segs[-1] = _Segment(last.block, last.length + n)
            self._reference(seq_id, grown)          # before the old reference goes: the block stays owned
            self._unreference(seq_id, last)
            return
        block = next(self._block_ids)
        self._block_owner[block] = seq_id
        segs.append(_Segment(block, n))
        self._reference(seq_id, segs[-1])

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """``LlamaModel.kv_copy_prefix(src, dst, n)`` on an empty ``dst``: share src's first n cells
        (unified), or hold a copy of them (split)."""
        if not self.shared_copies:
            self._replace(dst, [])
            self.extend(dst, min(n, self.length(src)))
            return
        out: list[_Segment] = []
        left = n
        for seg in self._segments.get(src, ()):
            if left <= 0:
                break
            take = min(seg.length, left)
            out.append(_Segment(seg.block, take))
            left -= take
        self._replace(dst, out)

    def truncate(self, seq_id: int, n: int) -> None:
        """``llama_memory_seq_rm(seq_id, n, -1)``: keep only the first n positions."""
        kept: list[_Segment] = []
        left = n
        for seg in self._segments.get(seq_id, ()):
            if left <= 0:
                break
            kept.append(_Segment(seg.block, min(seg.length, left)))
            left -= seg.length
        self._replace(seq_id, kept)

    def remove(self, seq_id: int) -> None:
        """``seq_id`` holds no cells any more (and is not parked)."""
        self.truncate(seq_id, 0)
        self._parked.discard(seq_id)

    def park(self, seq_id: int, parked: bool = True) -> None:
        """Count ``seq_id``'s cells as parked (an idle prefix cache, evicted first), or not any more."""
        if parked == (seq_id in self._parked):
            return
        for seg in self._segments.get(seq_id, ()):
            if parked:
                self._active.discard(seg)
            else:
                self._active.add(seg)
        if parked:
            self._parked.add(seq_id)
        else:
            self._parked.discard(seq_id)

    def used_cells(self) -> int:
        """Cells referenced by any sequence."""
        return self._all.cells

    def active_cells(self) -> int:
        """Cells referenced by a sequence that is not parked."""
        return self._active.cells

    def _replace(self, seq_id: int, segs: list[_Segment]) -> None:
        for seg in self._segments.pop(seq_id, ()):
            self._unreference(seq_id, seg)
        if segs:
            self._segments[seq_id] = segs
            for seg in segs:
                self._reference(seq_id, seg)

    def _reference(self, seq_id: int, seg: _Segment) -> None:
        self._all.add(seg)
        if seq_id not in self._parked:
            self._active.add(seg)

    def _unreference(self, seq_id: int, seg: _Segment) -> None:
        self._all.discard(seg)
        if seq_id not in self._parked:
            self._active.discard(seg)
        if seg.block not in self._all:
            self._block_owner.pop(seg.block, None)      # no sequence references it any more

    def _is_block_tail(self, seg: _Segment) -> bool:
        """True when no other sequence references cells of this block beyond ``seg``."""
        return self._all.longest(seg.block) <= seg.length
