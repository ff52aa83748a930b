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
from collections.abc import Collection
from dataclasses import dataclass


@dataclass
class _Segment:
    block: int
    length: int


class KVLedger:
    def __init__(self, *, shared_copies: bool = True) -> None:
        self.shared_copies = shared_copies
        self._segments: dict[int, list[_Segment]] = {}
        self._block_ids = itertools.count()
        self._block_owner: dict[int, int] = {}   # block -> seq that created it (may extend it)

    def length(self, seq_id: int) -> int:
        return sum(s.length for s in self._segments.get(seq_id, ()))

    def extend(self, seq_id: int, n: int) -> None:
        """``n`` new cells were decoded for ``seq_id`` at its next positions."""
        if n <= 0:
            return
        segs = self._segments.setdefault(seq_id, [])
        last = segs[-1] if segs else None
        if last is not None and self._block_owner.get(last.block) == seq_id and self._is_block_tail(last):
            last.length += n
            return
        block = next(self._block_ids)
        self._block_owner[block] = seq_id
        segs.append(_Segment(block, n))

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """``LlamaModel.kv_copy_prefix(src, dst, n)`` on an empty ``dst``: share src's first n cells
        (unified), or hold a copy of them (split)."""
        if not self.shared_copies:
            self._segments.pop(dst, None)
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
        self._segments[dst] = out

    def truncate(self, seq_id: int, n: int) -> None:
        """``llama_memory_seq_rm(seq_id, n, -1)``: keep only the first n positions."""
        kept: list[_Segment] = []
        left = n
        for seg in self._segments.get(seq_id, ()):
            if left <= 0:
                break
            kept.append(_Segment(seg.block, min(seg.length, left)))
            left -= seg.length
        if kept:
            self._segments[seq_id] = kept
        else:
            self._segments.pop(seq_id, None)
        self._forget_unreferenced_blocks()

    def remove(self, seq_id: int) -> None:
        self.truncate(seq_id, 0)

    def used_cells(self, exclude: Collection[int] = ()) -> int:
        """Cells referenced by any sequence (but those in ``exclude``)."""
        longest: dict[int, int] = {}
        for seq_id, segs in self._segments.items():
            if seq_id in exclude:
                continue
            for seg in segs:
                longest[seg.block] = max(longest.get(seg.block, 0), seg.length)
        return sum(longest.values())

    def _is_block_tail(self, seg: _Segment) -> bool:
        """True when no other sequence references cells of this block beyond ``seg``. Without shared
        copies no other sequence references a block at all: no scan (it is one per sequence per
        step, over every sequence's segments: 7 % of the engine thread at 256 slots)."""
        if not self.shared_copies:
            return True
        return all(s.length <= seg.length for segs in self._segments.values() for s in segs if s.block == seg.block)

    def _forget_unreferenced_blocks(self) -> None:
        live = {s.block for segs in self._segments.values() for s in segs}
        for block in list(self._block_owner):
            if block not in live:
                del self._block_owner[block]
