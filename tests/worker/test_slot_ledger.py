"""The worker's slot ledger (jobs/worker/slot_ledger.py): which job holds which slot, and where each
one's attempt stands. Pure: no Redis, no event loop."""

from __future__ import annotations

from collections import Counter

import pytest

from slotq.jobs.protocol.redis_queue import ClaimedJob
from slotq.jobs.worker.slot_ledger import SlotLedger


def claim(job_id: str, lane: str = "bulk", n: int = 1) -> ClaimedJob:
    return ClaimedJob(id=job_id, lane=lane, ready_ms=0, lease=f"w#{job_id}{n}", claimed_ms=0)


def test_a_job_holds_its_slot_until_its_attempt_ends() -> None:
    ledger = SlotLedger()
    a, b = claim("a"), claim("b", "interactive")
    ledger.take_slot(a)
    ledger.take_slot(b)
    assert len(ledger) == 2 and "a" in ledger
    assert ledger.claims() == {"a": a, "b": b}
    assert ledger.slot_lanes() == Counter({"bulk": 1, "interactive": 1})
    assert ledger.attempt_ended("a") is None
    assert len(ledger) == 1 and "a" not in ledger
    assert ledger.attempt_ended("a") is None               # reported twice: nothing changes
    with pytest.raises(ValueError, match="already holds a slot"):
        ledger.take_slot(b)


def test_a_leaving_attempt_is_no_longer_renewed_nor_current() -> None:
    ledger = SlotLedger()
    a, b = claim("a"), claim("b")
    ledger.take_slot(a)
    ledger.take_slot(b)
    held = ledger.start_leaving("a")
    assert held is not None and held.claim is a and held.leaving
    assert ledger.start_leaving("gone") is None
    assert ledger.leases() == [b]
    assert not ledger.is_current(a) and ledger.is_current(b)
    assert list(ledger.may_yield()) == [b]
    assert len(ledger) == 2                                # it still holds its slot while it writes


def test_a_lost_lease_stops_its_attempt_once_and_only_for_its_own_claim() -> None:
    ledger = SlotLedger()
    a = claim("a")
    ledger.take_slot(a)
    assert not ledger.lose_lease("a", "w#other")           # another claim of the job: ignored
    assert not ledger.lose_lease("unknown", a.lease)
    assert ledger.lose_lease("a", a.lease)                 # stop it now
    assert not ledger.lose_lease("a", a.lease)             # already lost
    held = ledger.get("a")
    assert held is not None and held.lease_lost and not held.current
    assert ledger.leases() == [] and list(ledger.may_yield()) == []


def test_a_job_claimed_again_takes_its_own_slot_once_the_lost_attempt_ends() -> None:
    ledger = SlotLedger()
    old, new = claim("a", n=1), claim("a", n=2)
    ledger.take_slot(old)
    ledger.hand_over("a", new)
    assert ledger.lose_lease("a", old.lease)
    assert ledger.leases() == [new]                        # the waiting claim keeps its lease
    assert ledger.is_current(new) and not ledger.is_current(old)
    assert len(ledger) == 1                                # one slot, handed over
    assert ledger.attempt_ended("a") is new                # start its attempt now
    held = ledger.get("a")
    assert held is not None and held.claim is new and held.current and held.successor is None
    assert len(ledger) == 1


def test_a_victim_slot_counts_for_the_job_it_yields_to_and_passes_to_it() -> None:
    ledger = SlotLedger()
    victim, other, waiting = claim("v", "bulk"), claim("o", "bulk"), claim("w", "interactive")
    ledger.take_slot(victim)
    ledger.take_slot(other)
    ledger.hand_over("v", waiting)
    assert ledger.slot_lanes() == Counter({"bulk": 1, "interactive": 1})
    assert list(ledger.may_yield()) == [other]             # already yielding: not a victim again
    assert ledger.leases() == [victim, other, waiting]
    assert ledger.attempt_ended("v") is waiting
    assert ledger.claims() == {"o": other, "w": waiting}


def test_a_waiting_claim_lost_before_it_started_is_dropped() -> None:
    ledger = SlotLedger()
    victim, waiting = claim("v"), claim("w", "interactive")
    ledger.take_slot(victim)
    ledger.hand_over("v", waiting)
    assert not ledger.lose_lease("w", waiting.lease)       # nothing runs for it: nothing to stop
    assert not ledger.is_current(waiting)
    assert ledger.leases() == [victim]
    assert ledger.attempt_ended("v") is None               # the slot is free
    assert len(ledger) == 0
