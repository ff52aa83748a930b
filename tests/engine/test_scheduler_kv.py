"""Pure tests of the scheduler's KV side: prefix reuse across slots, KV-aware admission, what
happens when llama.cpp finds no KV space, forks (n > 1) sharing their leader's prompt, and the KV
ledger; no model (``scheduler_sim.Sim``
plays the runner on a fake unified KV cache).
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotq.engine.kv_ledger import KVLedger
from slotq.engine.scheduler import KVFullAction, Scheduler
from slotq.engine.sequence import SeqState, Sequence
from tests.support.scheduler_sim import FakeKV, Sim, config, make_seq


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


_seq = st.integers(0, 3)
_ledger_ops = st.lists(st.one_of(st.tuples(st.just("extend"), _seq, _seq, st.integers(1, 5)),
                                 st.tuples(st.just("copy"), _seq, _seq, st.integers(0, 12)),
                                 st.tuples(st.just("truncate"), _seq, _seq, st.integers(0, 12)),
                                 st.tuples(st.just("remove"), _seq, _seq, st.just(0)),
                                 st.tuples(st.just("park"), _seq, _seq, st.integers(0, 1))), max_size=30)


@settings(max_examples=300, deadline=None)
@given(ops=_ledger_ops, shared=st.booleans())
def test_ledger_counts_match_the_cells_each_sequence_holds(ops: list[tuple[str, int, int, int]], shared: bool) -> None:
    """The ledger's running counts against the cells themselves: each decoded cell a new id, a
    shared copy the same ids, a split copy new ones; used = all ids held, active = those held by
    a sequence not parked (an idle cache's cells are the difference)."""
    led = KVLedger(shared_copies=shared)
    cells: dict[int, list[int]] = {}
    parked: set[int] = set()
    new_ids = itertools.count()
    for op, seq, other, n in ops:
        if op == "extend":
            led.extend(seq, n)
            cells.setdefault(seq, []).extend(next(new_ids) for _ in range(n))
        elif op == "copy" and seq != other:
            led.remove(other)                            # a copy goes to an empty sequence
            parked.discard(other)
            led.copy_prefix(seq, other, n)
            held = cells.get(seq, [])[:n]
            cells[other] = list(held) if shared else [next(new_ids) for _ in held]
        elif op == "truncate":
            led.truncate(seq, n)
            cells[seq] = cells.get(seq, [])[:n]
        elif op == "remove":
            led.remove(seq)
            cells.pop(seq, None)
            parked.discard(seq)
        elif op == "park":
            led.park(seq, bool(n))
            (parked.add if n else parked.discard)(seq)
        assert led.used_cells() == len({c for held in cells.values() for c in held})
        assert led.active_cells() == len({c for s, held in cells.items() if s not in parked for c in held})
        assert all(led.length(s) == len(held) for s, held in cells.items())




# ----------------------------------------------------------------------------- cache slots
@pytest.mark.parametrize("cache_slots", [1, 0])
def test_a_handed_back_sequence_resumes_from_its_own_cells_when_a_cache_slot_is_spare(cache_slots: int) -> None:
    """Rule 7: a bulk sequence leaves its slot (its job handed back for an interactive one). With a
    cache slot the newcomer takes the spare, so the bulk job's cells survive and its resumed
    attempt reuses them all but the last token; without one the newcomer overwrites them."""
    s = Scheduler(config(n_slots=2, cache_slots=cache_slots, prefill_chunk=64))
    sim = Sim(s)
    bulk, other = make_seq(30, max_new=50), make_seq(30, max_new=50)
    s.add(bulk)
    s.add(other)
    while bulk.n_generated < 5:
        sim.step()
    bulk_slot = bulk.slot
    sim.finish(bulk, cancelled=True)                     # the worker cancels the handed-back attempt
    interactive = make_seq(10, max_new=3, priority_class=1)
    s.add(interactive)
    while interactive.state != SeqState.FINISHED:
        sim.step()
    assert len(s.running) <= s.limits.active_slots == 2
    resumed = make_seq(bulk.tokens[:34], max_new=46)     # prompt + the 4 tokens its stream holds
    s.add(resumed)
    sim.step()
    if cache_slots:
        assert interactive.seq_id is None and resumed.seq_id == bulk_slot and resumed.n_reused == 33
    else:
        assert resumed.n_reused == 0


# ----------------------------------------------------------------------------- which free slot (rule 8)
def _eight_running_with_a_spare(reserve_slots: int = 0) -> tuple[Scheduler, Sim, list[Sequence]]:
    """8 slots of their own KV streams plus one cache slot (the defaults' shape), all 8 decoding."""
    s = Scheduler(config(n_slots=8, cache_slots=1, reserve_slots=reserve_slots, n_batch=256, kv_cells=9 * 1000,
                         kv_stream_cells=1000))
    sim = Sim(s)
    seqs = sim.generating(8)
    assert sorted(q.slot for q in seqs) == list(range(8))
    return s, sim, seqs


def test_a_newcomer_fills_the_gap_a_finished_sequence_left_so_the_running_slots_stay_consecutive() -> None:
    """With a KV stream per slot llama.cpp runs each run of consecutive seq ids as a micro-batch of
    its own, so a gap costs every step an extra graph run (36 % slower steps at 8 slots on the
    bundled model). Before: the newcomer took the uncached spare at the end, and the gap stayed."""
    s, sim, seqs = _eight_running_with_a_spare()
    middle = next(q for q in seqs if q.slot == 3)
    sim.finish(middle)                                   # it ended by itself (its KV stays a cache)
    newcomer = make_seq(5, max_new=4)
    s.add(newcomer)
    sim.step()
    assert newcomer.slot == 3
    assert sorted(q.slot for q in s.running) == list(range(8))


def test_a_cancelled_sequences_cells_are_left_for_its_return_and_the_gap_closes_when_it_comes_back() -> None:
    """A job handed back for a higher lane is cancelled here and comes back for its cells: the
    newcomer takes the spare (a gap while it runs), and the returning sequence takes its own cache."""
    s, sim, seqs = _eight_running_with_a_spare()
    bulk = next(q for q in seqs if q.slot == 3)
    while bulk.n_generated < 40:                         # cells worth keeping: >= min_copy_tokens
        sim.step()
    sim.finish(bulk, cancelled=True)
    interactive = make_seq(5, max_new=2, priority_class=1)
    s.add(interactive)
    sim.step()
    assert interactive.slot == 8
    while interactive.state != SeqState.FINISHED:
        sim.step()
    resumed = make_seq(bulk.tokens[:-1], max_new=20)     # prompt + what its stream held
    s.add(resumed)
    sim.step()
    assert resumed.slot == 3 and resumed.n_reused == len(bulk.tokens) - 2
    assert sorted(q.slot for q in s.running) == list(range(8))


# ----------------------------------------------------------------------------- the reserve (rule 6)
def test_a_higher_class_decodes_in_the_reserve_beside_a_full_batch_of_a_lower_one() -> None:
    """Rule 6's reserve: with every slot held by class 0, a class 1 sequence is admitted at once
    into the spare stream, next to the running slots (one run of consecutive ids), and all nine
    decode in the next step. A second class 1 sequence finds the reserve taken and waits, and so
    does a class 0 one: the reserve is only for a class above a running one."""
    s, sim, seqs = _eight_running_with_a_spare(reserve_slots=1)
    interactive = make_seq(5, max_new=10, priority_class=1)
    s.add(interactive)
    sim.step()
    assert interactive.slot == 8 and interactive.n_computed == 5
    assert all(q.state == SeqState.RUNNING for q in seqs)
    later, bulk = make_seq(5, max_new=3, priority_class=1), make_seq(5, max_new=3)
    s.add(later)
    s.add(bulk)
    out = sim.step()
    assert sorted(i.seq.slot for i in out.items) == list(range(9))         # nine decode tokens, no prefill
    assert later.state == bulk.state == SeqState.WAITING
    sim.finish(seqs[0])                                  # a slot frees: the higher class takes it first
    sim.step()
    assert later.state == SeqState.RUNNING and bulk.state == SeqState.WAITING and len(s.running) == 9


def test_a_sequence_lent_the_reserve_decodes_beside_a_full_batch_of_its_own_class() -> None:
    """The owner lends the reserve to a sequence of the running class (a job of a tenant with
    nothing running, while another tenant holds every slot): it is admitted at once into the spare
    stream; an unlent one of the same class waits for a slot, and a second lent one for the reserve."""
    s, sim, seqs = _eight_running_with_a_spare(reserve_slots=1)
    plain, lent, second = make_seq(5, max_new=3), make_seq(5, max_new=10, lent_reserve=True), \
        make_seq(5, max_new=3, lent_reserve=True)
    s.add(plain)
    s.add(lent)
    sim.step()
    assert plain.state == SeqState.WAITING                   # older, but not lent: it waits for a slot...
    assert lent.state == SeqState.WAITING                    # ...and the queue's head holds the rest back
    s.cancel(plain.request_id)
    sim.step()
    assert lent.slot == 8 and all(q.state == SeqState.RUNNING for q in seqs)
    s.add(second)
    out = sim.step()
    assert second.state == SeqState.WAITING and sorted(i.seq.slot for i in out.items) == list(range(9))


def test_the_reserve_is_not_used_without_a_lower_class_running_nor_beyond_the_cache_slots() -> None:
    s, sim, _ = _eight_running_with_a_spare(reserve_slots=0)
    interactive = make_seq(5, max_new=3, priority_class=1)
    s.add(interactive)
    sim.step()
    assert interactive.state == SeqState.WAITING                 # no reserve: it waits (or a job is handed back)
    s = Scheduler(config(n_slots=2, cache_slots=1, reserve_slots=1, n_batch=64))
    sim = Sim(s)
    top = [make_seq(5, max_new=50, priority_class=1) for _ in range(3)]
    for q in top:
        s.add(q)
    sim.step()
    assert [q.state for q in top] == [SeqState.RUNNING, SeqState.RUNNING, SeqState.WAITING]
    with pytest.raises(ValueError, match="reserve_slots"):
        Scheduler(config(n_slots=2, cache_slots=0, reserve_slots=1))
    with pytest.raises(ValueError, match="reserve_slots"):
        Scheduler(config(n_slots=8, cache_slots=1, reserve_slots=1, n_batch=8))
