"""The worker's claim loop: when it takes jobs, how it waits, and how a job leaves.

:class:`QueueRuntime` claims jobs from :class:`~slotq.jobs.protocol.redis_queue.RedisQueue` (or its
partitions' :class:`~slotq.jobs.protocol.partitioned_queue.PartitionedQueue`, the same interface) into
at most ``slots`` slots and runs each claimed attempt through arq
(:class:`~slotq.jobs.protocol.arq_adapter.ArqJobRunner`, which it holds: the job record, the
attempt counter, ``job_timeout``, aborts, the outcome and the result record). It replaces what arq
does around a job that cannot scale or cannot be made safe: the polling loop and its
head-of-queue scan, the per-job WATCH/MULTI claim, the lock that is never renewed, and the
finishing writes, which here are fenced scripts of :mod:`slotq.jobs.protocol.scripts`.

Its loop: claim as many jobs as there are free slots; with nothing to claim, wait for whichever
comes first -- a slot freed by a finishing job, a wake token (one enqueue wakes one idle worker), or
the fallback tick (``poll_delay_s``), which also reaps expired leases and re-checks aborts.

A worker whose slots are all busy and that runs a job of a lower lane waits instead for a
preemption token of a lane above it (one enqueue wakes at most one busy worker). It then claims
the waiting job (``PREEMPT``: exactly one worker wins it). While its *reserve* is free (``reserve``:
the engine's spare KV streams that a higher lane may decode in, ``engine.scheduler`` rule 6) the
job runs there, beside the lower-lane jobs, and nobody yields: the worker holds ``slots + 1`` jobs
until one leaves, and claims again only below ``slots``. Otherwise it hands back its victim
(:mod:`slotq.jobs.protocol.preemption`): the victim's attempt is cancelled at the engine's next
step, flushes what it generated to its stream and is handed back without using a try; the claimed
job takes its slot as soon as it has left, and the victim resumes from its stream on any worker.

No lane starves: each lane below the top is guaranteed ``guaranteed_slots(slots, lane_min_share)``
of this worker's slots while it has jobs waiting (``SLOTQ_LANE_MIN_SHARE``, 1 in 8 by default).
Each claim passes what the worker owes each such lane (:meth:`~QueueRuntime.owed_slots`) and
``CLAIM`` fills those slots from that lane first; the victim rule never takes a job from a lane
that holds no more than its guarantee here, and without a victim nothing runs in the reserve
either: a worker whose lower-lane jobs are all guaranteed ones is as full as one of the top lane
alone. Under a flood of interactive jobs the bulk lane thus keeps its slots: at every turnover of
one, the claim refills it from bulk (a job in the reserve would take the slot it leaves).

Within a lane nothing is handed back, but one tenant's backlog must not hold every slot against
another tenant's first job: while its reserve is free, a full worker also waits for a fair-share
token of its lowest lane (left by an enqueue whose tenant had nothing waiting or running) and
claims that job into the reserve (``LEND_RESERVE``: only if its tenant still has nothing running),
telling the engine it is lent the reserve (``ClaimedJob.lent_reserve``).

The loop keeps which job holds which slot in a :class:`~slotq.jobs.worker.slot_ledger.SlotLedger`
(pure: one state object per job) and asks a :class:`~slotq.jobs.worker.preemption_policy.PreemptionPolicy`
(pure) what to do with a busy token and what it owes each lane; it does the Redis calls and runs
the attempts.

What the worker uses: :meth:`~QueueRuntime.run` and :meth:`~QueueRuntime.close`, ``slots`` (the
elastic loop moves it), :attr:`~QueueRuntime.running`, :meth:`~QueueRuntime.stop_claiming`,
:meth:`~QueueRuntime.hand_back_and_wait`, the lease calls (:meth:`~QueueRuntime.leases`,
:meth:`~QueueRuntime.lose_lease`, :meth:`~QueueRuntime.is_current`) and what a running attempt
asks (:meth:`~QueueRuntime.is_aborting`, :meth:`~QueueRuntime.has_lost_lease`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from slotq.jobs.aio import cancel_and_wait
from slotq.jobs.protocol.arq_adapter import ArqJobRunner, Deserializer, ExitKind, JobExit, JobFunction, Serializer
from slotq.jobs.protocol.connection import is_transient
from slotq.jobs.protocol.partitioned_queue import Queue
from slotq.jobs.protocol.preemption import NOT_STARTED, Candidate, Progress
from slotq.jobs.protocol.redis_queue import BusyToken, ClaimedJob
from slotq.jobs.worker import metrics
from slotq.jobs.worker.preemption_policy import Answer, PreemptionPolicy
from slotq.jobs.worker.slot_ledger import SlotLedger

log = logging.getLogger(__name__)


class QueueRuntime:
    """Holds up to ``slots`` jobs of ``queue`` and runs ``job`` (registered as ``function_name``)
    for each, under ``job_timeout_s`` and ``max_tries``; results are kept ``keep_result_s``.

    ``may_claim()``: whether the worker may take jobs now (ready, heartbeat current, not refusing);
    ``on_job_started(job)``: a claim starts here; ``progress(job_id)``: how far a running job's
    attempt has got (the victim policy weighs it); ``on_preempted(victim)``: a job of this worker
    yields its slot to a higher lane; ``on_reserve(job)``: a job runs in the reserve, beside a full
    worker's slots (a higher lane's, or one lent it for its tenant: ``job.lent_reserve``).
    ``on_startup`` runs before the first claim (the model load), ``on_shutdown`` in :meth:`close`
    once every attempt has left. ``lane_min_share``: the share of the slots each lane below the top
    keeps while it has work (``SLOTQ_LANE_MIN_SHARE``; 0 = strict lanes)."""

    def __init__(self, *, function_name: str, job: JobFunction, queue: Queue, token: str, lease_ms: int,
                 slots: int, job_timeout_s: float, keep_result_s: float, max_tries: int, poll_delay_s: float,
                 serializer: Serializer, deserializer: Deserializer, lane_min_share: float = 0.0,
                 may_claim: Callable[[], bool] = lambda: True,
                 on_job_started: Callable[[ClaimedJob], None] | None = None,
                 progress: Callable[[str], Progress] = lambda job_id: NOT_STARTED,
                 on_preempted: Callable[[ClaimedJob], None] | None = None,
                 on_reserve: Callable[[ClaimedJob], None] | None = None,
                 on_startup: Callable[[], Awaitable[None]] | None = None,
                 on_shutdown: Callable[[], Awaitable[None]] | None = None) -> None:
        self.queue = queue
        self.token = token
        self.lease_ms = lease_ms
        self.slots = slots                      # jobs held at most; the elastic loop moves it (<= the initial)
        self.reserve = 0                        # jobs beyond slots the reserve may run (the engine's, once up)
        self.policy = PreemptionPolicy(queue.keys.lanes, lane_min_share)
        self.poll_delay_s = poll_delay_s
        self.on_job_started = on_job_started
        self.ledger = SlotLedger()              # which job holds which slot, and where its attempt stands
        self._lane_min_share = lane_min_share

        def runner_for(queue: Queue) -> ArqJobRunner:
            return ArqJobRunner(
                function_name=function_name, job=job, on_exit=self._job_left, redis=queue.redis,
                keys=queue.arq_keys, job_timeout_s=job_timeout_s, keep_result_s=keep_result_s,
                max_tries=max_tries, serializer=serializer, deserializer=deserializer)

        self._runner_for = runner_for
        self._runner = runner_for(queue)
        self._ended_before = (0, 0)             # jobs complete and failed by the runners of earlier queues
        self._claims_in_flight = 0              # claim commands sent and not yet answered (retarget waits)
        self._may_claim = may_claim
        self._progress = progress
        self._on_preempted = on_preempted
        self._on_reserve = on_reserve
        self._on_startup = on_startup
        self._on_shutdown = on_shutdown
        self._claiming = True
        self._attempts: dict[asyncio.Task[None], str] = {}    # attempt (run_job) -> its job id, until the tick reaps it
        self._slot_freed = asyncio.Event()
        self._wake_task: asyncio.Task[bool] | None = None
        self._busy_task: asyncio.Task[BusyToken | None] | None = None
        self._maintenance: asyncio.Task[None] | None = None
        self._closed = False
        self._failing_since: float | None = None   # first of the claims and reaps that have failed since one worked

    # ------------------------------------------------------------------ what the worker reads
    @property
    def claimed(self) -> dict[str, ClaimedJob]:
        """Job id -> the claim whose attempt runs here."""
        return self.ledger.claims()

    @property
    def running(self) -> int:
        """Jobs holding a slot here."""
        return len(self.ledger)

    @property
    def full(self) -> bool:
        return len(self.ledger) >= self.slots

    @property
    def reserve_free(self) -> bool:
        """A job may still run beyond ``slots`` here, in the engine's reserve (its spare KV streams)."""
        return len(self.ledger) < self.slots + self.reserve

    def owed_slots(self) -> dict[str, int]:
        """Slots this worker owes each lane below the top (:meth:`PreemptionPolicy.owed_slots`)."""
        return self.policy.owed_slots(self.slots, self.ledger.slot_lanes())

    @property
    def idle(self) -> bool:
        """No attempt is running here (every one has left, through its finishing write)."""
        return all(t.done() for t in self._attempts)

    @property
    def jobs_complete(self) -> int:
        """Attempts that returned, since the start."""
        return self._ended_before[0] + self._runner.jobs_complete

    @property
    def jobs_failed(self) -> int:
        """Jobs ended failed or aborted here, since the start (also those failed before running)."""
        return self._ended_before[1] + self._runner.jobs_failed

    @property
    def claiming_now(self) -> bool:
        """A claim command is on its way: jobs may arrive even though no new claim will start."""
        return self._claims_in_flight > 0

    async def retarget(self, queue: Queue) -> None:
        """Claim from ``queue`` from now on (a worker of several models switching to another). Only
        while nothing is held here and no claim is on its way (the caller closed ``may_claim`` and
        waited out :attr:`claiming_now`): the waits for the old queue's tokens end first, so none
        is taken from it for the new one."""
        if len(self.ledger) or not self.idle or self.claiming_now:
            raise RuntimeError("retarget: jobs are still held or being claimed here")
        for task in (self._wake_task, self._busy_task):
            await cancel_and_wait(task)
        self._wake_task = self._busy_task = None
        self._ended_before = (self.jobs_complete, self.jobs_failed)
        self.queue = queue
        self.policy = PreemptionPolicy(queue.keys.lanes, self._lane_min_share)
        self._runner = self._runner_for(queue)
        self.nudge()

    def is_aborting(self, job_id: str) -> bool:
        """Whether ``job_id``'s attempt is being aborted (a producer cancelled it while it ran)."""
        return self._runner.is_aborting(job_id)

    def has_lost_lease(self, job_id: str) -> bool:
        """Whether ``job_id``'s attempt here no longer owns the job (:meth:`lose_lease`)."""
        held = self.ledger.get(job_id)
        return held is not None and held.lease_lost

    def is_current(self, job: ClaimedJob) -> bool:
        """Whether ``job``'s claim still runs on this worker, neither leaving (finishing, retrying,
        handed back) nor lost, or waits there for a slot. A RENEW that names a claim no longer
        current lost nothing: its FINISH may simply have reached Redis first, and saying the job was
        requeued would be false."""
        return self.ledger.is_current(job)

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        """Claim and run jobs until cancelled. Maintenance starts at once -- a worker still loading a
        large model already reaps the jobs of dead workers -- and claiming once ``on_startup`` (the
        model load) is done."""
        self._maintenance = asyncio.create_task(self._maintain(), name="slotq-queue-maintenance")
        if self._on_startup:
            await self._on_startup()
        while True:
            free = self.slots - len(self.ledger)
            if self._can_claim() and free > 0:
                claimed = await self._claim(free)
                if len(claimed) == free:
                    continue                  # took all it could; look again when a slot frees
            await self._wait(self.poll_delay_s)

    async def _maintain(self) -> None:
        while True:
            await self._tick()
            await asyncio.sleep(self.poll_delay_s)

    @contextlib.contextmanager
    def _claim_on_its_way(self) -> Iterator[None]:
        self._claims_in_flight += 1
        try:
            yield
        finally:
            self._claims_in_flight -= 1

    async def _claim(self, free: int) -> list[ClaimedJob]:
        try:
            with self._claim_on_its_way():
                claimed = await self.queue.claim(free, self.token, self.lease_ms, owed=self.owed_slots())
        except Exception as exc:  # Redis down: the next tick tries again (commands already retried ~30 s)
            self._redis_failed("claim", exc)
            await asyncio.sleep(1)
            return []
        self._redis_worked()
        for job in claimed:
            self._start(job)
        return claimed

    def _start(self, job: ClaimedJob) -> None:
        """Run ``job``'s attempt in a free slot, or, if the job still runs here, once that attempt
        has ended: Redis was unreachable longer than the lease (an outage, a failover), so a reaper
        requeued the job and this claim took it back. The running attempt's lease is void (its
        buffered stream writes are refused); it stops, and the new attempt takes over its slot and
        resumes from what reached the stream."""
        running = self.ledger.get(job.id)
        if running is None:
            self.ledger.take_slot(job)
            self._launch(job)
            return
        log.warning("job %s: claimed again while its attempt still runs here (its lease expired while Redis "
                    "was unreachable); that attempt stops and a new one resumes from its stream", job.id)
        self.ledger.hand_over(job.id, job)
        self.lose_lease(job.id, running.claim.lease)

    def _launch(self, job: ClaimedJob) -> None:
        """Start the attempt of ``job``, which holds a slot in the ledger."""
        task = self._runner.start(job.id, job.ready_ms)
        job_id = job.id
        task.add_done_callback(lambda _task: self._attempt_ended(job_id))
        self._attempts[task] = job_id
        if self.on_job_started is not None:
            self.on_job_started(job)

    def _attempt_ended(self, job_id: str) -> None:
        successor = self.ledger.attempt_ended(job_id)
        if successor is not None:
            self._launch(successor)       # the slot passes straight to the new attempt
            return
        self._slot_freed.set()

    def lose_lease(self, job_id: str, lease: str) -> None:
        """``lease`` no longer owns the job (reaped, or claimed again): stop that attempt (its
        writes are fenced off already). A report about another claim of the job is ignored."""
        if self.ledger.lose_lease(job_id, lease):
            self._runner.cancel(job_id)       # not running yet: the job function checks has_lost_lease

    def leases(self) -> list[ClaimedJob]:
        """The claims whose leases the heartbeat renews: every running attempt not yet lost or
        leaving, and the claims waiting for a lost attempt to end."""
        return self.ledger.leases()

    async def _wait(self, timeout: float) -> None:
        """Until a slot frees, a wake token arrives (only while slots are free), a preemption
        token (only while every slot is busy and a lower-lane job runs) or a fair-share token
        (only while every slot is busy and the reserve is free) arrives, or ``timeout``. The token
        lists a busy wait listens to are chosen when it starts; it ends within ``poll_delay_s``."""
        self._slot_freed.clear()
        waiters: set[asyncio.Future[Any]] = {asyncio.ensure_future(self._slot_freed.wait())}
        if self._can_claim() and self._wake_task is None:
            self._wake_task = asyncio.create_task(self.queue.wait_for_work(self.poll_delay_s), name="slotq-wake")
        victim, fair_lane = self._victim(), self._fair_lane()
        if (victim is not None or fair_lane is not None) and self._busy_task is None:
            below = None if victim is None else self.queue.lane_of(victim.lane_index)
            self._busy_task = asyncio.create_task(
                self.queue.wait_for_busy_token(self.poll_delay_s, below_lane=below, fair_lane=fair_lane),
                name="slotq-busy-wake")
        waiters |= {t for t in (self._wake_task, self._busy_task) if t is not None}
        done, pending = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for fut in pending:
            if fut is not self._wake_task and fut is not self._busy_task:
                fut.cancel()
        if self._wake_task is not None and self._wake_task.done():
            task, self._wake_task = self._wake_task, None
            if await self._token_taken(task) and not self._can_claim():
                with contextlib.suppress(Exception):
                    await self.queue.return_wake_token()   # full meanwhile: pass it on
        if self._busy_task is not None and self._busy_task.done():
            busy_task, self._busy_task = self._busy_task, None
            token = busy_task.result() if await self._token_taken(busy_task) else None
            if token is not None:
                await self._on_busy_token(token)

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
        """The job this worker would hand back for a higher lane (:meth:`PreemptionPolicy.victim`);
        None unless every slot is busy and the worker may claim. A job is a candidate while its job
        function runs and it is neither leaving, lost, aborted nor already yielding its slot."""
        if not (self._claiming and self.full and self._may_claim()):
            return None
        running = ((job, self._progress(job.id)) for job in self.ledger.may_yield()
                   if self._runner.function_running(job.id) and not self._runner.is_aborting(job.id))
        return self.policy.victim(running, slots=self.slots, slot_lanes=self.ledger.slot_lanes())

    def _fair_lane(self) -> str | None:
        """The lane whose fair-share tokens this worker takes (:meth:`PreemptionPolicy.fair_lane`),
        while every slot is busy, its reserve is free and it may claim."""
        if not (self._claiming and self.full and self.reserve_free and self._may_claim()):
            return None
        return self.policy.fair_lane(held.claim.lane for held in self.ledger)

    async def _on_busy_token(self, token: BusyToken) -> None:
        """A busy token arrived: do what :meth:`PreemptionPolicy.answer` says."""
        victim = None if token.fair else self._victim()
        answer = self.policy.answer(token, free_slot=self._can_claim(), victim=victim,
                                    fair_lane=self._fair_lane() if token.fair else None,
                                    reserve_free=self.reserve_free)
        if answer is Answer.CLAIM_INSTEAD:
            return
        if answer is Answer.RETURN_TOKEN:
            with contextlib.suppress(Exception):
                await self.queue.return_busy_token(token)
        elif token.fair:
            await self._lend_reserve(token)
        else:
            assert victim is not None
            await self._preempt(victim, in_reserve=answer is Answer.RUN_IN_RESERVE)

    async def _lend_reserve(self, token: BusyToken) -> None:
        """Claim ``token.lane``'s next job into the reserve if its tenant has nothing running (the
        script checks)."""
        try:
            with self._claim_on_its_way():
                job = await self.queue.lend_reserve(token.lane, self.token, self.lease_ms)
        except Exception as exc:  # Redis down: the token is lost; the job waits for a slot as any other
            self._redis_failed("claim", exc)
            return
        self._redis_worked()
        if job is not None:
            self._run_in_reserve(job, "its tenant has nothing running")

    def _run_in_reserve(self, job: ClaimedJob, why: str) -> None:
        log.info("job %s (%s) runs in the reserve beside %d jobs: %s", job.id, job.lane, len(self.ledger), why)
        if self._on_reserve is not None:
            self._on_reserve(job)
        self._start(job)

    async def _preempt(self, victim: Candidate, *, in_reserve: bool) -> None:
        """Claim the job of a higher lane that waits (``PREEMPT``) and run it in the reserve, or
        give it ``victim``'s slot."""
        victim_job = self.claimed[victim.job_id]
        try:
            with self._claim_on_its_way():
                job = await self.queue.preempt(victim_job.lane, self.token, self.lease_ms, hand_back=not in_reserve)
        except Exception as exc:  # Redis down: the token is lost; the next claim anywhere takes the job
            self._redis_failed("claim", exc)
            return
        self._redis_worked()
        if job is None:
            return
        if in_reserve:
            self._run_in_reserve(job, f"a lane above {victim_job.lane}")
            return
        held = self.ledger.get(victim.job_id)
        if held is None or held.claim is not victim_job:      # it ended meanwhile: its slot is free
            self._start(job)
            return
        log.info("job %s (%s) hands its slot to job %s (%s) and goes back to its lane with %d tokens left",
                 victim.job_id, victim_job.lane, job.id, job.lane, victim.progress.tokens_left)
        self.ledger.hand_over(victim.job_id, job)
        if self._on_preempted is not None:
            self._on_preempted(victim_job)
        if not held.leaving:
            self._runner.cancel(victim.job_id)     # hand back: the attempt flushes its stream first

    def _redis_failed(self, operation: str, error: Exception) -> None:
        """A claim or a reap failed: counted by kind (``slotq_redis_failures_total``), logged, and the
        start of a failing streak noted for ``/ready`` (:meth:`failing_for`). A deterministic error (a Lua
        error, OOM, WRONGTYPE) is logged as an error: the next try gets the same answer until someone acts."""
        metrics.redis_failure(operation, error)
        if self._failing_since is None:
            self._failing_since = time.monotonic()
        if is_transient(error):
            log.warning("%s failed (%s: %s); retrying", operation, type(error).__name__, error)
        else:
            log.error("%s refused by Redis (%s: %s): it will be refused again until this is fixed", operation,
                      type(error).__name__, error)

    def _redis_worked(self) -> None:
        self._failing_since = None

    def failing_for(self) -> float:
        """Seconds since the first of the claims and reaps that have all failed since one last worked (0
        while the last worked)."""
        return 0.0 if self._failing_since is None else time.monotonic() - self._failing_since

    def _can_claim(self) -> bool:
        return self._claiming and not self.full and self._may_claim()

    def stop_claiming(self) -> None:
        """Claim nothing more (draining); running jobs go on."""
        self._claiming = False

    def nudge(self) -> None:
        """Look for work now (e.g. the claim gate just opened)."""
        self._slot_freed.set()

    async def _tick(self) -> None:
        """Fallback work, once per ``poll_delay_s``: requeue expired leases (any worker may reap any
        job), act on aborts whose notification was missed, and surface crashed attempts."""
        try:
            reaped = await self.queue.reap()
        except Exception as exc:
            self._redis_failed("reap", exc)
        else:
            self._redis_worked()
            if reaped:
                log.warning("requeued %d jobs whose worker stopped renewing their lease", reaped)
        try:
            await self._runner.check_aborts()
        except Exception as exc:
            log.warning("queue maintenance failed (%s: %s)", type(exc).__name__, exc)
        for task, job_id in list(self._attempts.items()):
            if task.done():
                del self._attempts[task]
                if not task.cancelled() and task.exception() is not None:
                    log.error("job %s: the runtime failed around it: %r", job_id, task.exception())

    async def abort_now(self) -> None:
        """Act on pending aborts now (a cancel notification arrived)."""
        await self._runner.check_aborts()

    # ------------------------------------------------------------------ how a job leaves this worker
    async def _job_left(self, job_id: str, exit_: JobExit) -> None:
        """An attempt's outcome, as one fenced script: finished (result stored), retried later
        (``Retry``), or handed back (cancelled by a shutdown, a preemption or a dead engine: no try
        is used)."""
        held = self.ledger.start_leaving(job_id)      # its lease ends here: the heartbeat stops renewing it
        if held is None:
            return
        job = held.claim
        if exit_.kind is ExitKind.FINISHED:
            done = await self.queue.finish(job, exit_.result, exit_.result_ttl_ms)
        elif exit_.kind is ExitKind.RETRY_LATER:
            done = await self.queue.retry_later(job, exit_.retry_delay_ms)
        else:
            done = await self.queue.hand_back(job)
        if not done and not held.lease_lost:
            log.warning("job %s is no longer this worker's (its lease expired and it was requeued); left alone", job_id)

    def hand_back_all(self) -> None:
        """Stop claiming and cancel every running job function once; each is then handed back. A
        job still in its attempt's prelude is cancelled by the next call, once it started."""
        self._claiming = False
        self._runner.cancel_all()

    async def hand_back_and_wait(self, timeout_s: float = 15.0) -> None:
        """Hand every job back and wait (up to ``timeout_s``) until each has left the worker."""
        deadline = time.monotonic() + timeout_s
        while not self.idle and time.monotonic() < deadline:
            self.hand_back_all()
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        """Stop the loops, wait for every attempt to leave, run ``on_shutdown`` and close the
        queue's Redis client. Never cancels an attempt (that would release a job before its
        hand-back wrote its stream): call :meth:`hand_back_and_wait` first."""
        for task in (self._maintenance, self._wake_task, self._busy_task):
            await cancel_and_wait(task)
        if self._closed:
            return
        self._closed = True
        await asyncio.gather(*self._attempts, return_exceptions=True)
        if self._on_shutdown:
            await self._on_shutdown()
        await self.queue.redis.aclose()
