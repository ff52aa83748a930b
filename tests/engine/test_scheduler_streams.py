"""Pure tests of the scheduler with one KV stream per slot (``kv_stream_cells`` set, the split
layout): prefix reuse and forks still work, as copies into the newcomer's own stream; admission
needs only a free slot; decode tokens go in slot order. ``scheduler_sim.Sim`` plays the runner on a
fake KV cache with a stream per sequence.
"""

from __future__ import annotations

from slotq.engine.kv_ledger import KVLedger
from slotq.engine.scheduler import Scheduler
from slotq.engine.sequence import SeqState
from tests.support.scheduler_sim import Sim, config, make_seq


def streams(**kw: object) -> Scheduler:
    base: dict[str, object] = {"n_slots": 4, "kv_cells": 4 * 256, "kv_stream_cells": 256}
    base.update(kw)
    return Scheduler(config(**base))


def test_prefix_reuse_across_slots_copies_into_the_new_stream() -> None:
    s = streams()
    sim = Sim(s)
    prompt = list(range(1, 41))
    a = make_seq(prompt + [50, 51], max_new=30)
    s.add(a)
    while a.n_generated == 0:
        sim.step()
    b = make_seq(prompt + [60])
    s.add(b)
    out = sim.step()
    (adm,) = out.admitted
    assert (adm.copy_from, adm.n_reused, adm.keep) == (a.seq_id, 40, 0) and b.seq_id != a.seq_id
    sim.check()                                          # b's own stream holds the 40 copied tokens
    assert s.ledger.used_cells() == a.n_computed + b.n_computed      # a copy: counted in both streams


def test_own_cache_is_reused_in_place() -> None:
    s = streams()
    sim = Sim(s)
    prompt = list(range(1, 31))
    first = make_seq(prompt + [7], max_new=2)
    s.add(first)
    sim.run()
    q = make_seq(prompt + [8])
    s.add(q)
    out = sim.step()
    (adm,) = out.admitted
    assert (q.seq_id, adm.keep, adm.copy_from, adm.n_reused) == (0, 30, None, 30)
    sim.check()


def test_forks_copy_the_leaders_prompt_into_their_streams() -> None:
    s = streams(prefill_chunk=32)
    sim = Sim(s)
    prompt = list(range(1, 21))
    leader = make_seq(prompt, max_new=5, request_id="n3")
    sibs = [make_seq(prompt, max_new=5, request_id="n3", fork_of=leader) for _ in range(2)]
    for i, q in enumerate([leader, *sibs]):
        q.choice = i
        s.add(q)
    out = sim.step()
    assert [i.seq for i in out.items] == [leader]        # only the leader prefills
    assert {f.seq for f in out.forks} == set(sibs)
    assert s.prompt_tokens_computed == 20 and s.prompt_tokens_reused == 40
    sim.check()
    assert s.ledger.used_cells() == 3 * 20
    sim.run()
    assert all(q.n_generated == 5 for q in [leader, *sibs])


def test_admission_needs_only_a_free_slot() -> None:
    """With a shared pool of 256 cells, two sequences of worst case 200 could not run together;
    with a stream of 256 per slot each has its own room, and overcommit has nothing to do."""
    s = streams(prefix_cache=False)
    sim = Sim(s)
    seqs = [make_seq(100, max_new=100) for _ in range(4)]
    for q in seqs:
        s.add(q)
    out = sim.step()
    assert [a.seq for a in out.admitted] == seqs
    sim.run()
    assert all(q.state == SeqState.FINISHED and q.n_generated == 100 for q in seqs)
    assert not sim.actions                               # llama.cpp never ran out of room


def test_decode_tokens_go_in_slot_order() -> None:
    """llama.cpp puts only consecutive seq ids into one micro-batch when each has its own stream."""
    s = streams(n_slots=4, prefix_cache=False)
    sim = Sim(s)
    seqs = sim.generating(4)
    s.finish(seqs[1])                                   # slot 1 frees; a newcomer takes it
    late = make_seq(2, max_new=50)
    s.add(late)
    while late.n_generated == 0:
        sim.step()
    assert late.seq_id == 1
    out = s.schedule()
    assert [i.seq.seq_id for i in out.items] == [0, 1, 2, 3]


def test_newcomer_takes_the_lowest_uncached_slot() -> None:
    s = streams(n_slots=4, prefix_cache=False)
    sim = Sim(s)
    seqs = sim.generating(4)
    s.finish(seqs[3])
    s.finish(seqs[1])
    sim.step()
    q = make_seq(3)
    s.add(q)
    sim.step()
    assert q.seq_id == 1


def test_ledger_copies_across_streams_own_their_cells() -> None:
    led = KVLedger(shared_copies=False)
    led.extend(0, 10)
    led.copy_prefix(0, 1, 6)
    assert led.length(1) == 6 and led.used_cells() == 16
    led.extend(1, 2)
    led.remove(0)
    assert led.used_cells() == 8 and led.length(1) == 8


def test_a_short_prefix_of_a_running_slot_is_not_copied() -> None:
    """A copy across streams moves the whole stream: below min_copy_tokens, recomputing is cheaper."""
    s = streams(min_copy_tokens=32)
    sim = Sim(s)
    a = make_seq(list(range(1, 21)) + [50], max_new=30)
    s.add(a)
    while a.n_generated == 0:
        sim.step()
    b = make_seq(list(range(1, 21)) + [60])             # shares 20 tokens with a running slot
    s.add(b)
    (adm,) = sim.step().admitted
    assert (adm.copy_from, adm.n_reused) == (None, 0)
    sim.check()
