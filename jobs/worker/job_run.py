"""One attempt of one job inside a worker: the arq job function's body.

It turns a queued payload into an engine request, resumes from what earlier attempts already
streamed, mirrors engine events into the job's stream, and classifies every way it can end:
success, a non-retryable error (ends at once), a retryable error (``Retry`` with backoff, or a
dead letter when tries are exhausted), cancellation, and the three ways a job is handed back
without using a try: worker shutdown (cancelled), a dead engine and a worker that refuses new jobs
under memory pressure (``RetryJob``). A degraded worker may also cap ``max_tokens``; the result
says so (``max_tokens_cap``).

Its parts: where it resumes (:mod:`slotq.jobs.worker.resume`), what its attempts have cost the job
and what an error costs it (:mod:`slotq.jobs.worker.attempts`: tries, interruptions, worker deaths,
the classification of failures), and the result it returns (:mod:`slotq.jobs.worker.results`).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from enum import Enum
from typing import Any, NoReturn

from slotq.engine import EngineError, Event, GenerationRequest, TextDelta
from slotq.jobs.protocol import dead_letters
from slotq.jobs.protocol.arq_adapter import Retry, RetryJob
from slotq.jobs.protocol.payload import decode_payload
from slotq.jobs.protocol.preemption import Progress
from slotq.jobs.protocol.redis_queue import AttemptLedger, AttemptVerdict
from slotq.jobs.protocol.schemas import (
    EmbeddingJobRequest,
    EntryKind,
    JobKind,
    JobRequest,
    JobResult,
    JobStatus,
    MaxTokensCap,
    RerankJobRequest,
    StreamEntry,
)
from slotq.jobs.protocol.serialization import POISON_MARKER
from slotq.jobs.protocol.streams import StreamOpening
from slotq.jobs.protocol.wire import ErrorInfo, FinishReason, Timings, Usage
from slotq.jobs.worker import metrics, results
from slotq.jobs.worker.attempts import ENGINE_DEAD, AttemptAccount, Failure
from slotq.jobs.worker.elastic.admission import Verdict
from slotq.jobs.worker.engine_api import JobEmbedder, JobEngine, JobRanker, RunningRequest
from slotq.jobs.worker.fault_injection import JobFaults
from slotq.jobs.worker.results import Attribution
from slotq.jobs.worker.resume import Delivered, Replies, delivered_from
from slotq.jobs.worker.served_model import ServedModel
from slotq.jobs.worker.settings import WorkerSettings
from slotq.jobs.worker.start_gate import StartGate
from slotq.jobs.worker.stream_writer import StreamWriter
from slotq.jobs.worker.wire_edge import (
    Done,
    from_engine_finished,
    to_engine_embedding_request,
    to_engine_request,
    to_engine_rerank_request,
    wire_logprobs,
    wire_tool_calls,
)

log = logging.getLogger(__name__)

# A stream write that a shield keeps going once its attempt was cancelled (a hand-back's, an aborted
# or embedding job's final entry) gives up after this long: with Redis down it would otherwise retry
# after the worker stopped. Within the worker's EXIT_MARGIN_S.
SHIELDED_WRITE_BOUND_S = 10.0


class JobRun:
    def __init__(self, *, engine: JobEngine, writer: StreamWriter, settings: WorkerSettings, worker_id: str,
                 job_id: str, attempt: int, enqueued_at: float | None, payload: Any,
                 is_abort: Callable[[], bool], lease_lost: Callable[[], bool],
                 verdict: Callable[..., Verdict] | None = None, ledger: AttemptLedger | None = None,
                 lent_reserve: bool = False, faults: JobFaults = JobFaults(), gate: StartGate | None = None,
                 embedder: JobEmbedder | None = None, ranker: JobRanker | None = None,
                 served: ServedModel | None = None) -> None:
        """``ledger`` judges lost attempts (interrupted or failed); without one (arq's own queue, as
        the arq baseline runs) every attempt spends a try. ``lent_reserve``: the claim lent this
        attempt the worker's reserve (its tenant had nothing running), and so does its engine request.
        ``gate``: the worker's, where suspects start isolated (with a ledger; without one, a suspect
        starts like any job). Whoever runs the attempt calls ``gate.leave`` when it ends. ``embedder``:
        the engine again on an embedding worker, which runs embedding jobs (None on a generation
        worker); ``ranker`` likewise on a rerank worker. ``served``: the model and kind this worker serves; a job
        of another is refused by name
        (:meth:`ServedModel.refusal`) before anything runs. None only where no worker's model is at stake
        (arq's own queue in the baseline benchmark, tests of one attempt)."""
        self.engine = engine
        self.embedder = embedder
        self.ranker = ranker
        self.served = served
        self.writer = writer
        self.settings = settings
        self.worker_id = worker_id
        self.job_id = job_id
        self.attempt = attempt
        self.account = AttemptAccount(job_id=job_id, attempt=attempt, settings=settings, ledger=ledger, gate=gate)
        self.enqueued_at = enqueued_at
        self.payload = payload
        self.is_abort = is_abort
        self.lease_lost = lease_lost
        self.verdict = verdict
        self.lent_reserve = lent_reserve
        self.faults = faults
        self.gate = gate
        self.metadata: dict[str, Any] = {}
        self.cap: MaxTokensCap | None = None
        self.tokens_left: int | None = None    # still to generate, all choices (None until the request is known)
        self.generated = 0                     # tokens this attempt has received
        self.started_at = time.monotonic()

    @property
    def tries(self) -> int:
        """Tries spent with this attempt: the attempts so far that were not interruptions."""
        return self.account.tries

    @property
    def interruptions(self) -> int:
        """Earlier attempts lost after delivering new tokens: no try spent."""
        return self.account.interruptions

    @property
    def progress(self) -> Progress:
        """How far this attempt has got, for the preemption policy."""
        return Progress(tokens_left=self.tokens_left or 0, generated=self.generated, started_at=self.started_at)

    # ------------------------------------------------------------------ entry point
    async def run(self, opening: StreamOpening) -> JobResult:
        """Run the attempt from what its stream held when it opened (:meth:`StreamWriter.open
        <slotq.jobs.worker.stream_writer.StreamWriter.open>`, read even on attempt 1: a job handed back
        on shutdown runs again with the same try number)."""
        if isinstance(self.payload, dict) and POISON_MARKER in self.payload:
            return await self._dead_letter(ErrorInfo(code="poison_payload", retryable=False,
                                                     message=f"unreadable job payload: {self.payload[POISON_MARKER]}"))
        decoded = decode_payload(self.payload)
        if decoded.request is None:
            assert decoded.error is not None
            return await self._dead_letter(decoded.error)
        job = decoded.request
        self.metadata = dict(job.metadata)
        refusal = None if self.served is None else self.served.refusal(
            job, worker=self.worker_id, queue=self.settings.queue_name)
        if refusal is not None:        # kept as a dead letter: requeued once its model serves the queue
            return await self._dead_letter(refusal)
        if self.lease_lost():          # claimed again before this attempt got going
            raise asyncio.CancelledError(f"job {self.job_id}: lease lost before the start")
        delivered = delivered_from(opening)
        if delivered.final is not None and not delivered.trimmed and not (
                job.kind != JobKind.GENERATION and delivered.final.kind == EntryKind.DONE):
            # An earlier attempt finished; only its finish was lost. (An embedding job's vectors and a rerank
            # job's scores are not in its stream: they are computed again.)
            return await self._result_from_stream(delivered)
        start = await self.account.start(delivered.token_count)
        dead_letter = self.account.dead_letter(start, delivered.token_count)
        if dead_letter is not None:
            return await self._dead_letter(dead_letter.error, worker_deaths=dead_letter.worker_deaths)
        if start is not None and start.verdict == AttemptVerdict.START_ISOLATED:
            await self.account.start_isolated(delivered.token_count, start.worker_deaths)
        if not isinstance(job, JobRequest):
            return await self._pooled(job)
        if job.deadline is not None and not delivered.tokens:
            first_token_s = self._first_token_s()
            if time.time() + first_token_s >= job.deadline:
                return await self._fail(ErrorInfo(code="expired", retryable=False, message=(
                    "the job's deadline cannot be met: it passed, or is nearer than one decode step "
                    f"({first_token_s * 1000:.0f} ms on this worker), before the job could start")))
        if delivered.trimmed or (job.n > 1 and delivered.tokens):
            # Start over (the stream's readers discard what came before): several choices cannot resume, and
            # a trimmed stream no longer holds the prefix the job delivered.
            if delivered.trimmed:
                log.warning("job %s: its stream was trimmed (SLOTQ_STREAM_MAXLEN) before this attempt; it starts "
                            "over instead of resuming from a wrong prefix", self.job_id)
            self.writer.add(self.job_id, self.entry(EntryKind.RESTART))
            delivered = Delivered()
        resume = delivered.tokens.get(0, []) if job.n == 1 else []
        max_tokens = job.max_tokens
        if self.verdict is not None:
            verdict = self.verdict(max_tokens=job.max_tokens, resuming=bool(delivered.tokens))
            if verdict.refuse is not None:
                await self._hand_back_refused(verdict.refuse)
            if verdict.cap is not None:
                self.cap = verdict.cap
                max_tokens = verdict.cap.applied
        self.tokens_left = max_tokens * job.n - delivered.token_count
        completed = len(resume) >= job.max_tokens
        request = to_engine_request(job, request_id=self.job_id, max_tokens=max_tokens,
                                    priority_class=self._lane_rank(job.lane), lent_reserve=self.lent_reserve,
                                    resume_tokens=[] if completed else resume)
        if completed:
            return await self._complete_delivered(request, delivered)
        if self.faults.kills_at_start(self.job_id):
            await self.faults.kill_worker(self.writer.write_all(self.job_id))
        output = JobOutput(self, job.n, delivered.replies, delivered.tokens, logprobs=job.logprobs is not None)
        try:
            handle = await self.engine.submit_async(request, output)
        except EngineError as exc:
            if exc.code == ENGINE_DEAD:
                raise RetryJob() from exc          # hand back: not this job's fault, no try used
            return await self._fail(ErrorInfo(code=exc.code, message=exc.message, retryable=exc.retryable,
                                              field=exc.field))
        return await self._follow(handle, output, request, job)

    def _first_token_s(self) -> float:
        """The least time a first token takes here: this worker's mean decode step. A job whose
        deadline is nearer than that would end with nothing, so it is failed as ``expired``
        without taking a slot from others."""
        stats = self.engine.stats()
        return stats.generating_seconds / stats.generating_steps if stats.generating_steps else 0.0

    def _lane_rank(self, lane: str) -> int:
        """The engine's priority class of a lane: the lowest lane 0, each higher one more, so a higher
        lane's prompt is admitted and prefilled before a lower lane's (engine/scheduler.py, rule 3)."""
        lanes = self.settings.lanes
        return len(lanes) - 1 - lanes.index(lane) if lane in lanes else 0

    # ------------------------------------------------------------------ embeddings and rerank
    async def _pooled(self, job: EmbeddingJobRequest | RerankJobRequest) -> JobResult:
        """An embedding or rerank job: all its vectors or scores at once, into the result; the stream gets
        the final entry (usage) that wakes those waiting. Nothing is delivered before the end, so a lost
        attempt made no progress and a retry starts over."""
        try:
            prompt_tokens, answer = await self._pooled_answer(job)
        except EngineError as exc:
            return await self._on_engine_error(ErrorInfo(code=exc.code, message=exc.message, retryable=exc.retryable,
                                                         field=exc.field))
        except asyncio.CancelledError:
            if self.lease_lost():
                self.writer.drop(self.job_id)
                raise
            if not self.is_abort():
                raise                               # handed back: nothing was delivered, nothing to keep
            return await self._end_pooled(FinishReason.CANCELLED, Usage(), status=JobStatus.CANCELLED)
        result = await self._end_pooled(FinishReason.STOP, Usage(prompt_tokens=prompt_tokens),
                                        status=JobStatus.SUCCEEDED)
        return result.model_copy(update=answer)

    async def _pooled_answer(self, job: EmbeddingJobRequest | RerankJobRequest) -> tuple[int, dict[str, Any]]:
        """The engine's answer to a pooled job: its prompt tokens and the result fields that hold it."""
        if isinstance(job, EmbeddingJobRequest):
            assert self.embedder is not None, "refused by ServedModel.refusal: an embedding job on another worker"
            embedded = await self.embedder.embed(to_engine_embedding_request(job, request_id=self.job_id))
            return embedded.prompt_tokens, {
                "embeddings": [base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
                               for row in embedded.vectors],
                "dimensions": embedded.vectors.shape[1]}
        assert self.ranker is not None, "refused by ServedModel.refusal: a rerank job on another worker"
        ranking = await self.ranker.rerank(to_engine_rerank_request(job, request_id=self.job_id))
        return ranking.prompt_tokens, {"scores": [float(score) for score in ranking.scores]}

    async def _end_pooled(self, reason: FinishReason, usage: Usage, *, status: JobStatus) -> JobResult:
        self.writer.add(self.job_id, self.entry(EntryKind.DONE, finish_reason=reason, usage=usage, final=True))
        await self._flush_final_shielded()
        return results.pooled(self._about(), status=status, finish_reason=reason, usage=usage)

    # ------------------------------------------------------------------ streaming
    async def _follow(self, handle: RunningRequest, output: JobOutput, request: GenerationRequest,
                      job: JobRequest) -> JobResult:
        """Wait while :class:`JobOutput` streams the attempt's output, waking only for what needs
        this task: its first tokens (the start gate), an injected kill, its end."""
        replies, tokens, finished = output.replies, output.tokens, output.finished
        try:
            try:
                while (wake := await output.wakes.get()) is not Wake.ENDED:
                    if wake is Wake.FIRST_TOKENS:
                        await self._made_progress()
                    else:
                        await self.faults.kill_worker(self.writer.write_all(self.job_id))
            finally:
                output.close(handle)
            if (failed := output.failed) is not None and failed.error is not None:
                # what the job cost so far: its prompt, and every token its choices delivered
                usage = Usage(prompt_tokens=failed.usage.prompt_tokens, completion_tokens=sum(tokens.values()),
                              cached_prompt_tokens=failed.usage.cached_prompt_tokens)
                return await self._on_engine_error(failed.error, usage)
        except asyncio.CancelledError:
            if self.lease_lost():
                self.writer.drop(self.job_id)              # another worker owns the job and its stream
                raise
            if not self.is_abort():
                # Hand back: the next attempt resumes from what reached the stream.
                await asyncio.shield(self.writer.write_all(self.job_id, within_s=SHIELDED_WRITE_BOUND_S))
                raise
            return await self._cancelled(replies, tokens, finished, request, job)
        await self._flush_final()
        return self._result(replies, finished)

    async def _made_progress(self) -> None:
        """This attempt's first tokens are in hand: it holds no suspect back any more, and if it
        is the suspect that runs isolated, no one, once they are in its stream."""
        assert self.gate is not None
        if self.gate.isolated(self.job_id):
            await self.writer.write_all(self.job_id)
        self.gate.leave(self.job_id)

    async def _complete_delivered(self, request: GenerationRequest, delivered: Delivered) -> JobResult:
        """An earlier attempt streamed every token but died before its final entry: finish the
        stream without generating anything."""
        usage = Usage(prompt_tokens=len(self.engine.prompt_tokens(request)), completion_tokens=len(delivered.tokens[0]))
        finished = Done(choice=0, finish_reason=FinishReason.LENGTH, usage=usage, timings=Timings())
        self.writer.add(self.job_id, self.entry(EntryKind.DONE, finish_reason=FinishReason.LENGTH, usage=usage,
                                                 final=True))
        await self._flush_final()
        return self._result(delivered.replies, {0: finished})

    async def _flush_final(self, *, within_s: float | None = None) -> None:
        """The final entry was queued with the last DONE; make sure it reached Redis (or stop
        trying after ``within_s``: :meth:`StreamWriter.write_all`)."""
        await self.writer.write_all(self.job_id, within_s=within_s)
        if self.lease_lost():
            raise asyncio.CancelledError(f"job {self.job_id}: lease lost while finishing")

    async def _flush_final_shielded(self) -> None:
        """:meth:`_flush_final`, kept going if this attempt is cancelled meanwhile (the worker's
        hand-back cancels every attempt, an aborted or embedding one may be writing its end), and
        so bounded by :data:`SHIELDED_WRITE_BOUND_S`. The bound is inside the shield, where it ends
        the write itself: ``asyncio.timeout`` around a shield would end only the wait for it."""
        await asyncio.shield(self._flush_final(within_s=SHIELDED_WRITE_BOUND_S))

    async def _cancelled(self, replies: Replies, tokens: dict[int, int], finished: dict[int, Done],
                         request: GenerationRequest, job: JobRequest) -> JobResult:
        """Cancelled while running: each choice still open ends here with what it really cost, the
        prompt and the tokens it delivered (the engine's own final event for a cancelled sequence
        never reaches this task, which stopped reading when it was cancelled)."""
        open_choices = [c for c in range(job.n) if c not in finished]
        prompt_tokens = len(self.engine.prompt_tokens(request)) if open_choices else 0
        for i, choice in enumerate(open_choices):
            usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=tokens[choice])
            finished[choice] = Done(choice=choice, finish_reason=FinishReason.CANCELLED, usage=usage, timings=Timings())
            self.writer.add(self.job_id, self.entry(EntryKind.DONE, choice=choice,
                                                     finish_reason=FinishReason.CANCELLED,
                                                     usage=usage, final=i == len(open_choices) - 1))
        await self._flush_final_shielded()
        result = self._result(replies, finished)
        result.status = JobStatus.CANCELLED
        result.finish_reason = FinishReason.CANCELLED
        return result

    # ------------------------------------------------------------------ failures
    async def _on_engine_error(self, error: ErrorInfo, usage: Usage | None = None) -> JobResult:
        """End the attempt as :meth:`AttemptAccount.classify` says; ``usage``: what the job cost
        before the error, which a failed result reports."""
        failure = self.account.classify(error)
        if failure is Failure.HAND_BACK:
            # The worker's engine died under this job: keep what streamed, hand the job back
            # without using a try (the worker exits; another resumes it).
            await self._flush_final()
            raise RetryJob()
        if failure is Failure.FAIL:
            return await self._fail(error, usage)
        if failure is Failure.DEAD_LETTER:
            return await self._dead_letter(error, usage=usage)
        self.writer.add(self.job_id, self.entry(EntryKind.ERROR, error=error))
        await self._flush_final()
        defer = self.account.retry_delay_s()
        metrics.RETRIES.inc()
        log.warning("job %s attempt %d (try %d) failed (%s); retrying in %.1fs", self.job_id, self.attempt,
                    self.tries, error.code, defer)
        raise Retry(defer=defer)

    async def _hand_back_refused(self, error: ErrorInfo) -> NoReturn:
        """The worker refuses new jobs: say why in the stream (a retryable error, not final), and
        hand the job back unstarted without using a try; another worker claims it."""
        self.writer.add(self.job_id, self.entry(EntryKind.ERROR, error=error))
        await self._flush_final()
        log.warning("job %s refused and handed back: %s", self.job_id, error.message)
        raise RetryJob()

    async def _fail(self, error: ErrorInfo, usage: Usage | None = None) -> JobResult:
        self.writer.add(self.job_id, self.entry(EntryKind.ERROR, error=error, usage=usage, final=True))
        await self._flush_final()
        return results.failed(error, self._about(), usage)

    async def _dead_letter(self, error: ErrorInfo, *, worker_deaths: int = 0, usage: Usage | None = None) -> JobResult:
        await dead_letters.record(self.writer.redis, self.job_id, self.payload, error, self.attempt, self.enqueued_at,
                                  queue=self.settings.queue_name, interruptions=self.interruptions,
                                  worker_deaths=worker_deaths)
        metrics.DEAD_LETTERS.labels(reason=error.code).inc()
        log.error("job %s dead-lettered after %d attempts (%d of them interrupted after making progress, %d worker "
                  "deaths in a row): %s", self.job_id, self.attempt, self.interruptions, worker_deaths, error.code)
        return await self._fail(error, usage)

    def entry(self, kind: EntryKind, **fields: Any) -> StreamEntry:
        """A stream entry of this attempt other than a chunk, signed with its worker: the final
        one tells whose attempt ended the job, even when another worker writes the result."""
        return StreamEntry(id="", kind=kind, attempt=self.attempt, worker=self.worker_id, model=self._model_name,
                           model_fingerprint=self._model_fingerprint, **fields)

    @property
    def _model_name(self) -> str | None:
        return self.served.name if self.served is not None else None

    @property
    def _model_fingerprint(self) -> str | None:
        return self.served.fingerprint if self.served is not None else None

    # ------------------------------------------------------------------ results
    def _about(self) -> Attribution:
        """What every result of this attempt says besides its outcome."""
        return Attribution(job_id=self.job_id, worker=self.worker_id, attempts=self.attempt,
                           interruptions=self.interruptions, metadata=self.metadata, max_tokens_cap=self.cap,
                           model=self._model_name, model_fingerprint=self._model_fingerprint)

    def _result(self, replies: Replies, finished: dict[int, Done]) -> JobResult:
        return results.succeeded(replies, finished, self._about())

    async def _result_from_stream(self, delivered: Delivered) -> JobResult:
        """The stream is complete: an earlier attempt ended the job and only its finish was lost
        (:func:`results.from_stream`); this attempt spends no try."""
        ledger = self.account.ledger
        interruptions = await ledger.interruptions() if ledger is not None else 0
        return results.from_stream(delivered, replace(self._about(), interruptions=interruptions))


