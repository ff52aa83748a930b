"""The victim policy of jobs/protocol/preemption.py, rule by rule: which running job a busy worker
hands back for a job of a higher lane. Pure; no Redis, no engine.

Each case is one `slotq bench bulk` showed going wrong under the former rule (lowest lane, then the
most tokens left): a job just handed back always has the most left, so every hand-back of a round
took it again, and a job still in its prefill step made the waiting job wait for that step.
"""

from __future__ import annotations

from slotq.jobs.protocol.preemption import FINISHING_TOKENS, Candidate, Progress, choose_victim, guaranteed_slots

BULK, BATCH = 2, 1          # lane indexes: 0 is the highest lane


def job(job_id: str, *, left: int = 200, generated: int = 10, started: float = 0.0, lane: int = BULK) -> Candidate:
    return Candidate(job_id, lane, Progress(tokens_left=left, generated=generated, started_at=started))


def victim(*candidates: Candidate) -> str | None:
    chosen = choose_victim(candidates)
    return chosen.job_id if chosen is not None else None


def test_the_lowest_lane_yields_before_any_rule_on_progress() -> None:
    """A higher-lane job that has run longest is spared; within the lowest lane, the job still
    prefilling (the most tokens left) is not the one taken."""
    assert victim(job("batch", lane=BATCH, started=0), job("prefilling", left=300, generated=0, started=1),
                  job("decoding", left=100, started=2)) == "decoding"


def test_a_job_with_no_token_in_its_attempt_goes_last() -> None:
    """Still prefilling, or just resumed: taking it would hold the waiting job for its whole
    prefill step, and a just-resumed job would be taken again and again."""
    assert victim(job("resumed", left=290, generated=0, started=5), job("decoding", left=50, started=1)) == "decoding"


def test_the_attempt_that_has_run_longest_yields_first() -> None:
    assert victim(job("newer", left=280, started=3), job("older", left=120, started=1)) == "older"


def test_hand_backs_rotate_across_the_lane() -> None:
    """Eight hand-backs on a worker of eight bulk jobs take eight different jobs: each victim
    resumes with a new attempt (and, once it decodes again, the newest start)."""
    running = {f"j{i}": job(f"j{i}", left=300 - 10 * i, started=i) for i in range(8)}
    taken = []
    for now in range(10, 18):
        chosen = choose_victim(running.values())
        assert chosen is not None
        taken.append(chosen.job_id)
        running[chosen.job_id] = job(chosen.job_id, left=chosen.progress.tokens_left, started=now)
    assert sorted(taken) == sorted(running)


def test_a_job_about_to_finish_goes_after_the_others_but_before_one_prefilling() -> None:
    finishing, prefilling = job("finishing", left=FINISHING_TOKENS, started=0), job("prefilling", left=300, generated=0)
    assert victim(finishing, job("decoding", left=100, started=2), prefilling) == "decoding"
    assert victim(finishing, prefilling) == "finishing"


def test_about_to_finish_means_at_most_finishing_tokens_left() -> None:
    newer = job("newer", left=200, started=2)
    assert victim(job("older", left=FINISHING_TOKENS + 1, started=1), newer) == "older"
    assert victim(job("older", left=FINISHING_TOKENS, started=1), newer) == "newer"


def test_equal_starts_fall_back_to_most_tokens_left_then_job_id() -> None:
    assert victim(job("a", left=100), job("b", left=200), job("prefilling", left=300, generated=0)) == "b"
    assert victim(job("b", left=200), job("a", left=200), job("prefilling", left=300, generated=0)) == "a"


def test_a_lane_within_its_guaranteed_slots_yields_none() -> None:
    """No lane starves (SLOTQ_LANE_MIN_SHARE): a lane holding no more than its guaranteed slots on
    the worker gives no victim, so the job claimed under the guarantee runs to its end; a lane above
    its guarantee still yields, and a higher lane's surplus yields before the guarantee is touched."""
    bulk, batch = job("bulk", lane=BULK, started=0), job("batch", lane=BATCH, started=1)
    assert choose_victim([bulk], lane_jobs={BULK: 1}, guaranteed=1) is None
    assert choose_victim([bulk], lane_jobs={BULK: 2}, guaranteed=1) == bulk
    assert choose_victim([bulk, batch], lane_jobs={BULK: 1, BATCH: 3}, guaranteed=1) == batch
    assert choose_victim([bulk], lane_jobs={BULK: 1}) == bulk             # no guarantee (0): strict lanes


def test_the_guarantee_is_whole_slots_of_each_worker() -> None:
    assert [guaranteed_slots(slots, 0.125) for slots in (1, 4, 7, 8, 16, 64)] == [0, 0, 0, 1, 2, 8]
    assert guaranteed_slots(4, 0.25) == 1 and guaranteed_slots(8, 0.0) == 0
