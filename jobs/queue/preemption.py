"""Which running job a busy worker hands back when a job of a higher lane waits: a pure policy.

Precedence, first rule that tells two candidates apart wins:

1. the lowest lane (bulk yields before anything above it), since the job that waits must be of a
   higher lane than its victim;
2. the most tokens left to generate: the job that would hold its slot longest gives it up, and a
   job about to finish is left to finish (handing it back would cost its re-prefill for little);
3. the job id, so the choice is deterministic.

Only jobs whose attempt is running can be chosen: one still starting, finishing, cancelled, or
already yielding its slot is never a victim.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    job_id: str
    lane_index: int         # 0 = the highest lane (SLOTQ_LANES order)
    tokens_left: int        # still to generate, over all choices


def choose_victim(candidates: Iterable[Candidate]) -> Candidate | None:
    """The job to hand back by the precedence above, or None when there is none."""
    return min(candidates, key=lambda c: (-c.lane_index, -c.tokens_left, c.job_id), default=None)
