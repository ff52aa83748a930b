"""The switching policy of a worker of several models (slotq.jobs.worker.model_switch), pure: each rule
of its precedence, without Redis or a model."""

from __future__ import annotations

from slotq.jobs.worker.model_switch import Demand, choose, may_leave, neediest


def demand(model: str, waiting: int = 0, age: float | None = None, *, deferred: int = 0,
           served: bool = False) -> Demand:
    return Demand(model=model, waiting=waiting, deferred=deferred, oldest_wait_s=age, served=served)


def test_rule_1_and_2_never_leaves_running_or_waiting_work() -> None:
    needy = [demand("b", 5, 60.0)]
    assert choose(running_here=1, pending=0, quiet_s=99, idle_s=1, others=needy) is None
    assert choose(running_here=0, pending=1, quiet_s=99, idle_s=1, others=needy) is None   # waiting or deferred
    assert choose(running_here=0, pending=0, quiet_s=99, idle_s=1, others=needy) == "b"


def test_rule_3_hysteresis() -> None:
    assert not may_leave(running_here=0, pending=0, quiet_s=2.9, idle_s=3)
    assert may_leave(running_here=0, pending=0, quiet_s=3.0, idle_s=3)
    assert may_leave(running_here=0, pending=0, quiet_s=0.0, idle_s=0)      # SLOTQ_MODEL_IDLE_S=0: at once


def test_rule_4_only_models_with_demand_and_no_worker() -> None:
    assert neediest([]) is None
    assert neediest([demand("idle")]) is None                                 # nothing waiting
    assert neediest([demand("has-one", 9, 30.0, served=True)]) is None        # a worker has it (or loads it)
    assert neediest([demand("has-one", 9, 30.0, served=True), demand("none", 1, 0.1)]) == "none"
    assert neediest([demand("retry", deferred=1)]) == "retry"                 # only this queue's worker promotes it


def test_rule_5_longest_wait_first_then_by_name() -> None:
    assert neediest([demand("a", 1, 2.0), demand("b", 50, 1.0), demand("c", 1, 3.0)]) == "c"
    assert neediest([demand("b", 1, 2.0), demand("a", 1, 2.0)]) == "a"        # ties: every worker picks the same
    assert neediest([demand("deferred-only", deferred=3), demand("z", 1, 0.0)]) == "z"   # waiting jobs first
