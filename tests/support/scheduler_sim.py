"""The scheduler tests' simulator: ``Sim`` plays the runner's part. It executes the memory operations
with the runner's own code (:mod:`slotq.engine.memory_ops`) on a fake KV cache (cells holding
(position, token, {seq ids}), like llama.cpp's; one pool shared by all sequences, or one stream per
sequence when the scheduler's ``kv_stream_cells`` is set), "decodes" a batch by filling cells,
samples a deterministic token for every item that asks for one, commits, and finishes sequences
that reached their budget, in the order engine/runner.py does. No model: Sequence objects are built
by hand (``make_seq``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from slotq.engine.lora import AdapterSet
from slotq.engine.memory_ops import apply_admissions, apply_forks
from slotq.engine.scheduler import KVFullAction, Scheduler, SchedulerConfig, SchedulerOutput
from slotq.engine.sequence import SeqState, Sequence

_ids = itertools.count()


def make_seq(tokens: list[int] | int, max_new: int = 8, *, priority: int = 0, priority_class: int = 0,
             lent_reserve: bool = False, request_id: str | None = None, fork_of: Sequence | None = None,
             adapters: AdapterSet = ()) -> Sequence:
    if isinstance(tokens, int):
        tokens = [100_000 * (1 + next(_ids)) + i for i in range(tokens)]   # distinct per sequence
    return Sequence(request_id=request_id or f"r{next(_ids)}", tokens=list(tokens), n_prompt=len(tokens),
                    max_new_tokens=max_new, priority=priority, priority_class=priority_class,
                    lent_reserve=lent_reserve, fork_of=fork_of, adapters=adapters)


def config(**kw: Any) -> SchedulerConfig:
    return SchedulerConfig(**{"n_slots": 4, "n_batch": 64, "kv_cells": 100_000, "prefill_chunk": 16, **kw})


# ----------------------------------------------------------------------------- fake llama.cpp KV
@dataclass
class _Cell:
    pos: int
    token: int
    seqs: set[int]


@dataclass
class FakeKV:
    """A unified KV cache (a cell is used while any sequence references it), or with
    ``stream_capacity`` set, one stream of that many cells per sequence: a copy then duplicates
    cells into the destination's stream, as ``LlamaModel.kv_copy_prefix`` does across streams.
    Its two memory calls are those of :class:`slotq.engine.memory_ops.KVCache`."""

    capacity: int
    stream_capacity: int | None = None
    cells: list[_Cell] = field(default_factory=list)

    def kv_remove(self, seq_id: int, start: int = -1) -> None:
        start = max(start, 0)
        for c in self.cells:
            if seq_id in c.seqs and c.pos >= start:
                c.seqs.discard(seq_id)
        self.cells = [c for c in self.cells if c.seqs]

    def kv_copy_prefix(self, src: int, dst: int, n: int) -> None:
        if self.stream_capacity is not None:
            self.cells += [_Cell(c.pos, c.token, {dst}) for c in self.cells if src in c.seqs and c.pos < n]
            return
        for c in self.cells:
            if src in c.seqs and c.pos < n:
                c.seqs.add(dst)

    def decode(self, entries: list[tuple[int, int, int]]) -> int:
        """entries: (seq_id, pos, token). 1 = no room (nothing changes), like llama_decode."""
        if len(self.cells) + len(entries) > self.capacity:
            return 1
        if self.stream_capacity is not None:
            for seq_id in {e[0] for e in entries}:
                if len(self.content(seq_id)) + sum(e[0] == seq_id for e in entries) > self.stream_capacity:
                    return 1
        for seq_id, pos, token in entries:
            assert not any(seq_id in c.seqs and c.pos == pos for c in self.cells), f"seq {seq_id} pos {pos} twice"
            self.cells.append(_Cell(pos, token, {seq_id}))
        return 0

    def content(self, seq_id: int) -> list[tuple[int, int]]:
        return sorted((c.pos, c.token) for c in self.cells if seq_id in c.seqs)


def sampled_token(seq: Sequence) -> int:
    """Deterministic 'sampling': depends only on the request, the choice and the position."""
    return hash((seq.request_id, seq.choice, len(seq.tokens))) % 90_000 + 10_000


class Sim:
    """The runner's side of the contract, on a FakeKV."""

    def __init__(self, sched: Scheduler, kv: FakeKV | None = None) -> None:
        self.s = sched
        self.kv = kv or FakeKV(sched.config.kv_cells, sched.config.kv_stream_cells)
        self.actions: list[KVFullAction] = []
        self.finished: list[Sequence] = []

    def step(self) -> SchedulerOutput:
        out = self.s.schedule()
        apply_admissions(self.kv, out)
        self.check()
        if not out.items:
            return out
        assert out.n_tokens <= self.s.config.n_batch
        entries = [(i.seq.slot, i.start + j, i.seq.tokens[i.start + j]) for i in out.items for j in range(i.n_tokens)]
        if self.kv.decode(entries) == 1:
            action = self.s.on_kv_full(out)
            self.actions.append(action)
            if action == KVFullAction.STUCK:
                for item in out.items:
                    self.finish(item.seq, reusable=False)
            return out
        self.s.commit(out)
        apply_forks(self.kv, out)
        to_sample = [i.seq for i in out.items if i.sample]
        to_sample += [fork.seq for fork in out.forks if fork.seq.n_pending == 0]
        self.check()
        for seq in to_sample:
            if seq.state != SeqState.RUNNING:
                continue
            seq.tokens.append(sampled_token(seq))
            if seq.n_generated >= seq.max_new_tokens:
                self.finish(seq)
        return out

    def generating(self, n: int) -> list[Sequence]:
        """Add ``n`` short sequences and step until each has generated a token (all decoding)."""
        seqs = [make_seq(2, max_new=50) for _ in range(n)]
        for q in seqs:
            self.s.add(q)
        while any(q.n_generated == 0 for q in seqs):
            self.step()
        return seqs

    def finish(self, seq: Sequence, reusable: bool = True, cancelled: bool = False) -> None:
        self.s.finish(seq, reusable=reusable, cancelled=cancelled)
        self.finished.append(seq)

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.s.running and not self.s.waiting:
                self.step()                      # lets the runner side clear released slots
                return
            self.step()
        raise AssertionError("the scheduler did not drain its work")

    def check(self) -> None:
        """Called where the runner has executed every memory operation the scheduler asked for
        (after schedule + memory ops, and after a committed decode): the ledger mirrors the fake
        KV, and every running sequence's KV holds exactly its
        first n_computed tokens at positions 0..n_computed-1."""
        assert self.s.ledger.used_cells() == len(self.kv.cells)
        for seq in self.s.running:
            assert seq.seq_id is not None
            assert self.kv.content(seq.seq_id) == [(p, seq.tokens[p]) for p in range(seq.n_computed)], seq

