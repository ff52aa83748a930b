"""Pure tests of the scheduler's LoRA rule (engine.scheduler, rule 10): a step runs one adapter set, a
set keeps the turn while it has work, up to a cap counted in the steps another set waits through,
the turn passes round-robin, and the prefix cache is per set. No model (``Sim`` plays the runner);
tests/engine/test_lora.py runs the same rule on llama.cpp."""

from __future__ import annotations

from slotq.engine.lora import BASE, AdapterSet
from slotq.engine.scheduler import Scheduler
from tests.support.scheduler_sim import Sim, config, make_seq

STYLE: AdapterSet = ((0, 1.0),)
OTHER: AdapterSet = ((1, 0.5),)


def test_each_step_runs_one_adapter_set_and_sets_that_keep_work_take_turns_of_the_cap() -> None:
    s = Scheduler(config(n_slots=4, lora_turn_max_steps=3))
    sim = Sim(s)
    base = [make_seq(2, max_new=40) for _ in range(2)]
    styled = [make_seq(2, max_new=40, adapters=STYLE) for _ in range(2)]
    for seq in base + styled:
        s.add(seq)
    runs = []
    for _ in range(12):
        out = sim.step()
        assert {item.seq.adapters for item in out.items} == {out.adapters}     # one set per step
        assert {item.seq for item in out.items} == set(base if out.adapters == () else styled)
        runs.append(out.adapters)
    assert runs == [(), (), (), STYLE, STYLE, STYLE] * 2


def test_a_set_keeps_the_turn_while_it_generates_and_the_other_sets_requests_pile_up() -> None:
    """The turn is not a fixed number of steps: the base set runs until it has no work, and the
    style requests that arrive meanwhile run together in one fuller step after it."""
    s = Scheduler(config(n_slots=8, lora_turn_max_steps=100))
    sim = Sim(s)
    base = [make_seq(2, max_new=6) for _ in range(2)]
    styled = [make_seq(2, max_new=6, adapters=STYLE)]
    for seq in base + styled:
        s.add(seq)
    runs = [sim.step().adapters for _ in range(2)]
    styled += [make_seq(2, max_new=6, adapters=STYLE) for _ in range(3)]
    for seq in styled[1:]:
        s.add(seq)
    runs += [sim.step().adapters for _ in range(4)]
    assert runs == [BASE] * 6 and all(seq in sim.finished for seq in base)
    out = sim.step()
    assert out.adapters == STYLE and {item.seq for item in out.items} == set(styled)


def test_more_ready_sequences_in_another_set_do_not_take_the_turn() -> None:
    """No switch on counts: the set that first had work keeps the turn while it has work, though
    the other set has five sequences ready to its one (running a set moves a closed loop's clients
    to the other set, so switching on counts keeps the sets split: docs/architecture.md)."""
    s = Scheduler(config(n_slots=6, lora_turn_max_steps=100))
    sim = Sim(s)
    lone = make_seq(2, max_new=20)
    s.add(lone)
    for _ in range(5):
        s.add(make_seq(2, max_new=5, adapters=STYLE))
    runs = [sim.step().adapters for _ in range(21)]
    assert runs == [BASE] * 20 + [STYLE] and lone in sim.finished


def test_the_cap_bounds_the_wait_beside_a_higher_lane_that_never_runs_out_of_work() -> None:
    """A set whose slots are refilled as they finish always has work, so only the cap ends its turn:
    the other set runs within that many steps of its last, and finishes, whatever its priority."""
    s = Scheduler(config(n_slots=4, lora_turn_max_steps=5))
    sim = Sim(s)
    busy = [make_seq(2, max_new=3, priority_class=1) for _ in range(2)]
    styled = make_seq(2, max_new=12, adapters=STYLE)
    for seq in busy + [styled]:
        s.add(seq)
    last_styled_step = 0
    for step in range(1, 200):
        out = sim.step()
        if out.adapters == STYLE:
            last_styled_step = step
        assert step - last_styled_step <= 5
        for seq in [seq for seq in busy if seq in sim.finished]:
            busy.remove(seq)
            busy.append(make_seq(2, max_new=3, priority_class=1))
            s.add(busy[-1])
        if styled in sim.finished:
            break
    assert styled in sim.finished and styled.n_generated == 12


def test_no_set_starves_whatever_its_priority_and_every_sequence_finishes() -> None:
    """A higher lane's set does not keep the turn: a turn is bounded, so the other sets run within
    (sets - 1) x max_steps steps of their last."""
    s = Scheduler(config(n_slots=6, lora_turn_max_steps=2))
    sim = Sim(s)
    seqs = [make_seq(3, max_new=30, adapters=STYLE, priority_class=1), make_seq(3, max_new=30, adapters=OTHER),
            make_seq(3, max_new=30)]
    for seq in seqs:
        s.add(seq)
    last_run = {seq.adapters: 0 for seq in seqs}
    for step in range(1, 200):
        out = sim.step()
        if not out.items:
            break
        last_run[out.adapters] = step
        waiting_sets = {q.adapters for q in s.running}
        assert all(step - last_run[a] <= 2 * 2 for a in waiting_sets)
    assert all(seq.n_generated == 30 for seq in seqs)


def test_a_lone_set_pays_nothing_and_a_newcomer_set_waits_at_most_the_cap() -> None:
    """The steps a set runs alone do not count against its turn: a newcomer's set does not cut it
    off at once (its batch would stop mid-way while a smaller one runs), and waits at most the cap."""
    s = Scheduler(config(n_slots=4, lora_turn_max_steps=4))
    sim = Sim(s)
    lone = make_seq(2, max_new=60, adapters=STYLE)
    s.add(lone)
    assert all(sim.step().adapters == STYLE for _ in range(20))     # alone: never switched away
    late = make_seq(2, max_new=20)
    s.add(late)
    assert [sim.step().adapters for _ in range(5)] == [STYLE] * 4 + [BASE]


def test_a_prefix_is_reused_only_under_the_same_adapter_set() -> None:
    s = Scheduler(config(n_slots=2))
    sim = Sim(s)
    prompt = list(range(1, 41))
    first = make_seq(prompt, max_new=2)
    s.add(first)
    sim.run()
    styled = make_seq(prompt, max_new=2, adapters=STYLE)     # the same tokens, another set: computed anew
    s.add(styled)
    sim.step()
    assert styled.n_reused == 0
    sim.run()
    again = make_seq(prompt, max_new=2, adapters=STYLE)      # the same set as the cache it left: reused
    s.add(again)
    sim.step()
    assert again.n_reused == len(prompt) - 1
    sim.run()
    plain = make_seq(prompt, max_new=2)
    s.add(plain)
    sim.step()
    assert plain.n_reused == len(prompt) - 1                   # the base model's cache is still there


def test_a_newcomer_does_not_wait_for_another_sets_running_prefill() -> None:
    s = Scheduler(config(n_slots=2, prefill_chunk=8, min_wait_tokens=4))
    sim = Sim(s)
    prompt = list(range(1, 65))
    leader = make_seq(prompt, max_new=2)
    s.add(leader)
    sim.step()
    follower = make_seq(prompt, max_new=2, adapters=STYLE)
    s.add(follower)
    sim.step()
    assert follower.fork_of is None and follower.n_reused == 0
