"""Pure tests of the scheduling policy: decode first, the prefill budget, admission, and a
whole-policy property; no model (``scheduler_sim.Sim`` plays the runner). The KV side -- prefix
reuse, KV-aware admission, KV-full handling, forks and the ledger -- is in test_scheduler_kv.py.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slotq.engine.scheduler import BatchingMode, KVFullAction, Scheduler, SchedulerConfig
from slotq.engine.sequence import SeqState, Sequence
from tests.support.scheduler_sim import Sim, config, make_seq


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


def test_a_higher_class_prompt_is_prefilled_alone_and_lower_ones_resume_after() -> None:
    """Rule 3: a bulk prompt (class 0) that is mid-prefill steps aside while an interactive one
    (class 1) prefills, so the interactive first token waits for no bulk chunk; decode goes on."""
    s = Scheduler(config(n_slots=4, n_batch=64, prefill_chunk=16))
    sim = Sim(s)
    decoding = make_seq(2, max_new=50)
    s.add(decoding)
    sim.step()
    bulk = make_seq(40)
    s.add(bulk)
    sim.step()                                           # bulk's first chunk
    interactive = make_seq(20, priority_class=1)
    s.add(interactive)
    steps = []
    while interactive.n_generated == 0:
        out = sim.step()
        steps.append({i.seq: i.n_tokens for i in out.items})
    assert steps == [{decoding: 1, interactive: 16}, {decoding: 1, interactive: 4}]
    out = sim.step()
    assert {i.seq: i.n_tokens for i in out.items} == {decoding: 1, interactive: 1, bulk: 16}


def test_a_prompt_lent_the_reserve_is_prefilled_alone() -> None:
    """Rules 1 and 3: a sequence lent the reserve ranks above the rest of its class for prefill
    (an older prompt admitted with it waits a step), and the step of its last chunk holds nothing
    else: the decoding sequence's token goes in the next step, so the lent one's first token pays
    for no one else's tokens (on a CPU a step costs about its tokens). Earlier chunks share."""
    s = Scheduler(config(n_slots=4, n_batch=64, prefill_chunk=16))
    sim = Sim(s)
    decoding = make_seq(2, max_new=50)
    s.add(decoding)
    sim.step()
    older, lent = make_seq(20), make_seq(20, lent_reserve=True)
    s.add(older)
    s.add(lent)
    steps = [{i.seq: i.n_tokens for i in sim.step().items} for _ in range(3)]
    assert steps == [{decoding: 1, lent: 16}, {lent: 4}, {decoding: 1, lent: 1, older: 16}]
    s.finish(older)
    interactive = make_seq(8, priority_class=1)          # a higher class prefills: the lent one's prompt waits,
    lent_again = make_seq(8, lent_reserve=True)          # and so nobody pauses for it
    s.add(interactive)
    s.add(lent_again)
    assert {i.seq: i.n_tokens for i in sim.step().items} == {decoding: 1, lent: 1, interactive: 8}
    assert {i.seq: i.n_tokens for i in sim.step().items} == {lent_again: 8}


def test_priority_orders_prefill_within_a_class() -> None:
    s = Scheduler(config(n_slots=3, n_batch=20, prefill_chunk=16))
    old, urgent = make_seq(30), make_seq(30, priority=5)
    s.add(old)
    s.add(urgent)
    out = s.schedule()
    assert [(i.seq, i.n_tokens) for i in out.items] == [(urgent, 16), (old, 4)]


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
    low, high, mid, high2 = (make_seq(2, priority=p) for p in (-1, 5, 2, 5))
    for q in (low, high, mid, high2):
        s.add(q)
    order = []
    for _ in range(200):
        out = sim.step()
        order += [a.seq for a in out.admitted]
        if not s.waiting and not s.running:
            break
    assert order == [high, high2, mid, low]


def test_priority_class_comes_before_priority_in_admission() -> None:
    s = Scheduler(config(n_slots=1))
    sim = Sim(s)
    blocker = make_seq(2, max_new=2)
    s.add(blocker)
    sim.step()
    bulk_urgent, interactive = make_seq(2, priority=100), make_seq(2, priority=-100, priority_class=1)
    s.add(bulk_urgent)
    s.add(interactive)
    order = []
    while s.waiting or s.running:
        order += [a.seq for a in sim.step().admitted]
    assert order == [interactive, bulk_urgent]


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