class Wake(Enum):
    """Why :class:`JobOutput` wakes its attempt's task."""

    FIRST_TOKENS = "first_tokens"    # the attempt made progress: the start gate may let others start
    KILL = "kill"                    # fault injection: the worker dies before these tokens are written
    ENDED = "ended"                  # every choice finished, or one failed (``JobOutput.failed``)


class JobOutput:
    """One attempt's receiver of its engine output (:class:`~slotq.engine.outbox.StepReceiver`),
    called on the worker's event loop once per engine step with the job's events of that step.

    The engine delivers a whole step to every job at once; this puts each text delta straight into
    the stream writer and the replies, and each normally finished choice's done entry, so nothing
    wakes the attempt's task per token. The task wakes (:attr:`wakes`) only when it has something to
    decide: the first tokens, an injected kill, the end (every choice done, or an error, after which
    nothing more of the job is taken). A cancelled task (hand-back, abort, lost lease) calls
    :meth:`close`, which stops the output and cancels the engine request, as leaving a
    :class:`~slotq.engine.RequestHandle`'s iteration does."""

    def __init__(self, run: JobRun, n_choices: int, replies: Replies, delivered: dict[int, list[int]], *,
                 logprobs: bool) -> None:
        """``replies``/``delivered``: what earlier attempts streamed (their tokens per choice).
        ``logprobs``: the job asked for them (a choice with no tokens then has an empty list, as OpenAI's)."""
        self.run = run
        self.n_choices = n_choices
        self.replies = replies
        self.tokens = {c: len(delivered.get(c, [])) for c in range(n_choices)}   # delivered per choice
        self.finished: dict[int, Done] = {}
        self.failed: Done | None = None        # the choice whose error ended the job, if one did
        self.wakes: asyncio.Queue[Wake] = asyncio.Queue()
        self._closed = False
        if logprobs:
            for choice in range(n_choices):
                replies.logprobs.setdefault(choice, [])

    def receive(self, events: list[Event]) -> None:
        for event in events:
            if self._closed:
                return
            if isinstance(event, TextDelta):
                self._delta(event)
            else:
                self._finished(from_engine_finished(event))

    def _delta(self, event: TextDelta) -> None:
        run = self.run
        arriving = len(event.token_ids)
        if run.faults.kill_due(delivered=sum(self.tokens.values()), new=run.generated, arriving=arriving):
            self._end(Wake.KILL)
            return
        tool_calls = wire_tool_calls(event.tool_calls) if event.tool_calls else []
        logprobs = None if event.logprobs is None else wire_logprobs(event.logprobs)
        self.replies.add(event.choice, event.text, event.reasoning, tool_calls, logprobs)
        self.tokens[event.choice] += arriving
        run.generated += arriving
        run.tokens_left = (run.tokens_left or 0) - arriving
        run.writer.add_chunk(run.job_id, attempt=run.attempt, choice=event.choice, text=event.text,
                             token_ids=event.token_ids, n_tokens=event.n_tokens, reasoning=event.reasoning,
                             tool_calls=tool_calls, logprobs=logprobs, prompt_tokens=event.prompt_tokens,
                             cached_prompt_tokens=event.cached_prompt_tokens)
        if run.gate is not None and run.generated == arriving:
            self.wakes.put_nowait(Wake.FIRST_TOKENS)

    def _finished(self, done: Done) -> None:
        self.finished[done.choice] = done
        if done.error is not None:
            self.failed = done
            self._end(Wake.ENDED)
            return
        last = len(self.finished) == self.n_choices
        self.run.writer.add(self.run.job_id, self.run.entry(
            EntryKind.DONE, choice=done.choice, finish_reason=done.finish_reason, stop_sequence=done.stop_sequence,
            usage=done.usage, timings=done.timings, final=last))
        if last:
            self._end(Wake.ENDED)

    def _end(self, wake: Wake) -> None:
        """Take nothing more of this job, and wake its task."""
        self._closed = True
        self.wakes.put_nowait(wake)

    def close(self, handle: RunningRequest) -> None:
        """The attempt stops following its output; a choice still open is cancelled in the engine."""
        self._closed = True
        if len(self.finished) < self.n_choices:
            handle.cancel()
