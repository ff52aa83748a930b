"""Pure tests of the scheduling policy and the KV ledger: no model, Sequence objects built by hand.

``Sim`` plays the runner's part: it executes memory operations on a fake unified KV cache (cells
holding (position, token, {seq ids}), like llama.cpp's), "decodes" a batch by filling cells,
samples a deterministic token for every item that asks for one, commits, and finishes sequences
that reached their budget, exactly in the order engine/runner.py does.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kv_ledger import KVLedger
from engine.scheduler import BatchingMode, KVFullAction, Scheduler, SchedulerConfig, SchedulerOutput
from engine.sequence import Sequence, SeqState

_ids = itertools.count()


def make_seq(tokens: list[int] | int, max_new: int = 8, *, priority: int = 0, request_id: str | None = None,
             fork_of: Sequence | None = None) -> Sequence:
    if isinstance(tokens, int):
        tokens = [100_000 * (1 + next(_ids)) + i for i in range(tokens)]   # distinct per sequence
    return Sequence(request_id=request_id or f"r{next(_ids)}", tokens=list(tokens), n_prompt=len(tokens),
                    max_new_tokens=max_new, priority=priority, fork_of=fork_of)


def config(**kw: object) -> SchedulerConfig:
    base: dict[str, object] = {"n_slots": 4, "n_batch": 64, "kv_cells": 100_000, "prefill_chunk": 16}
    base.update(kw)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- fake llama.cpp KV
@dataclass
class _Cell:
    pos: int
    token: int
    seqs: set[int]


@dataclass
class FakeKV:
    """A unified KV cache: a cell is used while any sequence references it."""

    capacity: int
    cells: list[_Cell] = field(default_factory=list)

    def seq_rm(self, seq_id: int, p0: int = -1) -> None:
        p0 = max(p0, 0)
        for c in self.cells:
            if seq_id in c.seqs and c.pos >= p0:
                c.seqs.discard(seq_id)
        self.cells = [c for c in self.cells if c.seqs]

    def seq_cp(self, src: int, dst: int, n: int) -> None:
        for c in self.cells:
            if src in c.seqs and c.pos < n:
                c.seqs.add(dst)

    def decode(self, entries: list[tuple[int, int, int]]) -> int:
        """entries: (seq_id, pos, token). 1 = no room (nothing changes), like llama_decode."""
        if len(self.cells) + len(entries) > self.capacity:
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
        self.kv = kv or FakeKV(sched.config.kv_cells)
        self.actions: list[KVFullAction] = []
        self.finished: list[Sequence] = []

    def apply_memory_ops(self, out: SchedulerOutput) -> None:
        for seq_id in out.evicted_caches:
            self.kv.seq_rm(seq_id)
        for adm in out.admitted:
            slot = adm.seq.seq_id
            assert slot is not None
            self.kv.seq_rm(slot, adm.keep if adm.keep > 0 else -1)
            if adm.copy_from is not None:
                self.kv.seq_cp(adm.copy_from, slot, adm.n_reused)

    def step(self) -> SchedulerOutput:
        out = self.s.schedule()
        self.apply_memory_ops(out)
        self.check()
        if not out.items:
            return out
        assert out.n_tokens <= self.s.config.n_batch
        entries = [(i.seq.seq_id, i.start + j, i.seq.tokens[i.start + j]) for i in out.items for j in range(i.n_tokens)]
        if self.kv.decode(entries) == 1:
            action = self.s.on_kv_full(out)
            self.actions.append(action)
            if action == KVFullAction.STUCK:
                for item in out.items:
                    self.finish(item.seq, reusable=False)
            return out
        self.s.commit(out)
        to_sample = [i.seq for i in out.items if i.sample]
        for fork in out.forks:                   # as engine/runner.py: replace, then copy the prefix
            self.kv.seq_rm(fork.seq.seq_id)
            self.kv.seq_cp(fork.leader.seq_id, fork.seq.seq_id, fork.n_tokens)
            if fork.seq.n_pending == 0:
                to_sample.append(fork.seq)
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

    def finish(self, seq: Sequence, reusable: bool = True) -> None:
        self.s.finish(seq, reusable=reusable)
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


# ----------------------------------------------------------------------------- decode first
def test_decode_tokens_come_first_one_per_generating_sequence() -> None:
    s = Scheduler(config(n_slots=4, n_batch=8, prefill_chunk=8))
    sim = Sim(s)
    a, b = make_seq(3), make_seq(5)
    s.add(a)
    s.add(b)
    sim.step()                                   # both prompts fit: both sample once
    assert a.n_generated == b.n_generated == 1
    late = make_seq(40)
    s.add(late)
    out = s.schedule()
    decode = out.items[:2]
    assert {i.seq for i in decode} == {a, b}
    assert all(i.n_tokens == 1 and i.sample and i.start == i.seq.n_computed for i in decode)
    assert [i.seq for i in out.items[2:]] == [late]
    assert out.items[2].n_tokens == 8 - 2        # the prefill gets only what the decodes left
    assert not out.items[2].sample
    assert sum(1 for i in out.items if i.seq is a) == 1   # exactly one token per generating sequence


def test_decode_keeps_going_when_batch_is_full_of_prefill_demand() -> None:
    s = Scheduler(config(n_slots=4, n_batch=4, prefill_chunk=4))
    sim = Sim(s)
    gen = sim.generating(3)
    s.add(make_seq(30))
    for _ in range(5):
        before = {q: q.n_generated for q in gen}
        out = sim.step()
        assert out.n_tokens <= 4
        assert all(q.n_generated == before[q] + 1 for q in gen)


# ----------------------------------------------------------------------------- prefill budget
def test_prefill_respects_n_batch_and_prefill_chunk_oldest_first() -> None:
    s = Scheduler(config(n_slots=4, n_batch=32, prefill_chunk=12))
    seqs = [make_seq(50) for _ in range(4)]
    for q in seqs:
        s.add(q)
    out = s.schedule()
    assert [(i.seq, i.start, i.n_tokens, i.sample) for i in out.items] == [
        (seqs[0], 0, 12, False), (seqs[1], 0, 12, False), (seqs[2], 0, 8, False)]
    s.commit(out)
    out = s.schedule()
    assert [(i.seq, i.start, i.n_tokens) for i in out.items] == [(seqs[0], 12, 12), (seqs[1], 12, 12), (seqs[2], 8, 8)]


def test_prefill_samples_only_when_chunk_reaches_the_end() -> None:
    s = Scheduler(config(n_slots=1, n_batch=64, prefill_chunk=10))
    sim = Sim(s)
    q = make_seq(25)
    s.add(q)
    chunks = []
    while q.n_generated == 0:
        out = sim.step()
        chunks.append([(i.n_tokens, i.sample) for i in out.items])
    assert chunks == [[(10, False)], [(10, False)], [(5, True)]]
    assert s.prompt_tokens_computed == 25


# ----------------------------------------------------------------------------- admission
def test_admission_limited_by_free_slots() -> None:
    s = Scheduler(config(n_slots=2))
    sim = Sim(s)
    seqs = [make_seq(4, max_new=3) for _ in range(5)]
    for q in seqs:
        s.add(q)
    out = sim.step()
    assert [a.seq for a in out.admitted] == seqs[:2]
    assert len(s.running) == 2 and len(s.waiting) == 3 and s.n_free_slots == 0
    assert {q.seq_id for q in seqs[:2]} == {0, 1}
    s.finish(seqs[0])
    out = s.schedule()
    assert [a.seq for a in out.admitted] == [seqs[2]]
    assert seqs[2].seq_id == 0                       # the slot seqs[0] freed


def test_continuous_mode_admits_while_others_run() -> None:
    s = Scheduler(config(n_slots=4))
    sim = Sim(s)
    first = make_seq(4, max_new=20)
    s.add(first)
    sim.step()
    late = make_seq(4)
    s.add(late)
    out = s.schedule()
    assert [a.seq for a in out.admitted] == [late]


def test_static_mode_admits_nothing_while_anything_runs() -> None:
    s = Scheduler(config(n_slots=4, mode=BatchingMode.STATIC))
    sim = Sim(s)
    a, b = make_seq(4, max_new=3), make_seq(4, max_new=6)
    s.add(a)
    s.add(b)
    sim.step()
    assert set(s.running) == {a, b}
    late = make_seq(4)
    s.add(late)
    while b.state != SeqState.FINISHED:
        out = sim.step()
        assert late.state == SeqState.WAITING and not out.admitted, "static mode admitted into a running batch"
    assert a.state == SeqState.FINISHED
    out = sim.step()
    assert [x.seq for x in out.admitted] == [late]


def test_priority_then_arrival_order_of_admission() -> None:
    s = Scheduler(config(n_slots=1))
    sim = Sim(s)
    blocker = make_seq(2, max_new=2)
    s.add(blocker)
    sim.step()
    low, high, mid, high2 = make_seq(2, priority=-1), make_seq(2, priority=5), make_seq(2, priority=2), make_seq(2, priority=5)
    for q in (low, high, mid, high2):
        s.add(q)
    order = []
    for _ in range(200):
        out = sim.step()
        order += [a.seq for a in out.admitted]
        if not s.waiting and not s.running:
            break
    assert order == [high, high2, mid, low]


# ----------------------------------------------------------------------------- prefix reuse
def _leave_caches(s: Scheduler, *prompts: list[int]) -> list[Sequence]:
    """Run sequences (admitted together, so none reuses another) through prefill and one sampled
    token; their KV stays behind as idle caches in slots 0, 1, ..."""
    sim = Sim(s)
    seqs = [make_seq(p, max_new=1) for p in prompts]
    for q in seqs:
        s.add(q)
    sim.run()
    assert all(q.state == SeqState.FINISHED for q in seqs)
    return seqs


def test_prefix_reuse_picks_longest_common_prefix() -> None:
    s = Scheduler(config(n_slots=4, prefill_chunk=64))
    base = list(range(1, 41))
    _leave_caches(s, base[:10] + [999] * 10, base[:30] + [777], base[:20] + [555] * 3)
    assert s.ledger.used_cells() == 20 + 31 + 23
    q = make_seq(base + [5, 6, 7])
    s.add(q)
    out = s.schedule()
    (adm,) = out.admitted
    assert adm.n_reused == 30
    assert q.n_computed == 30 and q.n_reused == 30
    # The cache that holds the prefix is an idle slot: the sequence takes that slot and keeps
    # the shared cells instead of copying them.
    assert (q.seq_id, adm.keep, adm.copy_from) == (1, 30, None)
    assert [(i.start, i.n_tokens) for i in out.items] == [(30, len(q.tokens) - 30)]
    assert s.prompt_tokens_reused == 30
    assert s.ledger.used_cells() == 20 + 30 + 23       # slot 1 dropped its unshared tail


def test_prefix_reuse_copies_from_a_running_sequence() -> None:
    s = Scheduler(config(n_slots=4))
    sim = Sim(s)
    prompt = list(range(1, 21))
    a = make_seq(prompt + [50, 51], max_new=30)
    s.add(a)
    while a.n_generated == 0:
        sim.step()
    b = make_seq(prompt + [60])
    s.add(b)
    out = sim.step()
    (adm,) = out.admitted
    assert (adm.copy_from, adm.n_reused, adm.keep) == (a.seq_id, 20, 0)
    assert b.seq_id != a.seq_id
    sim.check()                                          # b's KV really holds the 20 shared tokens
    assert s.ledger.used_cells() == a.n_computed + (b.n_computed - 20)   # shared cells counted once


def test_prefix_reuse_is_capped_at_len_minus_one() -> None:
    s = Scheduler(config(n_slots=2))
    tokens = list(range(1, 31))
    _leave_caches(s, tokens + [42])                      # the cache holds these 31 prompt tokens
    q = make_seq(tokens)                                 # identical to the cache's first 30
    s.add(q)
    out = s.schedule()
    assert out.admitted[0].n_reused == len(tokens) - 1
    assert [(i.start, i.n_tokens, i.sample) for i in out.items] == [(29, 1, True)]


def test_prefix_cache_disabled_reuses_nothing() -> None:
    s = Scheduler(config(n_slots=2, prefix_cache=False))
    tokens = list(range(1, 31))
    _leave_caches(s, tokens)
    assert s.ledger.used_cells() == 0                    # no idle cache is kept
    q = make_seq(tokens + [3])
    s.add(q)
    out = s.schedule()
    assert out.admitted[0].n_reused == 0 and q.n_computed == 0


def test_waiting_for_a_running_prefill_copies_it_when_computed() -> None:
    s = Scheduler(config(n_slots=4, n_batch=64, prefill_chunk=32))
    sim = Sim(s)
    prefix = list(range(1, 101))
    a = make_seq(prefix + [500], max_new=3)
    s.add(a)
    sim.step()                                           # a has computed 32 of its 101 prompt tokens
    b = make_seq(prefix + [600], max_new=3)
    s.add(b)
    out = sim.step()
    assert [x.n_reused for x in out.admitted] == [32]   # what a holds now...
    assert b.fork_of is a                                # ...and it waits for the rest instead of computing it
    assert all(i.seq is not b for i in out.items)
    sim.run()                                            # (Sim.check verifies b's KV after the copy)
    assert b.n_reused == 100 and b.n_generated == a.n_generated == 3
    assert s.prompt_tokens_computed == 101 + 1           # the shared prefix was computed once


def test_reuse_counters_add_up_after_waiting_for_a_running_prefill() -> None:
    s = Scheduler(config(n_slots=4, n_batch=64, prefill_chunk=32))
    sim = Sim(s)
    prefix = list(range(1, 101))
    a = make_seq(prefix + [500], max_new=3)
    s.add(a)
    sim.step()
    b = make_seq(prefix + [600], max_new=3)
    s.add(b)
    sim.run()
    assert s.prompt_tokens_reused == a.n_reused + b.n_reused == 100
    assert s.prompt_tokens_reused + s.prompt_tokens_computed == 101 + 101


# ----------------------------------------------------------------------------- KV-aware admission
def test_admission_waits_when_kv_would_overflow() -> None:
    s = Scheduler(config(n_slots=4, kv_cells=100, prefix_cache=False))
    sim = Sim(s)
    a = make_seq(10, max_new=50)                         # worst case 60 cells
    b = make_seq(10, max_new=50)
    s.add(a)
    s.add(b)
    out = sim.step()
    assert [x.seq for x in out.admitted] == [a]
    assert b.state == SeqState.WAITING and s.n_free_slots == 3
    while a.state != SeqState.FINISHED:
        sim.step()
        assert b.state == SeqState.WAITING or a.state == SeqState.FINISHED
        assert s.ledger.used_cells() + s.kv_reserved() <= 100
    out = sim.step()
    assert [x.seq for x in out.admitted] == [b]


def test_admission_evicts_idle_caches_before_waiting() -> None:
    s = Scheduler(config(n_slots=4, kv_cells=100))
    sim = Sim(s)
    a = make_seq(10, max_new=50)
    s.add(a)
    sim.run()
    cache_slot = 0
    assert s.ledger.used_cells() == 59                   # a's prompt + 49 decoded tokens stay cached
    b = make_seq(10, max_new=50)                         # unrelated tokens: needs 60
    s.add(b)
    out = sim.step()
    assert [x.seq for x in out.admitted] == [b]
    assert out.evicted_caches == [cache_slot]
    sim.check()
    assert s.ledger.used_cells() == 10                   # only b's fresh prompt


def test_admission_keeps_caches_that_fit() -> None:
    s = Scheduler(config(n_slots=4, kv_cells=1000))
    sim = Sim(s)
    s.add(make_seq(10, max_new=5))
    sim.run()
    s.add(make_seq(10, max_new=5))
    out = sim.step()
    assert out.evicted_caches == []
    assert s.ledger.used_cells() == 14 + 10


# ----------------------------------------------------------------------------- KV full
def test_on_kv_full_order_evict_shrink_preempt_stuck() -> None:
    s = Scheduler(config(n_slots=4, n_batch=64, prefill_chunk=16, kv_overcommit=16.0))
    sim = Sim(s, FakeKV(capacity=10_000))
    s.add(make_seq(8, max_new=1))
    sim.run()                                           # leaves an idle cache
    old = make_seq(4, max_new=100)
    young = make_seq(4, max_new=100)
    s.add(old)
    s.add(young)
    sim.step()
    prefiller = make_seq(60, max_new=5)
    s.add(prefiller)

    out = s.schedule()
    assert s.on_kv_full(out) == KVFullAction.EVICTED_CACHE
    assert s.ledger.used_cells() == 8                    # the 8-cell cache is gone; old/young hold 4 each
    out = s.schedule()
    assert out.evicted_caches == [0]                     # ...and the runner is told to clear it
    chunks = []
    for _ in range(4):                                   # 16 -> 8 -> 4 -> 2 -> 1
        assert s.on_kv_full(out) == KVFullAction.SHRUNK_PREFILL
        out = s.schedule()
        chunks.append(next(i.n_tokens for i in out.items if i.seq is prefiller))
    assert chunks == [8, 4, 2, 1]
    assert s.on_kv_full(out) == KVFullAction.PREEMPTED
    assert prefiller.state == SeqState.WAITING           # the youngest goes
    assert old.state == young.state == SeqState.RUNNING
    assert s.kv_reserved() == old.kv_still_needed + young.kv_still_needed
    out = s.schedule()                                   # held back while the others run: no thrashing
    assert out.admitted == [] and prefiller.state == SeqState.WAITING
    s.finish(old)                                        # a finish lifts the hold
    out = s.schedule()                                   # re-admitted, still at the shrunk share
    assert [a.seq for a in out.admitted] == [prefiller]
    assert next(i.n_tokens for i in out.items if i.seq is prefiller) == 1
    s.commit(out)                                       # a successful decode restores the full share
    out = s.schedule()
    assert next(i.n_tokens for i in out.items if i.seq is prefiller) == 16

    s2 = Scheduler(config(n_slots=4))
    lone = make_seq(5)
    s2.add(lone)
    out = s2.schedule()
    s2.commit(out)
    lone.tokens.append(1)
    out = s2.schedule()                                  # decode only, no cache, one sequence
    assert s2.on_kv_full(out) == KVFullAction.STUCK
    assert lone.state == SeqState.RUNNING                # the runner fails it, not the scheduler


def test_preemption_victim_is_youngest_of_lowest_priority() -> None:
    s = Scheduler(config(n_slots=4))
    sim = Sim(s)
    low_old = make_seq(3, max_new=50)
    low_young = make_seq(3, max_new=50)
    vip_youngest = make_seq(3, max_new=50, priority=10)
    for q in (low_old, low_young, vip_youngest):
        s.add(q)
    sim.step()
    assert len(s.running) == 3
    out = s.schedule()
    assert s.on_kv_full(out) == KVFullAction.PREEMPTED
    assert low_young.state == SeqState.WAITING
    assert vip_youngest.state == low_old.state == SeqState.RUNNING


def test_preempted_sequence_keeps_tokens_and_resumes_from_scratch() -> None:
    s = Scheduler(config(n_slots=2, prefix_cache=False))
    sim = Sim(s)
    a = make_seq(6, max_new=20)
    b = make_seq(6, max_new=20)
    s.add(a)
    s.add(b)
    for _ in range(5):
        sim.step()
    tokens_before = list(b.tokens)
    generated_before = b.n_generated
    assert generated_before == 5
    out = s.schedule()
    assert s.on_kv_full(out) == KVFullAction.PREEMPTED
    assert b.state == SeqState.WAITING and b.seq_id is None
    assert (b.n_computed, b.preemptions, s.preemptions) == (0, 1, 1)
    assert b.tokens == tokens_before                    # progress is kept
    assert s.ledger.used_cells() == a.n_computed        # b's cells are released
    out = sim.step()                                    # b waits while a runs (no thrashing) ...
    assert all(i.seq is not b for i in out.items) and b.state == SeqState.WAITING
    while a.state != SeqState.FINISHED:
        sim.step()
    out = sim.step()                                    # ... then is re-admitted and prefills everything
    b_item = next(i for i in out.items if i.seq is b)
    assert (b_item.start, b_item.n_tokens, b_item.sample) == (0, len(tokens_before), True)
    assert b.tokens[: len(tokens_before)] == tokens_before
    assert b.n_generated == generated_before + 1        # generation continues where it stopped
    sim.run()
    assert a.n_generated == b.n_generated == 20


def test_overcommit_preemption_does_not_thrash() -> None:
    """Regression: with kv_overcommit > 1 and a really full pool, the youngest sequence was
    preempted, re-admitted by the very next schedule() (it "fits" under the overcommit) holding no
    KV of its own, preempted again, and so on: nothing ever progressed (~2000 preemptions in 2000
    steps with this exact workload before the fix)."""
    s = Scheduler(config(n_slots=3, n_batch=64, kv_cells=24, prefill_chunk=16, kv_overcommit=2.0))
    sim = Sim(s)
    seqs = [make_seq([1, 2, 3, 4, 100 + i], max_new=10) for i in range(3)]
    for q in seqs:
        s.add(q)
    sim.run(max_steps=2000)
    assert all(q.n_generated == 10 for q in seqs)
    assert 0 < s.preemptions < 20


# ----------------------------------------------------------------------------- forks (n > 1)
def test_forks_share_the_leaders_prompt() -> None:
    s = Scheduler(config(n_slots=4, prefill_chunk=32))
    sim = Sim(s)
    prompt = list(range(1, 21))
    leader = make_seq(prompt, max_new=5, request_id="n3")
    sibs = [make_seq(prompt, max_new=5, request_id="n3", fork_of=leader) for _ in range(2)]
    for i, q in enumerate([leader, *sibs]):
        q.choice = i
        s.add(q)
    out = sim.step()
    assert [i.seq for i in out.items] == [leader]        # only the leader prefills
    assert {f.seq for f in out.forks} == set(sibs) and all(f.leader is leader for f in out.forks)
    assert s.prompt_tokens_computed == 20 and s.prompt_tokens_reused == 40
    assert all(q.n_generated == 1 for q in [leader, *sibs])
    sim.check()
    sim.run()
    assert all(q.n_generated == 5 for q in [leader, *sibs])


# ----------------------------------------------------------------------------- KV ledger
def test_ledger_shared_prefixes() -> None:
    led = KVLedger()
    led.extend(0, 10)
    led.extend(0, 5)
    assert led.used_cells() == 15 and led.length(0) == 15
    led.copy_prefix(0, 1, 12)                            # seq 1 shares 12 of seq 0's cells
    assert led.used_cells() == 15 and led.length(1) == 12
    led.extend(1, 3)                                     # diverges: 3 new cells
    assert led.used_cells() == 18
    led.extend(0, 2)                                     # seq 0 keeps growing its own block
    assert led.used_cells() == 20
    led.truncate(0, 4)                                   # seq 0 keeps 4; seq 1 still holds 12 + 3
    assert led.used_cells() == 15 and led.length(0) == 4
    led.extend(0, 6)                                     # cannot grow into cells seq 1 references
    assert led.used_cells() == 21
    led.remove(1)
    assert led.used_cells() == 10                        # 4 shared survivors + 6 new
    led.remove(0)
    assert led.used_cells() == 0


def test_ledger_copy_of_a_copy_and_removing_the_source() -> None:
    led = KVLedger()
    led.extend(0, 8)
    led.copy_prefix(0, 1, 8)
    led.extend(1, 4)
    led.copy_prefix(1, 2, 10)                            # 8 from seq 0's block + 2 of seq 1's
    assert led.used_cells() == 12 and led.length(2) == 10
    led.remove(0)
    led.remove(1)
    assert led.used_cells() == 10                        # seq 2 still holds its 10 cells
    led.truncate(2, 3)
    assert led.used_cells() == 3


# ----------------------------------------------------------------------------- whole-policy property
@st.composite
def _workloads(draw: st.DrawFn) -> dict:
    n_slots = draw(st.integers(1, 4))
    prefixes = [[7000 + 100 * p + i for i in range(draw(st.integers(1, 12)))] for p in range(3)]
    reqs = []
    for r in range(draw(st.integers(1, 8))):
        prefix = draw(st.sampled_from(prefixes))
        tail = [9000 + r * 50 + i for i in range(draw(st.integers(0, 6)))]
        prompt = prefix + tail
        reqs.append({
            "prompt": prompt,
            "max_new": draw(st.integers(1, 12)),
            "n": draw(st.integers(1, min(2, n_slots))),
            "priority": draw(st.integers(0, 2)),
            "at": draw(st.integers(0, 15)),
        })
    need = max(len(r["prompt"]) + r["max_new"] for r in reqs)
    return {
        "n_slots": n_slots,
        "kv_cells": draw(st.integers(need, need * 3)),
        "prefill_chunk": draw(st.integers(1, 8)),
        "n_batch": draw(st.integers(n_slots, 16)),
        "prefix_cache": draw(st.booleans()),
        "overcommit": draw(st.sampled_from([1.0, 1.5, 3.0])),
        "mode": draw(st.sampled_from(list(BatchingMode))),
        "reqs": reqs,
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=_workloads())
def test_policy_property_everything_completes_and_ledger_mirrors_kv(w: dict) -> None:
    """Random arrivals, shared prefixes, n > 1, tight KV pools and overcommit: every sequence
    finishes with its full budget, the ledger always equals the fake KV's used cells, and every
    running sequence's KV holds exactly its tokens (so prefix reuse and preemption never corrupt
    what a sequence attends to)."""
    s = Scheduler(SchedulerConfig(n_slots=w["n_slots"], n_batch=w["n_batch"], kv_cells=w["kv_cells"],
                                  prefill_chunk=w["prefill_chunk"], mode=w["mode"], prefix_cache=w["prefix_cache"],
                                  kv_overcommit=w["overcommit"]))
    sim = Sim(s)
    all_seqs: list[Sequence] = []
    pending = sorted(enumerate(w["reqs"]), key=lambda x: x[1]["at"])
    for step in range(5000):
        while pending and pending[0][1]["at"] <= step:
            idx, r = pending.pop(0)
            leader = None
            for choice in range(r["n"]):
                q = make_seq(r["prompt"], max_new=r["max_new"], priority=r["priority"], request_id=f"req{idx}",
                             fork_of=leader)
                q.choice = choice
                leader = leader or q
                all_seqs.append(q)
                s.add(q)
        if not pending and not s.running and not s.waiting:
            break
        sim.step()
        assert len(s.running) <= w["n_slots"]
        assert s.ledger.used_cells() <= w["kv_cells"]
    else:
        raise AssertionError("did not drain")
    assert KVFullAction.STUCK not in sim.actions
    for q in all_seqs:
        assert q.state == SeqState.FINISHED
        assert q.n_generated == q.max_new_tokens, q
        # Tokens are a pure function of (request, choice, position): preemption changed nothing.
        for pos in range(q.n_prompt, len(q.tokens)):
            assert q.tokens[pos] == hash((q.request_id, q.choice, pos)) % 90_000 + 10_000
    sim.step()                                           # release the last finished slots
    if not w["prefix_cache"]:
        assert s.ledger.used_cells() == 0 and not sim.kv.cells
