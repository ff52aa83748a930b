"""What a full worker does with a busy token, and what it owes each lane: a pure policy.

A worker whose slots are all busy listens for busy tokens (:class:`~slotq.jobs.protocol.redis_queue.BusyToken`):
a *preemption* token says a job of a higher lane waits, a *fair-share* token that a job waits whose
tenant has nothing running. :meth:`PreemptionPolicy.answer` decides what the worker does with one;
the queue runtime (:mod:`slotq.jobs.worker.runtime`) carries it out. Which job yields is
:func:`~slotq.jobs.protocol.preemption.choose_victim`'s precedence; this module decides whether
anyone does.

Precedence, first rule that applies wins:

1. **A free slot.** The worker may claim again (a job left meanwhile): the token is left alone and
   the claim loop takes the job the ordinary way. Tokens are for a full worker only.
2. **No one to yield.** A preemption token with no victim of a lane below the token's goes back for
   another worker. A victim is a job of a lane below the top whose job function runs, that is
   neither leaving, lost, aborted nor already yielding its slot, and whose lane holds more than
   its guaranteed slots here (``SLOTQ_LANE_MIN_SHARE``: :meth:`PreemptionPolicy.owed_slots`).
3. **The reserve first.** While the reserve is free (the engine's spare KV streams), the waiting job
   runs there beside the others and nobody yields; the worker holds ``slots + 1`` until one leaves.
   Without a victim nothing runs in the reserve either: a job there would take the slot a
   guaranteed job leaves.
4. **Hand back.** Otherwise the victim hands its slot to the waiting job and goes back to its lane,
   without using a try; it resumes from its stream.
5. **Fair share, within a lane.** A fair-share token is taken only for the worker's lowest running
   lane, and only while its reserve is free; otherwise it goes back. Taken, the job is claimed into
   the reserve (``LEND_RESERVE``, only if its tenant still has nothing running). A job of a higher
   lane comes by a preemption token, and lending the reserve to a lower lane would take it from
   this worker's own.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from slotq.jobs.protocol.preemption import Candidate, Progress, choose_victim, guaranteed_slots
from slotq.jobs.protocol.redis_queue import BusyToken, ClaimedJob


class Answer(enum.Enum):
    """What a full worker does with a busy token (the rules of this module's docstring)."""

    CLAIM_INSTEAD = "claim_instead"          # 1: a slot is free; the claim loop takes the job
    RETURN_TOKEN = "return_token"            # 2, 5: for another worker
    RUN_IN_RESERVE = "run_in_reserve"        # 3, 5: beside the full slots; nobody yields
    TAKE_VICTIMS_SLOT = "take_victims_slot"  # 4: the victim hands its slot over


@dataclass(frozen=True)
class PreemptionPolicy:
    """The rules for a worker of ``lanes`` (highest first), each lane below the top keeping
    ``lane_min_share`` of its slots while it has work."""

    lanes: tuple[str, ...]
    lane_min_share: float = 0.0

    def owed_slots(self, slots: int, slot_lanes: Counter[str]) -> dict[str, int]:
        """Slots a worker of ``slots`` slots owes each lane below the top: its guaranteed slots less
        the lane's jobs holding a slot (``slot_lanes``), only lanes owed some. ``CLAIM`` fills them
        from that lane first."""
        guaranteed = guaranteed_slots(slots, self.lane_min_share)
        return {lane: guaranteed - slot_lanes[lane] for lane in self.lanes[1:] if slot_lanes[lane] < guaranteed}

    def victim(self, running: Iterable[tuple[ClaimedJob, Progress]], *, slots: int,
               slot_lanes: Counter[str]) -> Candidate | None:
        """The job that would hand its slot back (rule 2), of ``running``: the jobs whose function
        runs and that may yield, with their progress. None if none may."""
        top = self.lanes[0]
        return choose_victim(
            (Candidate(job.id, self.lanes.index(job.lane), progress) for job, progress in running if job.lane != top),
            lane_jobs={self.lanes.index(lane): jobs for lane, jobs in slot_lanes.items()},
            guaranteed=guaranteed_slots(slots, self.lane_min_share))

    def fair_lane(self, running_lanes: Iterable[str]) -> str | None:
        """The lane whose fair-share tokens the worker takes (rule 5): the lowest of ``running_lanes``."""
        return max(running_lanes, key=self.lanes.index, default=None)

    def answer(self, token: BusyToken, *, free_slot: bool, victim: Candidate | None, fair_lane: str | None,
               reserve_free: bool) -> Answer:
        """What to do with ``token``: ``free_slot``, whether the worker may claim now; ``victim``,
        :meth:`victim` now; ``fair_lane``, :meth:`fair_lane` now (None while the reserve is
        taken); ``reserve_free``, whether a job may still run beyond the slots."""
        if free_slot:
            return Answer.CLAIM_INSTEAD
        if token.fair:
            return Answer.RUN_IN_RESERVE if fair_lane == token.lane else Answer.RETURN_TOKEN
        if victim is None or victim.lane_index <= self.lanes.index(token.lane):
            return Answer.RETURN_TOKEN
        return Answer.RUN_IN_RESERVE if reserve_free else Answer.TAKE_VICTIMS_SLOT
