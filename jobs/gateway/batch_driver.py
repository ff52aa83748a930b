"""Running batches inside the gateway: each batch is a bulk run (:class:`~slotq.jobs.bulk.BulkRun`) of its
input file into its output file, in the ``bulk`` lane, driven by exactly one gateway replica.

Every gateway scans the unfinished batches at start and every half lease (and at once when one is
created), and takes the lease of any batch whose lease is free: a new batch, or one whose gateway
died or stopped. Taking it over is resuming it: the bulk run reads its output file back, skips the
lines it holds, and adopts the jobs still in Redis under their derived ids, so a gateway killed
mid-batch costs no line twice. While it runs, the driver renews the lease, writes the progress
counts to Redis, and looks for a cancel (set by whichever replica got ``POST .../cancel``); a lost
lease (Redis unreachable for a whole lease, or another gateway took over) stops the run at once.

A finished batch's webhook event (``batch.completed`` and the rest) is emitted before the batch
leaves the set of unfinished ones, so a gateway that dies between the two emits it at the next
scan (an event emitted twice is delivered once: :func:`~slotq.jobs.gateway.webhooks.emit_event`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time

from redis.exceptions import RedisError

from slotq.jobs.aio import wait_until_set
from slotq.jobs.bulk import BulkOptions, BulkSummary, InputError, OutputError, open_bulk
from slotq.jobs.bulk.formats import LineError, parse_line
from slotq.jobs.bulk.openai_batch import Endpoint
from slotq.jobs.bulk.runner import BulkRun
from slotq.jobs.bulk.source import InputFile
from slotq.jobs.errors import JobRejected
from slotq.jobs.gateway.batches import (
    FINAL_STATUSES,
    Batch,
    BatchError,
    BatchErrors,
    BatchStore,
    BatchUsage,
    RequestCounts,
    error_file_id,
    output_file_id,
)
from slotq.jobs.gateway.files import FileStore
from slotq.jobs.gateway.service import Gateway
from slotq.jobs.gateway.webhooks import EventType, emit_event
from slotq.jobs.openai.errors import ApiError
from slotq.jobs.protocol.schemas import JobKind
from slotq.jobs.protocol.wire import ErrorInfo, Usage

log = logging.getLogger(__name__)

TICK_S = 1.0      # progress writes, cancel checks and lease renewals (at most a third of the lease)
BATCH_EVENTS: dict[str, EventType] = {"completed": "batch.completed", "failed": "batch.failed",
                                      "cancelled": "batch.cancelled", "expired": "batch.expired"}
BATCH_EXPIRED = ErrorInfo(code="batch_expired", retryable=False,
                          message="This request could not be executed before the completion window expired.")


class BatchDriver:
    def __init__(self, gateway: Gateway, batches: BatchStore, files: FileStore) -> None:
        self.gateway = gateway
        self.batches = batches
        self.files = files
        self.lease_s = gateway.settings.gateway_batch_lease_s
        self.token = secrets.token_hex(8)       # this gateway's name on the leases it holds
        self._running: dict[str, _BatchRun] = {}
        self._wake = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop().create_task(self._adopt_forever(), name="slotq-batch-adopter")

    @property
    def running(self) -> bool:
        """Whether its scan for batches to drive is alive (the gateway's /ready)."""
        return self._loop is not None and not self._loop.done()

    def kick(self) -> None:
        """A batch was created: look for work now rather than at the next scan."""
        self._wake.set()

    async def close(self) -> None:
        """Stop every run (their jobs stay queued) and free the leases, so another replica resumes at once."""
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
        for run in self._running.values():
            run.stop()
        tasks = [run.task for run in self._running.values() if run.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=10)

    async def _adopt_forever(self) -> None:
        while True:
            try:
                await self._adopt()
            except (RedisError, OSError) as exc:
                log.warning("batch scan failed (%s: %s); retrying", type(exc).__name__, exc)
            await wait_until_set(self._wake, self.lease_s / 2)
            self._wake.clear()

    async def _adopt(self) -> None:
        for batch_id in await self.batches.active_ids():
            if batch_id in self._running:
                continue
            status = await self.batches.status(batch_id)
            if status is None or status in FINAL_STATUSES:
                await self.retire(batch_id)
            elif await self.batches.acquire(batch_id, self.token):
                run = _BatchRun(self, batch_id)
                self._running[batch_id] = run
                run.task = asyncio.get_running_loop().create_task(self._drive(run), name=f"slotq-{batch_id}")

    async def retire(self, batch_id: str) -> None:
        """The batch is finished: emit its webhook event, then no gateway looks at it again."""
        batch = await self.batches.find(batch_id)
        if batch is not None and batch.status in BATCH_EVENTS:
            await emit_event(self.gateway.client.redis, batch.tenant, BATCH_EVENTS[batch.status], batch.id)
        await self.batches.retire(batch_id)

    async def _drive(self, run: _BatchRun) -> None:
        try:
            await run.drive()
        except Exception:
            log.exception("batch %s: the gateway's run of it failed; another scan resumes it", run.batch_id)
        finally:
            self._running.pop(run.batch_id, None)
            with contextlib.suppress(RedisError, OSError):
                await self.batches.release(run.batch_id, self.token)


class _BatchRun:
    """One batch driven by this gateway, from validation to its final status. Also the bulk run's
    observer: it keeps the counts that the ticker writes to Redis."""

    def __init__(self, driver: BatchDriver, batch_id: str) -> None:
        self.driver = driver
        self.batches = driver.batches
        self.batch_id = batch_id
        self.task: asyncio.Task[None] | None = None
        self.bulk: BulkRun | None = None
        self.counts = RequestCounts()
        self.usage = BatchUsage()
        self.ending: str | None = None          # "cancelled" or "expired" once the run is being cancelled
        self.lost = False                       # the lease is gone: another gateway may drive the batch
        self._stopped = False

    def stop(self) -> None:
        self._stopped = True
        if self.bulk is not None:
            self.bulk.stop()

    # ------------------------------------------------------------------ BulkObserver
    def started(self, total: int, done: int) -> None:
        self.counts = RequestCounts(total=total, completed=done)

    def line_finished(self, ok: bool, usage: Usage) -> None:
        self.usage = self.usage.plus(usage)
        if ok:
            self.counts.completed += 1
        else:
            self.counts.failed += 1

    def stopped(self, summary: BulkSummary) -> None:
        self.counts = RequestCounts(total=summary.total, completed=summary.done_before + summary.succeeded,
                                    failed=summary.failed)

    # ------------------------------------------------------------------ the batch
    async def drive(self) -> None:
        batch = await self.batches.get(self.batch_id)
        # Tokens of the lines earlier gateways ran (a line they ran but had not yet written out
        # runs again here and is counted twice: usage can only err high by the lines in flight).
        self.usage = batch.usage or BatchUsage()
        try:
            await self._drive(batch)
        except (InputError, OutputError, JobRejected) as exc:      # running it again would not help
            await self._fail(batch, BatchError(code="batch_failed", message=str(exc)))

    async def _drive(self, batch: Batch) -> None:
        if batch.status == "cancelling" and batch.queue is None:      # cancelled before it started
            await self.batches.transition(batch.id, {"cancelling"}, "cancelled")
            await self.driver.retire(batch.id)
            return
        if batch.queue is None:
            validated = await self._validate(batch)
            if validated is None or self._stopped:
                return
            batch = validated
        assert batch.queue is not None
        files = self.driver.files
        options = BulkOptions(window=self.driver.gateway.settings.gateway_batch_window, endpoint=batch.endpoint,
                              model=batch.model, tenant=batch.tenant)
        client = self.driver.gateway.queue(batch.queue)
        async with open_bulk(client, files.path(batch.input_file_id), files.path(output_file_id(batch.id)),
                             errors=files.path(error_file_id(batch.id)), options=options, observer=self) as bulk:
            self.bulk = bulk
            if self._stopped:
                return
            if batch.status == "cancelling" or time.time() >= (batch.expires_at or float("inf")):
                # cancelled (or expired) while no gateway drove it
                await self._end(bulk, "cancelled" if batch.status == "cancelling" else "expired")
            log.info("batch %s: running %s on queue %s", batch.id, batch.input_file_id, batch.queue)
            ticker = asyncio.get_running_loop().create_task(self._tick(batch))
            try:
                summary = await bulk.run()
            finally:
                ticker.cancel()
                await asyncio.gather(ticker, return_exceptions=True)
        await self._finish(batch, summary)

    async def _validate(self, batch: Batch) -> Batch | None:
        """Find the batch's model (the first line that names one) and the queue that serves it.
        Returns the batch in progress, or None: failed, or no worker serves the model right now
        (the lease is released and a later scan tries again)."""
        path = self.driver.files.path(batch.input_file_id)
        if not await self.driver.files.exists(batch.input_file_id):
            await self._fail(batch, BatchError(code="file_not_found", param="input_file_id", message=(
                f"the contents of {batch.input_file_id} are missing from SLOTQ_GATEWAY_FILES_DIR")))
            return None
        # the input's checks and reads run in threads (jobs/bulk/disk.py): this loop serves HTTP too
        model, line = await _first_model(await asyncio.to_thread(InputFile, path, ""), batch)
        if model is None:
            await self._fail(batch, BatchError(code="invalid_input_file", param="input_file_id", message=(
                f"no line of {batch.input_file_id} is a valid {batch.endpoint.value} batch line")))
            return None
        try:
            kind = JobKind.EMBEDDING if batch.endpoint == Endpoint.EMBEDDINGS else JobKind.GENERATION
            route = await self.driver.gateway.router.route(model, kind)
        except ApiError as exc:
            if exc.status == 503:
                log.info("batch %s: %s; waiting", batch.id, exc.message)
                return None
            await self._fail(batch, BatchError(code=exc.code, message=exc.message, param="body.model",
                                               line=line))
            return None
        await self.batches.update(batch.id, model=model, queue=route.queue)
        if not await self.batches.transition(batch.id, {"validating"}, "in_progress"):
            log.info("batch %s: cancelled while it was validated", batch.id)
        return await self.batches.get(batch.id)

    async def _fail(self, batch: Batch, error: BatchError) -> None:
        await self.batches.transition(batch.id, {"validating", "in_progress", "cancelling"}, "failed",
                                      errors=BatchErrors(data=[error]))
        await self.driver.retire(batch.id)
        log.warning("batch %s failed: %s", batch.id, error.message)

    async def _tick(self, batch: Batch) -> None:
        """Renew the lease, write the counts, and notice a cancel or the end of the completion window."""
        bulk = self.bulk
        assert bulk is not None
        interval = min(TICK_S, self.driver.lease_s / 3)
        renewed = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            try:
                if not await self.batches.renew(batch.id, self.driver.token):
                    self._lose("another gateway holds its lease")
                    return
                renewed = time.monotonic()
                await self.batches.update(batch.id, request_counts=self.counts, usage=self.usage)
                if self.ending is None:
                    cancelling = await self.batches.status(batch.id) == "cancelling"
                    if cancelling or time.time() >= (batch.expires_at or float("inf")):
                        await self._end(bulk, "cancelled" if cancelling else "expired")
            except (RedisError, OSError) as exc:
                if time.monotonic() - renewed > self.driver.lease_s * 2 / 3:     # stop before another may start
                    self._lose(f"Redis unreachable for most of a lease ({type(exc).__name__})")
                    return

    async def _end(self, bulk: BulkRun, ending: str) -> None:
        """Cancel the lines in flight. Expired: as OpenAI does, every line that did not finish goes
        to the error file as ``batch_expired``; cancelled: only the lines cut short are listed."""
        self.ending = ending
        log.info("batch %s: %s; cancelling its lines in flight", self.batch_id, ending)
        await bulk.cancel(BATCH_EXPIRED if ending == "expired" else None)

    def _lose(self, why: str) -> None:
        log.warning("batch %s: lease lost (%s); stopping this gateway's run of it", self.batch_id, why)
        self.lost = True
        if self.bulk is not None:
            self.bulk.stop()

    async def _finish(self, batch: Batch, summary: BulkSummary) -> None:
        if self.lost or (summary.interrupted and self.ending is None):
            return                     # stopped, not finished: whoever holds the lease next resumes it
        files = self.driver.files
        outputs: dict[str, object] = {"request_counts": self.counts, "usage": self.usage}
        for field, file_id, name in (("output_file_id", output_file_id(batch.id), "output"),
                                     ("error_file_id", error_file_id(batch.id), "errors")):
            if size := await files.size(file_id):   # OpenAI gives no file id for an empty output
                outputs[field] = (await files.register(file_id, f"{batch.id}_{name}.jsonl", "batch_output",
                                                       batch.tenant, size)).id
        if self.ending == "expired":
            done = await self.batches.transition(batch.id, {"in_progress", "cancelling"}, "expired", **outputs)
        elif self.ending is None and await self.batches.transition(batch.id, {"in_progress"}, "finalizing"):
            done = await self.batches.transition(batch.id, {"finalizing"}, "completed", **outputs)
        else:
            done = await self.batches.transition(batch.id, {"cancelling"}, "cancelled", **outputs)
        if done:
            await self.driver.retire(batch.id)
        log.info("batch %s: %s (%d completed, %d failed of %d)", batch.id, await self.batches.status(batch.id),
                 self.counts.completed, self.counts.failed, self.counts.total)


async def _first_model(source: InputFile, batch: Batch) -> tuple[str | None, int | None]:
    """The model named by the first valid line for the batch's endpoint, and that line's number."""
    async for number, raw in source.lines():
        try:
            line = parse_line(raw, number, lane="bulk")
        except LineError:
            continue
        if line.endpoint == batch.endpoint:
            return line.model, number
    return None, None
