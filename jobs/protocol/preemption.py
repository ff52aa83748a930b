"""Which running job a busy worker hands back when a job of a higher lane waits: a pure policy.

Never chosen: a job of a lane that holds no more than its guaranteed slots on this worker
(:func:`guaranteed_slots`, ``SLOTQ_LANE_MIN_SHARE``). The claim fills those slots from that lane
first (``CLAIM`` in :mod:`slotq.jobs.protocol.scripts`); handing one back would give the slot to the
higher lane and starve the lane again. The worker runs a higher lane's job in its reserve only
where there is a victim too: a job in the reserve would take the slot a guaranteed job leaves.

Precedence, first rule that tells two candidates apart wins:

1. the lowest lane (bulk yields before anything above it), since the job that waits must be of a
   higher lane than its victim;
2. a job that has generated no token in its current attempt (still prefilling, or just resumed)
   goes last: its hand-back leaves only at the end of its prefill step, so the waiting job would
   wait for that whole step, and a job just resumed after a hand-back would be picked again and
   again (it always has the most tokens left), re-prefilling each time and trailing its wave;
3. among the rest, the attempt that has run longest yields first, so successive hand-backs rotate
   across the lane's jobs (a resumed job starts a new attempt and goes to the back) -- except that
   a job about to finish (at most :data:`FINISHING_TOKENS` left) goes after the others: its slot
   frees on its own within as many decode steps, and handing it back would re-prefill its whole
   context to buy a handful of tokens;
4. the most tokens left to generate, then the job id, so the choice is deterministic.

Only jobs whose attempt is running can be chosen: one still starting, finishing, cancelled, or
already yielding its slot is never a victim.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# A job with this many tokens left or fewer is "about to finish": 16 decode steps are about half a
# second of a full 8-slot batch on the benchmark's CPU (32 ms a step) and ~5 % of a 300-token bulk
# job, while its re-prefill recomputes its prompt plus everything it delivered -- the most of any job.
FINISHING_TOKENS = 16


@dataclass(frozen=True)
class Progress:
    """How far a running attempt has got, as the victim policy weighs it."""
    tokens_left: int        # still to generate, over all choices
    generated: int          # tokens this attempt has received (0: still prefilling, or just resumed)
    started_at: float       # time.monotonic() when this attempt started


# An attempt whose request is not known yet: nothing generated, so it goes last in its lane.
NOT_STARTED = Progress(tokens_left=0, generated=0, started_at=math.inf)


@dataclass(frozen=True)
class Candidate:
    job_id: str
    lane_index: int         # 0 = the highest lane (SLOTQ_LANES order)
    progress: Progress


def _precedence(c: Candidate) -> tuple[int, bool, bool, float, int, str]:
    p = c.progress
    return (-c.lane_index, p.generated == 0, p.tokens_left <= FINISHING_TOKENS, p.started_at, -p.tokens_left,
            c.job_id)


def guaranteed_slots(slots: int, share: float) -> int:
    """Slots of a worker with ``slots`` slots that each lane below the top keeps while it has work:
    floor(slots x share), so 1 of 8 at the default share of 1/8, and none on a worker too small for
    a whole slot (a slot-time share there would need a slot that yields in turns, which is a
    preemption by another name)."""
    return math.floor(slots * share + 1e-9)


def choose_victim(candidates: Iterable[Candidate], *, lane_jobs: Mapping[int, int] | None = None,
                  guaranteed: int = 0) -> Candidate | None:
    """The job to hand back by the precedence above, or None when there is none. With
    ``guaranteed`` slots per lane, a lane holding at most that many of the worker's slots
    (``lane_jobs``: the jobs holding a slot, by lane index) gives no candidate."""
    jobs = lane_jobs or {}
    eligible = (c for c in candidates if not guaranteed or jobs.get(c.lane_index, 0) > guaranteed)
    return min(eligible, key=_precedence, default=None)
