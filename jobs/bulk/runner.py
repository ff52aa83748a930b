"""The bulk runner: feed an input's lines to the queue through a bounded window, collect the
results, write them out, and remove them from Redis.

Two tasks share a window of ``window`` permits, one per line in Redis:

* the **feeder** reads the input, skips lines the output already holds, parses the rest and
  enqueues each under its derived job id (:mod:`slotq.jobs.bulk.identity`) once it holds a permit. A line
  that cannot be parsed or is rejected at enqueue is recorded as failed and uses no permit.
* the **collector** asks Redis every ``poll_s`` which jobs in flight have a result (one MGET for
  all of them), writes each finished line to the output or errors file, and every ``commit_s``
  makes what it wrote durable, removes those jobs' results and streams from Redis
  (:meth:`SlotqClient.forget`) and only then gives their permits back.

So Redis never holds more than ``window`` of the run's jobs, the runner's memory does not grow with
the input, and a crash at any point loses nothing: a job whose result was not yet written keeps it
in Redis, and the rerun's enqueue of the same id finds it instead of generating the line again.

Jobs go to a low lane (``bulk`` by default): workers claim from it only when the lanes above are
empty, so bulk work fills idle slots and interactive jobs are claimed first.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, Field, computed_field
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from slotq.jobs.bulk import identity
from slotq.jobs.bulk.formats import (
    BulkLine,
    LineError,
    LineFormat,
    error_record,
    failure_of,
    output_record,
    parse_line,
    raw_key,
    rejected,
)
from slotq.jobs.bulk.openai_batch import Endpoint
from slotq.jobs.bulk.output import ResultSink
from slotq.jobs.bulk.source import InputScan, LineSource
from slotq.jobs.errors import JobRejected, QueueFull, QuotaExceeded, RedisUnavailable
from slotq.jobs.openai.errors import ApiError
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.keys import DEFAULT_TENANT, LANE_RE
from slotq.jobs.protocol.schemas import (
    TENANT_PATTERN,
    JobResult,
    JobStatus,
    split_job_id,
    tenant_job_id,
)
from slotq.jobs.protocol.wire import ErrorInfo, Usage

log = logging.getLogger(__name__)

T = TypeVar("T")

MISSING_CHECK_S = 5.0       # how often in-flight jobs are checked for having vanished from Redis
REDIS_PATIENCE_S = 60.0     # a Redis outage longer than this ends the run (a rerun resumes it)
REJECTED_BACKLOG = 1000     # records of bad lines held before the feeder waits for the collector to write them
LEFTOVER_BATCH = 500        # lines a cancelled run leaves, checked for queued jobs in one round trip


class BulkOptions(BaseModel):
    window: int = Field(256, ge=1, le=100_000, description=(
        "lines in Redis at once (queued, running or finished and not yet written); keep it above the fleet's "
        "slots, twice is plenty, so every idle slot finds a bulk job"))
    lane: str = Field("bulk", pattern=LANE_RE.pattern, description="the queue lane the lines go to (SLOTQ_LANES)")
    tenant: str = Field(DEFAULT_TENANT, pattern=TENANT_PATTERN, description=(
        "the tenant every line runs as (the gateway's Batch API: the batch's), so its fair share and quotas apply; "
        "a line naming another tenant is refused"))
    poll_s: float = Field(0.05, gt=0, le=10, description="how often finished jobs are collected")
    commit_s: float = Field(0.5, gt=0, le=60, description="how often written lines are fsynced and removed from Redis")
    endpoint: Endpoint | None = Field(None, description=(
        "accept only OpenAI Batch lines to this endpoint (the gateway's Batch API: a batch has one endpoint)"))
    model: str | None = Field(None, description=(
        "accept only OpenAI Batch lines whose body names this model (the gateway's Batch API: a batch runs on the "
        "queue of one model)"))


class BulkSummary(BaseModel):
    input: str
    output: str
    errors: str
    identity: str = Field(description="the run's identity: job ids are bulk:<identity>:<line>")
    total: int = Field(description="lines in the input (blank lines not counted)")
    done_before: int = Field(description="lines earlier runs finished")
    succeeded: int = Field(description="lines finished by this run")
    failed: int = Field(description="lines of this run in the errors file")
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    interrupted: bool = False
    left_in_queue: int = Field(0, description="an interrupted run's lines still in the queue; a rerun collects them")
    peak_rss_mb: float = Field(0.0, description="the runner process's peak resident memory")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def all_succeeded(self) -> bool:
        """Every line of the input has its output (the command's exit code is 0)."""
        return self.done_before + self.succeeded == self.total

    @computed_field  # type: ignore[prop-decorator]
    @property
    def tokens_per_s(self) -> float:
        return round(self.completion_tokens / self.wall_s, 1) if self.wall_s > 0 else 0.0


def peak_rss_mb() -> float:
    """This process's peak resident memory. Linux's VmHWM, which starts afresh at exec; ru_maxrss
    would also count the parent's memory at the fork that started this process."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


class BulkObserver(Protocol):
    """Progress reports (a live bar in the CLI; the Batch API keeps counts in Redis)."""

    def started(self, total: int, done: int) -> None: ...

    def line_finished(self, ok: bool, usage: Usage) -> None: ...

    def stopped(self, summary: BulkSummary) -> None: ...


@dataclass
class _InFlight:
    line: BulkLine
    job_id: str
    missing: int = 0          # consecutive checks that found the job neither in the queue nor finished


class BulkRun:
    def __init__(self, client: SlotqClient, source: LineSource, sink: ResultSink, *, options: BulkOptions,
                 observer: BulkObserver | None = None, names: tuple[str, str, str] = ("", "", "")) -> None:
        self.client = client
        self.source = source
        self.sink = sink
        self.options = options
        self.observer = observer
        self.names = names                      # input, output, errors: for the summary
        self.scan: InputScan | None = None
        self._window = asyncio.Semaphore(options.window)
        self._inflight: dict[str, _InFlight] = {}
        self._rejected: list[dict[str, Any]] = []   # error records of lines that never became jobs
        self._written: list[str] = []           # jobs whose lines are written, not yet committed
        self._stop = asyncio.Event()
        self._cancelling = False
        self._cancel_reason: ErrorInfo | None = None
        self._leftovers: list[str] = []         # job ids of lines a cancelled run leaves, to cancel in Redis
        self._counts = {"succeeded": 0, "failed": 0, "prompt_tokens": 0, "completion_tokens": 0}

    # ------------------------------------------------------------------ control
    def stop(self) -> None:
        """Stop feeding and return soon. Lines in flight stay queued or running on the fleet;
        running the same input again collects them without generating them again."""
        self._stop.set()

    async def cancel(self, reason: ErrorInfo | None = None) -> None:
        """Stop feeding and cancel every line in flight; they end in the errors file as cancelled.
        With a ``reason`` (a batch's completion window ran out), every line that did not finish --
        in flight or never started -- goes to the errors file with that error instead."""
        self._cancelling = True
        self._cancel_reason = reason
        self._stop.set()
        for job_id in list(self._inflight):
            await self._patiently(partial(self.client.cancel, job_id))

    # ------------------------------------------------------------------ the run
    async def run(self) -> BulkSummary:
        started = time.monotonic()
        if self.options.lane not in self.client.settings.lanes:
            raise JobRejected(f"lane {self.options.lane!r} is not one of this queue's lanes "
                              f"{self.client.settings.lanes} (SLOTQ_LANES)", field="lane")
        self.scan = scan = await self.source.scan(raw_key)
        done_before = await self.sink.open(scan)
        await self._patiently(lambda: self.client.forget(self.sink.recent_job_ids))   # a crash may have left them
        await self._check_fleet()
        if self.observer:
            self.observer.started(scan.requests, done_before)
        feeder = asyncio.create_task(self._feed(scan), name="slotq-bulk-feeder")
        try:
            await self._collect(feeder)
        finally:
            if not feeder.done():
                feeder.cancel()
            await asyncio.gather(feeder, return_exceptions=True)
            await self._commit()
            await self.sink.close()
        summary = BulkSummary(
            input=self.names[0], output=self.names[1], errors=self.names[2], identity=scan.identity,
            total=scan.requests, done_before=done_before, **self._counts, wall_s=round(time.monotonic() - started, 3),
            interrupted=self._stop.is_set() and not self._cancelling, left_in_queue=len(self._inflight),
            peak_rss_mb=peak_rss_mb())
        if self.observer:
            self.observer.stopped(summary)
        return summary

    async def _check_fleet(self) -> None:
        queue = self.client.settings.queue_name
        slots = sum(w.slots_total for w in await self.client.workers() if w.queue == queue)
        if slots == 0:
            log.warning("no worker serves queue %s yet: lines wait in the queue until one starts", queue)
        elif self.options.window < 2 * slots:
            log.info("window %d is under twice the fleet's %d slots: some slots may wait for bulk lines",
                     self.options.window, slots)

    # ------------------------------------------------------------------ feeding
    async def _feed(self, scan: InputScan) -> None:
        lines = self.source.lines()
        async for number, raw in lines:
            if self._stop.is_set():
                await self._leave(scan, number, raw)
                break
            if self.sink.is_done(number):
                continue
            try:
                line = parse_line(raw, number, lane=self.options.lane)
                self._check_expected(line)
                self._check_unique(scan, line)
            except LineError as exc:
                self._reject(number, exc.error, exc.format, exc.key, exc.response)
                await self._rejected_written()
                continue
            await self._window.acquire()
            if self._stop.is_set():
                self._window.release()
                await self._leave(scan, number, raw)
                break
            job_id = self._job_id(scan, number)
            try:
                await self._enqueue(line, job_id)
            except JobRejected as exc:
                self._window.release()
                refused = rejected(line, exc)
                self._reject(number, refused.error, refused.format, refused.key, refused.response)
        if self._cancelling:                       # none of the rest will run
            async for number, raw in lines:
                await self._leave(scan, number, raw)
            await self._cancel_leftovers()

    async def _leave(self, scan: InputScan, number: int, raw: bytes) -> None:
        """A line a cancelled run will not start: cancel the job an earlier run may have left
        queued for it, and, when the cancel has a reason, record the line with it."""
        if not self._cancelling or self.sink.is_done(number):
            return
        self._leftovers.append(self._job_id(scan, number))
        if len(self._leftovers) >= LEFTOVER_BATCH:
            await self._cancel_leftovers()
        if self._cancel_reason is None:
            return
        key: str | None
        try:
            line = parse_line(raw, number, lane=self.options.lane)
            format, key = line.format, line.key
        except LineError as exc:
            format, key = exc.format, exc.key
        self._reject(number, self._cancel_reason, format, key)
        await self._rejected_written()

    async def _cancel_leftovers(self) -> None:
        ids, self._leftovers = self._leftovers, []
        present = await self._patiently(lambda: self.client.queue.in_queue(ids))
        for job_id, here in zip(ids, present, strict=True):
            if here:
                await self._patiently(partial(self.client.cancel, job_id))

    def _job_id(self, scan: InputScan, number: int) -> str:
        """The queue's id of a line's job: the line's bulk id, scoped to the run's tenant."""
        return tenant_job_id(self.options.tenant, identity.job_id(scan.identity, number))

    def _check_expected(self, line: BulkLine) -> None:
        endpoint, model, tenant = self.options.endpoint, self.options.model, self.options.tenant
        if "tenant" in line.request.model_fields_set and line.request.tenant != tenant:
            raise LineError("invalid_request", f"tenant: this run's lines run as tenant {tenant!r} (got "
                            f"{line.request.tenant!r})", format=line.format, key=line.key)
        if endpoint is not None and line.endpoint != endpoint:
            got = f"url {line.endpoint.value!r}" if line.endpoint else "a slotq request"
            raise LineError("invalid_request", f"url: this batch runs {endpoint.value} lines (got {got})",
                            format=line.format, key=line.key)
        if model is not None and line.model != model:
            raise LineError("invalid_request", f"body.model: this batch runs model {model!r} (got {line.model!r}); "
                            "one batch, one model", format=line.format, key=line.key)

    @staticmethod
    def _check_unique(scan: InputScan, line: BulkLine) -> None:
        if not line.own_key:
            return
        first = scan.first_line_with(line.key)
        if first is not None and first != line.number:
            name = "custom_id" if line.format == LineFormat.OPENAI else "id"
            raise LineError("duplicate_id", f"{name} {line.key!r} is also on line {first}; ids must be unique "
                            "(only that line runs)", format=line.format, key=line.key)

    async def _enqueue(self, line: BulkLine, job_id: str) -> None:
        """Enqueue under the line's job id; an existing job of that id (an earlier run's) is adopted."""
        key, tenant = split_job_id(job_id)
        # The model the line is for: the batch's (the gateway's Batch API), else an OpenAI line's body.model.
        # Enqueue refuses it by name when the queue's workers serve another model, and a worker that gets it
        # anyway refuses it too (wrong_model): a run feeds one queue, so one model.
        model = self.options.model or line.model
        named = {"model": model} if model else {}
        request = line.request.model_copy(update={"idempotency_key": key, "tenant": tenant, **named})
        while True:
            try:
                await self._patiently(lambda: self.client.enqueue_request(request))
                break
            except QueueFull:
                await asyncio.sleep(1.0)        # other producers filled the queue: wait for room
            except QuotaExceeded as exc:        # the tenant is at a quota: wait until it has room again
                await asyncio.sleep(exc.retry_after_s or 1.0)
        self._inflight[job_id] = _InFlight(line, job_id)

    async def _rejected_written(self) -> None:
        """A file of bad (or unrun) lines: wait while the collector writes their records out."""
        while len(self._rejected) >= REJECTED_BACKLOG:
            await asyncio.sleep(self.options.poll_s)

    def _reject(self, number: int, error: ErrorInfo, format: LineFormat, key: str | None,
                response: ApiError | None = None) -> None:
        if self.options.endpoint is not None:      # a Batch API run: every error record in OpenAI's shape
            format = LineFormat.OPENAI
        self._rejected.append(error_record(number, error, format=format, key=key, job_id=None, response=response))
        self._counts["failed"] += 1
        if self.observer:
            self.observer.line_finished(False, Usage())

    # ------------------------------------------------------------------ collecting
    async def _collect(self, feeder: asyncio.Task[None]) -> None:
        now = time.monotonic()
        next_commit, next_check = now + self.options.commit_s, now + MISSING_CHECK_S
        while True:
            if feeder.done() and not feeder.cancelled():
                feeder.result()                      # the feeder's error ends the run
            await self._write(await self._patiently(lambda: self.client.finished(list(self._inflight))))
            now = time.monotonic()
            if now >= next_check:
                next_check = now + MISSING_CHECK_S
                await self._requeue_missing()
            finished = feeder.done() and not self._inflight
            stopping = self._stop.is_set() and not (self._cancelling and (self._inflight or not feeder.done()))
            if self._written and (now >= next_commit or finished or stopping
                                  or len(self._written) >= max(1, self.options.window // 4)):
                next_commit = now + self.options.commit_s
                await self._commit()
            if finished or stopping:
                return
            await asyncio.sleep(self.options.poll_s)

    async def _write(self, results: dict[str, JobResult]) -> None:
        outputs: list[tuple[int, dict[str, Any]]] = []
        errors, self._rejected = self._rejected, []
        for job_id, result in results.items():
            item = self._inflight.pop(job_id)
            failure = failure_of(item.line, result)
            ran: str | None = job_id
            if failure is not None and self._cancel_reason is not None and result.status == JobStatus.CANCELLED:
                failure, ran = self._cancel_reason, None       # stopped for the run's reason, not its own
            if failure is None:
                outputs.append((item.line.number, output_record(item.line, job_id, result)))
                self._counts["succeeded"] += 1
                self._counts["prompt_tokens"] += result.usage.prompt_tokens
                self._counts["completion_tokens"] += result.usage.completion_tokens
            else:
                errors.append(error_record(item.line.number, failure, format=item.line.format, key=item.line.key,
                                           job_id=ran))
                self._counts["failed"] += 1
            self._written.append(job_id)
            if self.observer:
                self.observer.line_finished(failure is None, result.usage)
        if outputs or errors:
            await self.sink.write(outputs, errors)

    async def _commit(self) -> None:
        """Make written lines durable, then remove their jobs from Redis and free their permits."""
        written, self._written = self._written, []
        await self.sink.commit()
        if written:
            await self._patiently(lambda: self.client.forget(written))
            for _ in written:
                self._window.release()

    async def _requeue_missing(self) -> None:
        """A job that is neither in the queue nor finished, twice in a row, was lost with Redis's
        data (a restart without persistence): enqueue it again."""
        ids = list(self._inflight)
        present = await self._patiently(lambda: self.client.queue.in_queue(ids))
        absent = [job_id for job_id, here in zip(ids, present, strict=True) if not here]
        finished = await self._patiently(lambda: self.client.finished(absent))
        for job_id, here in zip(ids, present, strict=True):
            item = self._inflight[job_id]
            item.missing = 0 if here or job_id in finished else item.missing + 1
            if item.missing >= 2:
                log.warning("job %s (line %d) vanished from Redis; enqueueing it again", job_id, item.line.number)
                await self._enqueue(item.line, job_id)

    async def _patiently(self, call: Callable[[], Awaitable[T]]) -> T:
        """Retry a Redis call through an outage of up to REDIS_PATIENCE_S (the client already
        retries each command for a few seconds)."""
        deadline = time.monotonic() + REDIS_PATIENCE_S
        delay = 0.5
        while True:
            try:
                return await call()
            except (RedisConnectionError, RedisTimeoutError, RedisUnavailable, OSError) as exc:
                if time.monotonic() > deadline:
                    raise RedisUnavailable(f"Redis unreachable for {REDIS_PATIENCE_S:g} s ({type(exc).__name__}: "
                                           f"{exc}); run the same command again to resume") from exc
                log.warning("Redis unreachable (%s); retrying in %.1f s", type(exc).__name__, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
