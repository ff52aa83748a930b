"""The full worker's policy (jobs/worker/preemption_policy.py): what it does with a busy token, which
job yields, what it owes each lane. Pure: no Redis, no event loop."""

from __future__ import annotations

from collections import Counter

from slotq.jobs.protocol.preemption import Candidate, Progress
from slotq.jobs.protocol.redis_queue import BusyToken, ClaimedJob
from slotq.jobs.worker.preemption_policy import Answer, PreemptionPolicy

LANES = ("interactive", "batch", "bulk")
POLICY = PreemptionPolicy(LANES, lane_min_share=0.25)
RUNNING = Progress(tokens_left=100, generated=10, started_at=1.0)


def claim(job_id: str, lane: str) -> ClaimedJob:
    return ClaimedJob(id=job_id, lane=lane, ready_ms=0, lease=f"w#{job_id}", claimed_ms=0)


def bulk_victim() -> Candidate:
    return Candidate("v", LANES.index("bulk"), RUNNING)


def test_each_lane_below_the_top_is_owed_its_guaranteed_slots() -> None:
    # 8 slots at 1/4: 2 each for batch and bulk while they hold fewer
    assert POLICY.owed_slots(8, Counter({"interactive": 7, "bulk": 1})) == {"batch": 2, "bulk": 1}
    assert POLICY.owed_slots(8, Counter({"batch": 2, "bulk": 3})) == {}
    assert PreemptionPolicy(LANES).owed_slots(8, Counter()) == {}            # strict lanes: none


def test_the_victim_is_never_of_the_top_lane_nor_of_a_lane_at_its_guarantee() -> None:
    running = [(claim("i", "interactive"), RUNNING), (claim("b1", "bulk"), RUNNING),
               (claim("b2", "bulk"), Progress(tokens_left=100, generated=10, started_at=0.5))]
    # bulk holds 3 of 8 slots, above its 2: the one that ran longest yields
    victim = POLICY.victim(running, slots=8, slot_lanes=Counter({"interactive": 5, "bulk": 3}))
    assert victim is not None and victim.job_id == "b2"
    # bulk at its guarantee: nobody; the top lane never yields
    assert POLICY.victim(running, slots=8, slot_lanes=Counter({"interactive": 6, "bulk": 2})) is None
    assert POLICY.victim(running[:1], slots=8, slot_lanes=Counter({"interactive": 8})) is None


def test_fair_share_is_taken_for_the_lowest_running_lane() -> None:
    assert POLICY.fair_lane(["interactive", "bulk", "batch"]) == "bulk"
    assert POLICY.fair_lane([]) is None


def test_a_free_slot_comes_first_then_a_victim_then_the_reserve_before_a_hand_back() -> None:
    token = BusyToken(lane="interactive", fair=False)
    ask = dict(victim=bulk_victim(), fair_lane=None)
    assert POLICY.answer(token, free_slot=True, reserve_free=True, **ask) is Answer.CLAIM_INSTEAD
    assert POLICY.answer(token, free_slot=False, reserve_free=True, **ask) is Answer.RUN_IN_RESERVE
    assert POLICY.answer(token, free_slot=False, reserve_free=False, **ask) is Answer.TAKE_VICTIMS_SLOT
    # without a victim, not even the reserve: the token goes back
    assert POLICY.answer(token, free_slot=False, victim=None, fair_lane=None, reserve_free=True) \
        is Answer.RETURN_TOKEN


def test_a_preemption_token_needs_a_victim_of_a_lower_lane_than_its_own() -> None:
    bulk_token, batch_token = BusyToken(lane="bulk", fair=False), BusyToken(lane="batch", fair=False)
    ask = dict(free_slot=False, victim=bulk_victim(), fair_lane=None, reserve_free=False)
    assert POLICY.answer(bulk_token, **ask) is Answer.RETURN_TOKEN
    assert POLICY.answer(batch_token, **ask) is Answer.TAKE_VICTIMS_SLOT


def test_a_fair_share_token_runs_in_the_reserve_only_for_the_workers_own_lowest_lane() -> None:
    token = BusyToken(lane="bulk", fair=True)
    assert POLICY.answer(token, free_slot=False, victim=None, fair_lane="bulk", reserve_free=True) \
        is Answer.RUN_IN_RESERVE
    assert POLICY.answer(token, free_slot=False, victim=None, fair_lane="batch", reserve_free=True) \
        is Answer.RETURN_TOKEN
    # the reserve taken: the worker's fair lane is None (it takes no fair-share tokens then)
    assert POLICY.answer(token, free_slot=False, victim=None, fair_lane=None, reserve_free=False) \
        is Answer.RETURN_TOKEN
    assert POLICY.answer(token, free_slot=True, victim=None, fair_lane="bulk", reserve_free=True) \
        is Answer.CLAIM_INSTEAD
