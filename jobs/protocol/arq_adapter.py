"""arq's job runtime, fed by slotq's claim path.

:class:`QueueRuntime` keeps what arq does well for a claimed job -- ``Worker.run_job``: read the
job record, count the attempt, honour an abort requested before the start, run the job function
under ``job_timeout``, classify the outcome (``Retry``, abort, cancellation, failure, success) and
build the result record -- and replaces everything around it that cannot scale or cannot be made
safe: the polling loop and its head-of-queue scan, the per-job WATCH/MULTI claim, the lock that is
never renewed, and the finishing writes, which here are fenced scripts of :mod:`slotq.jobs.protocol.scripts`.

Its loop: claim as many jobs as there are free slots; with nothing to claim, wait for whichever
comes first -- a slot freed by a finishing job, a wake token (one enqueue wakes one idle worker), or
the fallback tick (``poll_delay_s``), which also reaps expired leases and re-checks aborts.

A worker whose slots are all busy and that runs a job of a lower lane waits instead for a
preemption token of a lane above it (one enqueue wakes at most one busy worker). It then claims
the waiting job (``PREEMPT``: exactly one worker wins it) and hands back its victim
(:mod:`slotq.jobs.protocol.preemption`): the victim's attempt is cancelled at the engine's next step,
flushes what it generated to its stream and is handed back without using a try; the claimed job
takes its slot as soon as it has left, and the victim resumes from its stream on any worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from arq.worker import Retry, RetryJob, Worker, func

from slotq.jobs.protocol.preemption import NOT_STARTED, Candidate, Progress, choose_victim
from slotq.jobs.protocol.redis_queue import ClaimedJob, RedisQueue

log = logging.getLogger(__name__)


__all__ = ["QueueRuntime", "Retry", "RetryJob"]     # what a job function raises: retry later, or hand back


class QueueRuntime(Worker):
    """An arq ``Worker`` whose jobs come from :class:`RedisQueue` and run ``job`` (registered as
    ``job_name``). ``max_jobs`` is the number of slots; ``allow_pick_jobs = False`` stops claiming
    (draining)."""

    def __init__(self, *, job_name: str, job: Callable[[dict[str, Any], Any], Awaitable[Any]], queue: RedisQueue,
                 token: str, lease_ms: int, may_claim: Callable[[], bool] = lambda: True,
                 on_job_started: Callable[[ClaimedJob], None] | None = None,
                 progress: Callable[[str], Progress] = lambda job_id: NOT_STARTED,
                 on_preempted: Callable[[ClaimedJob], None] | None = None, **kwargs: Any) -> None:
        """``progress(job_id)``: how far a running job's attempt has got (the victim policy weighs
        it); ``on_preempted(victim)``: a job of this worker yields its slot to a higher lane."""
        super().__init__(functions=[func(job, name=job_name)], handle_signals=False, **kwargs)
        # arq logs every job's arguments (the prompt) at INFO; slotq logs its own prompt-free lines.
        logging.getLogger("arq.worker").setLevel(max(logging.WARNING, logging.getLogger().getEffectiveLevel()))
        self.queue = queue
        self.token = token
        self.lease_ms = lease_ms
        self.claimed: dict[str, ClaimedJob] = {}
        # job id -> the claim that takes its slot once its attempt has left: the same job claimed
        # again while its lost attempt still ends here, or a higher-lane job it yields to
        self.successors: dict[str, ClaimedJob] = {}
        self.lease_lost: set[str] = set()
        self.leaving: set[str] = set()          # finishing, retrying or being handed back right now
        self.may_claim = may_claim
        self.on_job_started = on_job_started
        self.progress = progress
        self.on_preempted = on_preempted
        self._slot_freed = asyncio.Event()
        self._wake_task: asyncio.Task[bool] | None = None
        self._preempt_task: asyncio.Task[str | None] | None = None
        self._maintenance: asyncio.Task[None] | None = None
        self.claims = 0          # claim round trips, for benchmarks
        self.wakeups = 0
        self.preemptions = 0     # jobs of this worker handed back for a higher lane

    # ------------------------------------------------------------------ the loop
    async def main(self) -> None:
        """Maintenance starts at once -- a worker still loading a large model already reaps the
        jobs of dead workers -- and claiming once ``on_startup`` (the model load) is done."""
        self.ctx["redis"] = self.pool
        self._maintenance = asyncio.create_task(self._maintain(), name="slotq-queue-maintenance")
        if self.on_startup:
            await self.on_startup(self.ctx)
        while True:
            free = self.max_jobs - self.job_counter
            if self._can_claim() and free > 0:
                claimed = await self._claim(free)
                if len(claimed) == free:
                    continue                  # took all it could; look again when a slot frees
            await self._wait(self.poll_delay_s)

    async def _maintain(self) -> None:
        while True:
            await self._tick()
            await asyncio.sleep(self.poll_delay_s)

    async def _claim(self, free: int) -> list[ClaimedJob]:
        try:
            claimed = await self.queue.claim(free, self.token, self.lease_ms)
        except Exception as exc:  # Redis down: the next tick tries again (commands already retried ~30 s)
            log.warning("claim failed (%s: %s); retrying", type(exc).__name__, exc)
            await asyncio.sleep(1)
            return []
        self.claims += 1
        for job in claimed:
            running = self.claimed.get(job.id)
            if running is None:
                await self._start(job)
                continue
            # Still running here: Redis was unreachable longer than the lease (an outage, a
            # failover), so a reaper requeued the job and this claim took it back. The running
            # attempt's lease is void (its buffered stream writes are refused); it stops, and the
            # new attempt takes over its slot and resumes from what reached the stream.
            log.warning("job %s: claimed again while its attempt still runs here (its lease expired while Redis "
                        "was unreachable); that attempt stops and a new one resumes from its stream", job.id)
            self.successors[job.id] = job
            self.lose_lease(running.id, running.lease)
        return claimed

    async def _start(self, job: ClaimedJob) -> None:
        await self.sem.acquire()          # arq's bookkeeping: never blocks below max_jobs
        self.job_counter += 1
        self._launch(job)

    def _launch(self, job: ClaimedJob) -> None:
        self.claimed[job.id] = job
        task = self.loop.create_task(self.run_job(job.id, job.ready_ms))
        task.add_done_callback(lambda _t, job_id=job.id: self._job_done(job_id))
        self.tasks[job.id] = task
        if self.on_job_started is not None:
            self.on_job_started(job)

    def _job_done(self, job_id: str) -> None:
        self.lease_lost.discard(job_id)
        self.leaving.discard(job_id)
        self.claimed.pop(job_id, None)
        successor = self.successors.pop(job_id, None)
        if successor is not None:
            self._launch(successor)       # the slot passes straight to the new attempt
            return
        self.job_counter -= 1
        self.sem.release()
        self._slot_freed.set()

    def lose_lease(self, job_id: str, lease: str) -> None:
        """``lease`` no longer owns the job (reaped, or claimed again): stop that attempt (its
        writes are fenced off already). A report about another claim of the job is ignored."""
        for leaving_id, successor in list(self.successors.items()):
            if successor.id == job_id and successor.lease == lease:
                del self.successors[leaving_id]   # lost before it could start
                return
        job = self.claimed.get(job_id)
        if job is None or job.lease != lease or job_id in self.lease_lost:
            return
        self.lease_lost.add(job_id)
        task = self.job_tasks.get(job_id)
        if task is not None:                      # None: not started yet; the job function checks lease_lost
            task.cancel()

    def waits_for_slot(self, job: ClaimedJob) -> bool:
        """Whether ``job``'s claim waits here for a leaving attempt's slot."""
        return any(s.id == job.id and s.lease == job.lease for s in self.successors.values())

    def leases(self) -> list[ClaimedJob]:
        """The claims whose leases the heartbeat renews: every running attempt not yet lost or
        leaving, and the claims waiting for a lost attempt to end."""
        running = [j for j in self.claimed.values() if j.id not in self.lease_lost and j.id not in self.leaving]
        return running + list(self.successors.values())

    async def _wait(self, timeout: float) -> None:
        """Until a slot frees, a wake token arrives (only while slots are free), a preemption
        token arrives (only while every slot is busy and a lower-lane job runs) or ``timeout``."""
        self._slot_freed.clear()
        waiters: set[asyncio.Future[Any]] = {asyncio.ensure_future(self._slot_freed.wait())}
        if self._can_claim() and self._wake_task is None:
            self._wake_task = asyncio.create_task(self.queue.wait_for_work(self.poll_delay_s), name="slotq-wake")
        victim = self._victim()
        if victim is not None and self._preempt_task is None:
            self._preempt_task = asyncio.create_task(
                self.queue.wait_for_preemption(self.queue.lane_of(victim.lane_index), self.poll_delay_s),
                name="slotq-preempt-wake")
        waiters |= {t for t in (self._wake_task, self._preempt_task) if t is not None}
        done, pending = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for fut in pending:
            if fut is not self._wake_task and fut is not self._preempt_task:
                fut.cancel()
        if self._wake_task is not None and self._wake_task.done():
            task, self._wake_task = self._wake_task, None
            if await self._token_taken(task):
                self.wakeups += 1
                if not self._can_claim():
                    with contextlib.suppress(Exception):
                        await self.queue.return_wake_token()   # full meanwhile: pass it on
        if self._preempt_task is not None and self._preempt_task.done():
            task, self._preempt_task = self._preempt_task, None
            if await self._token_taken(task):
                await self._preempt(task.result())

    @staticmethod
    async def _token_taken(task: asyncio.Task[Any]) -> bool:
        """Whether a finished token wait popped a token (Redis unreachable: pause, do not spin)."""
        if task.cancelled():
            return False
        if task.exception() is not None:
            await asyncio.sleep(0.5)          # Redis unreachable: the next tick reports it; do not spin
            return False
        return bool(task.result())

    def _victim(self) -> Candidate | None:
        """The job this worker would hand back for a higher lane (:func:`choose_victim`); None
        unless every slot is busy and the worker may claim. A job is a candidate while its job
        function runs and it is neither leaving, lost, aborted nor already yielding its slot."""
        if not (self.allow_pick_jobs and self.job_counter >= self.max_jobs and self.may_claim()):
            return None
        lanes = self.queue.keys.lanes
        return choose_victim(
            Candidate(job_id, lanes.index(job.lane), self.progress(job_id))
            for job_id, job in self.claimed.items()
            if job_id in self.job_tasks and job.lane != lanes[0] and job_id not in self.leaving
            and job_id not in self.lease_lost and job_id not in self.successors and job_id not in self.aborting_tasks)

    async def _preempt(self, token_lane: str) -> None:
        """A preemption token of ``token_lane`` arrived: claim the waiting job and give it the
        victim's slot. With a free slot meanwhile, the main loop's claim takes the job instead;
        with no victim left (its lower-lane jobs ended), the token goes back for another worker."""
        if self._can_claim():
            return
        victim = self._victim()
        if victim is None or victim.lane_index <= self.queue.keys.lanes.index(token_lane):
            with contextlib.suppress(Exception):
                await self.queue.return_preemption_token(token_lane)
            return
        victim_job = self.claimed[victim.job_id]
        try:
            job = await self.queue.preempt(victim_job.lane, self.token, self.lease_ms)
        except Exception as exc:  # Redis down: the token is lost; the next claim anywhere takes the job
            log.warning("preemption claim failed (%s: %s)", type(exc).__name__, exc)
            return
        if job is None:
            return
        self.claims += 1
        self.preemptions += 1
        if self.claimed.get(victim.job_id) is not victim_job:      # it ended meanwhile: its slot is free
            await self._start(job)
            return
        log.info("job %s (%s) hands its slot to job %s (%s) and goes back to its lane with %d tokens left",
                 victim.job_id, victim_job.lane, job.id, job.lane, victim.progress.tokens_left)
        self.successors[victim.job_id] = job
        if self.on_preempted is not None:
            self.on_preempted(victim_job)
        task = self.job_tasks.get(victim.job_id)
        if task is not None and victim.job_id not in self.leaving:
            task.cancel()                     # hand back: the attempt flushes its stream first

    def _can_claim(self) -> bool:
        return self.allow_pick_jobs and self.job_counter < self.max_jobs and self.may_claim()

    def nudge(self) -> None:
        """Look for work now (e.g. the claim gate just opened)."""
        self._slot_freed.set()

    async def _tick(self) -> None:
        """Fallback work, once per ``poll_delay_s``: requeue expired leases (any worker may reap any
        job), act on aborts whose notification was missed, and surface crashed job tasks."""
        try:
            reaped = await self.queue.reap()
            if reaped:
                log.warning("requeued %d jobs whose worker stopped renewing their lease", reaped)
            await self._cancel_aborted_jobs()
        except Exception as exc:
            log.warning("queue maintenance failed (%s: %s)", type(exc).__name__, exc)
        for job_id, task in list(self.tasks.items()):
            if task.done():
                del self.tasks[job_id]
                if not task.cancelled() and task.exception() is not None:
                    log.error("job %s: the runtime failed around it: %r", job_id, task.exception())

    async def abort_now(self) -> None:
        """Act on pending aborts now (a cancel notification arrived)."""
        await self._cancel_aborted_jobs()

    # ------------------------------------------------------------------ how a job leaves this worker
    async def finish_job(self, job_id: str, finish: bool, result_data: bytes | None, result_timeout_s: float | None,
                         keep_result_forever: bool, incr_score: int | None, keep_in_progress: float | None) -> None:
        """arq's outcome, as one fenced script: finished (result stored), retried later (Retry),
        or handed back (cancelled by a shutdown or a dead engine: no try is used)."""
        job = self.claimed.get(job_id)
        if job is None:
            return
        self.leaving.add(job_id)            # its lease ends here: the heartbeat stops renewing it
        if finish:
            ttl_ms = int(1000 * (result_timeout_s or self.keep_result_s))
            done = await self.queue.finish(job, result_data, ttl_ms)
        elif incr_score:
            done = await self.queue.retry_later(job, job.ready_ms + incr_score)
        else:
            done = await self.queue.hand_back(job)
        if not done and job_id not in self.lease_lost:
            log.warning("job %s is no longer this worker's (its lease expired and it was requeued); left alone", job_id)

    async def finish_failed_job(self, job_id: str, result_data: bytes | None) -> None:
        """arq failed the job without running it (record expired, unreadable, aborted before start,
        attempts exhausted): store its result and remove it from the queue."""
        job = self.claimed.get(job_id)
        if job is not None:
            self.leaving.add(job_id)
            await self.queue.finish(job, result_data, int(self.keep_result_s * 1000))

    def hand_back_all(self) -> None:
        """Stop claiming and cancel every running job function once; :meth:`finish_job` then hands
        each back. A job still in run_job's prelude is cancelled by the next call, once it started."""
        self.allow_pick_jobs = False
        for task in list(self.job_tasks.values()):
            if not task.cancelling():
                task.cancel()

    async def hand_back_and_wait(self, timeout_s: float = 15.0) -> None:
        """Hand every job back and wait (up to ``timeout_s``) until each has left the worker."""
        deadline = time.monotonic() + timeout_s
        while any(not t.done() for t in self.tasks.values()) and time.monotonic() < deadline:
            self.hand_back_all()
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        """Unlike arq's ``close``, never cancels run_job tasks (that would release a job before its
        hand-back wrote its stream); call :meth:`hand_back_and_wait` first."""
        if self._maintenance is not None:
            self._maintenance.cancel()
            with contextlib.suppress(BaseException):
                await self._maintenance
        for task in (self._wake_task, self._preempt_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if self._pool is None:
            return
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        if self.on_shutdown:
            await self.on_shutdown(self.ctx)
        await self.pool.aclose()
        self._pool = None
