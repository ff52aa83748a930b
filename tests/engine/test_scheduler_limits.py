"""Pure tests of the scheduler's runtime limits (active slots, batch budget, prefill chunk), which an
elastic worker moves while the engine runs. No model: ``scheduler_sim.Sim`` plays the runner."""

from __future__ import annotations

from slotq.engine.scheduler import Scheduler, SchedulerLimits
from tests.support.scheduler_sim import Sim, config, make_seq


def test_active_slot_cap_limits_admission_and_raising_it_admits_at_once() -> None:
    s = Scheduler(config(n_slots=4))
    sim = Sim(s)
    s.set_limits(SchedulerLimits(active_slots=2, n_batch=64, prefill_chunk=16))
    seqs = [make_seq(4, max_new=50) for _ in range(4)]
    for q in seqs:
        s.add(q)
    out = sim.step()
    assert [a.seq for a in out.admitted] == seqs[:2]
    assert len(s.running) == 2 and len(s.waiting) == 2 and s.n_free_slots == 2    # slots free, but capped
    assert not sim.step().admitted
    s.set_limits(SchedulerLimits(active_slots=4, n_batch=64, prefill_chunk=16))
    assert [a.seq for a in sim.step().admitted] == seqs[2:]


def test_lowering_the_cap_never_stops_a_running_sequence() -> None:
    s = Scheduler(config(n_slots=4))
    sim = Sim(s)
    running = [make_seq(4, max_new=50) for _ in range(4)]
    for q in running:
        s.add(q)
    sim.step()
    late = make_seq(4, max_new=5)
    s.add(late)
    s.set_limits(SchedulerLimits(active_slots=2, n_batch=64, prefill_chunk=16))
    before = {q: q.n_generated for q in running}
    out = sim.step()
    assert not out.admitted
    assert all(q.n_generated == before[q] + 1 for q in running)         # all four still decode
    s.finish(running[0])
    s.finish(running[1])
    assert not sim.step().admitted          # 2 running = the cap: the slot retired with its sequence
    s.finish(running[2])
    assert [a.seq for a in sim.step().admitted] == [late]


def test_smaller_batch_and_chunk_cut_prefill_never_decode() -> None:
    s = Scheduler(config(n_slots=4, n_batch=64, prefill_chunk=16))
    sim = Sim(s)
    gen = sim.generating(3)
    long = make_seq(100)
    s.add(long)
    s.set_limits(SchedulerLimits(active_slots=4, n_batch=8, prefill_chunk=4))
    out = sim.step()
    assert [(i.seq, i.n_tokens) for i in out.items] == [(gen[0], 1), (gen[1], 1), (gen[2], 1), (long, 4)]
    s.set_limits(SchedulerLimits(active_slots=4, n_batch=2, prefill_chunk=4))   # below the decode count
    out = sim.step()
    assert [(i.seq, i.n_tokens) for i in out.items] == [(gen[0], 1), (gen[1], 1), (gen[2], 1)]


def test_limits_are_clamped_to_the_configured_sizes() -> None:
    s = Scheduler(config(n_slots=4, n_batch=64, prefill_chunk=16))
    applied = s.set_limits(SchedulerLimits(active_slots=99, n_batch=10_000, prefill_chunk=0))
    assert applied == SchedulerLimits(active_slots=4, n_batch=64, prefill_chunk=1)
    assert s.set_limits(SchedulerLimits(active_slots=0, n_batch=0, prefill_chunk=99)) == \
        SchedulerLimits(active_slots=1, n_batch=1, prefill_chunk=16)
