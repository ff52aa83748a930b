"""Pure tests of the scheduler's LoRA rule (engine.scheduler, rule 10): a step runs one adapter set,
sets take bounded turns round-robin, and the prefix cache is per set. No model (``Sim`` plays the
runner); tests/engine/test_lora.py runs the same rule on llama.cpp."""

from __future__ import annotations

from slotq.engine.lora import AdapterSet
from slotq.engine.scheduler import Scheduler
from tests.support.scheduler_sim import Sim, config, make_seq

STYLE: AdapterSet = ((0, 1.0),)
OTHER: AdapterSet = ((1, 0.5),)


def test_each_step_runs_one_adapter_set_and_sets_take_turns_of_turn_steps() -> None:
    s = Scheduler(config(n_slots=4, lora_turn_steps=3))
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


def test_no_set_starves_whatever_its_priority_and_every_sequence_finishes() -> None:
    """A higher lane's set does not keep the turn: a turn is bounded, so the other sets run within
    (sets - 1) x turn_steps steps of their last."""
    s = Scheduler(config(n_slots=6, lora_turn_steps=2))
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


def test_a_lone_set_keeps_the_turn_and_a_newcomer_set_waits_at_most_one_turn() -> None:
    s = Scheduler(config(n_slots=4, lora_turn_steps=4))
    sim = Sim(s)
    lone = make_seq(2, max_new=60, adapters=STYLE)
    s.add(lone)
    assert all(sim.step().adapters == STYLE for _ in range(20))     # alone: never switched away
    late = make_seq(2, max_new=20)
    s.add(late)
    assert sim.step().adapters == ()                                # its turn was used up long ago


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
