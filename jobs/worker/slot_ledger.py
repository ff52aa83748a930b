"""Which jobs hold this worker's slots, and where each one's attempt stands: a pure ledger.

One :class:`HeldJob` per job holding a slot, and :class:`SlotLedger`'s methods are the only way
one changes, so the states cannot drift apart (they were five maps keyed by job id, each updated
in several places). A job holds a slot from its claim until its attempt's task has ended; on the
way its attempt may

* lose its lease (reaped, or claimed again: its writes are fenced off, the attempt is stopped);
* be leaving (its finish, retry or hand-back is being written: its lease is no longer renewed);
* have a successor: the claim that takes its slot the moment its attempt ends -- the same job
  claimed again while its lost attempt still ends here, or a higher lane's job it yields to.

No asyncio and no Redis here: the queue runtime (:mod:`slotq.jobs.worker.runtime`) does the I/O
and asks the ledger what holds which slot.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from slotq.jobs.protocol.redis_queue import ClaimedJob


@dataclass
class HeldJob:
    """One job holding a slot here: the claim whose attempt runs, and how far that attempt is from leaving."""

    claim: ClaimedJob
    lease_lost: bool = False            # no longer owns the job: stopped, its writes fenced off
    leaving: bool = False               # finishing, retrying or being handed back right now
    successor: ClaimedJob | None = None  # takes the slot once this attempt has ended

    @property
    def slot_lane(self) -> str:
        """The lane the slot counts for: a slot being handed over counts for the claim that takes it."""
        return self.successor.lane if self.successor is not None else self.claim.lane

    @property
    def current(self) -> bool:
        """The attempt still runs for its claim: neither leaving nor lost."""
        return not (self.leaving or self.lease_lost)


class SlotLedger:
    """The jobs holding this worker's slots, by job id (one :class:`HeldJob` each)."""

    def __init__(self) -> None:
        self._jobs: dict[str, HeldJob] = {}

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        """Slots in use: a job holds one from its claim until its attempt has ended."""
        return len(self._jobs)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def __iter__(self) -> Iterator[HeldJob]:
        return iter(list(self._jobs.values()))

    def get(self, job_id: str) -> HeldJob | None:
        return self._jobs.get(job_id)

    def claims(self) -> dict[str, ClaimedJob]:
        """Job id -> the claim whose attempt runs here."""
        return {job_id: held.claim for job_id, held in self._jobs.items()}

    def slot_lanes(self) -> Counter[str]:
        """The jobs holding a slot, by lane (:attr:`HeldJob.slot_lane`)."""
        return Counter(held.slot_lane for held in self._jobs.values())

    def is_current(self, claim: ClaimedJob) -> bool:
        """Whether ``claim`` still runs here, neither leaving nor lost, or waits to take a slot."""
        held = self._jobs.get(claim.id)
        if held is not None and held.claim.lease == claim.lease:
            return held.current
        return any(h.successor is not None and h.successor.id == claim.id and h.successor.lease == claim.lease
                   for h in self._jobs.values())

    def leases(self) -> list[ClaimedJob]:
        """The claims whose leases must be renewed: every attempt neither lost nor leaving, then
        every claim waiting for a slot to be handed over."""
        running = [held.claim for held in self._jobs.values() if held.current]
        return running + [held.successor for held in self._jobs.values() if held.successor is not None]

    def may_yield(self) -> Iterator[ClaimedJob]:
        """The claims that could hand their slot to a higher lane: attempts neither leaving, lost,
        nor already yielding it."""
        return (held.claim for held in self._jobs.values() if held.current and held.successor is None)

    # ------------------------------------------------------------------ changing
    def take_slot(self, claim: ClaimedJob) -> None:
        """``claim`` takes a free slot (its job holds none here)."""
        if claim.id in self._jobs:
            raise ValueError(f"job {claim.id} already holds a slot here")
        self._jobs[claim.id] = HeldJob(claim)

    def hand_over(self, job_id: str, successor: ClaimedJob) -> None:
        """``successor`` takes ``job_id``'s slot once its attempt has ended."""
        self._jobs[job_id].successor = successor

    def lose_lease(self, job_id: str, lease: str) -> bool:
        """``lease`` no longer owns ``job_id``. A claim waiting for a slot is dropped; a running
        attempt is marked lost. True if that attempt must be stopped now (not already lost, and
        the report names its claim: one about another claim of the job is ignored)."""
        for held in self._jobs.values():
            if held.successor is not None and held.successor.id == job_id and held.successor.lease == lease:
                held.successor = None        # lost before it could start
                return False
        held_job = self._jobs.get(job_id)
        if held_job is None or held_job.claim.lease != lease or held_job.lease_lost:
            return False
        held_job.lease_lost = True
        return True

    def start_leaving(self, job_id: str) -> HeldJob | None:
        """``job_id``'s attempt is writing how it ended: its lease is no longer renewed."""
        held = self._jobs.get(job_id)
        if held is not None:
            held.leaving = True
        return held

    def attempt_ended(self, job_id: str) -> ClaimedJob | None:
        """``job_id``'s attempt has ended: its slot passes to its successor, returned (whose
        attempt must be started now), or is free (None)."""
        held = self._jobs.pop(job_id, None)
        if held is None or held.successor is None:
            return None
        self._jobs[held.successor.id] = HeldJob(held.successor)
        return held.successor
