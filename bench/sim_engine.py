"""A simulated engine: the one stand-in in the fleet benchmark (``slotq bench fleet``).

It replaces llama.cpp only because thousands of GPU slots cannot fit on a 2-core machine.
Everything around it is real: real :class:`~slotq.jobs.worker.worker.SlotqWorker` instances (claim path,
leases, heartbeat, job function, stream writer), the real producer client and stream readers, and
a real Valkey server. It implements exactly the surface of :class:`engine.Engine` that the job
layer uses (:class:`slotq.jobs.worker.engine_api.JobEngine`), with the same event types, so the job layer
cannot tell the difference except by the text.

What it simulates is a GPU slot's pace, nothing else: each sequence yields ``tokens_per_s``
tokens a second up to ``max_tokens`` (resumed tokens count as already generated, as in the real
engine), cancellation ends it at the next step with ``finish_reason: cancelled``, and a request
waits for a free slot when all are busy. Like the real engine, events leave the engine once per
decode step for all sequences together: one timer per engine, never one per sequence, so ten
thousand sequences cost ten thousand list entries, not ten thousand timers. The step
(``step_s``) sets how many tokens one event carries (``tokens_per_s x step_s``); the token pace
of each sequence is kept from its admission time, whatever the step or the event loop's lag.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

from pydantic import BaseModel, Field

from slotq.engine import (
    EngineConfig,
    EngineStats,
    EngineStopped,
    ErrorInfo,
    Finished,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
    PromptTooLong,
    RequestHandle,
    TextDelta,
    Timings,
    Usage,
)
from slotq.engine.outbox import StepReceiver
from slotq.engine.scheduler import SchedulerLimits
from slotq.jobs.worker.engine_api import EngineFactory

WORDS = [" the", " queue", " slot", " token", " fleet", " worker", " stream", " claim"]
VOCAB = len(WORDS)
CHARS_PER_PROMPT_TOKEN = 4          # a prompt's simulated token count: its length / 4, like BPE on English


class SimulationParams(BaseModel):
    """The pace of one simulated slot."""

    tokens_per_s: float = Field(50.0, gt=0, le=10_000, description="tokens each sequence yields per second")
    step_s: float = Field(0.02, gt=0, le=10, description="simulated decode step: events leave once per step")


@dataclass(frozen=True)
class SimulatedModel:
    model_name: str = "simulated"


@dataclass(eq=False)
class _Sequence:
    handle: RequestHandle
    request_id: str
    choice: int
    n_prompt: int
    max_new: int
    generated: int                      # including resumed tokens
    resumed: int
    submitted_at: float
    admitted_at: float = 0.0
    first_token_at: float | None = None
    cancelled: bool = False
    ended: bool = False


class SimulatedEngine:
    """``engine.Engine``'s job-layer surface at a GPU slot's pace; see the module docstring."""

    def __init__(self, config: EngineConfig, params: SimulationParams) -> None:
        self.config = config
        self.params = params
        self.info = SimulatedModel()
        self.ctx_per_seq = config.ctx
        self.reserve_slots = 0          # no spare KV streams to lend a higher lane: it preempts instead
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._by_request: dict[str, list[_Sequence]] = {}
        self._generated = 0
        self._steps = 0
        self._busy_slot_steps = 0
        self._prompt_tokens = 0
        self._finished: dict[str, int] = {}
        self._limits = self.full_limits()
        self._closed = False
        self._task = asyncio.get_running_loop().create_task(self._step_loop(), name="simulated-engine")

    @staticmethod
    def factory(params: SimulationParams) -> EngineFactory:
        """An ``engine_factory`` for :class:`~slotq.jobs.worker.worker.SlotqWorker`."""
        async def start(config: EngineConfig) -> SimulatedEngine:
            return SimulatedEngine(config, params)
        return start

    # ------------------------------------------------------------------ requests
    def prompt_tokens(self, request: GenerationRequest) -> list[int]:
        text = request.prompt if request.messages is None else "".join(m.content for m in request.messages)
        n = max(1, len(text or "") // CHARS_PER_PROMPT_TOKEN)
        return [i % VOCAB for i in range(n)]

    async def submit_async(self, request: GenerationRequest, receiver: StepReceiver | None = None) -> RequestHandle:
        if self._closed:
            raise EngineStopped("the simulated engine is closed")
        if request.n > self.config.slots:
            raise InvalidRequest(f"n is {request.n}; it must be <= the number of slots ({self.config.slots})",
                                 field="n")
        n_prompt = len(self.prompt_tokens(request))
        if n_prompt + request.max_tokens > self.ctx_per_seq:
            raise PromptTooLong(f"prompt is {n_prompt} tokens and max_tokens is {request.max_tokens}; prompt + "
                                f"max_tokens must be <= {self.ctx_per_seq} (per-sequence context)", field="max_tokens")
        handle = RequestHandle(self, request, receiver)   # the real engine's handle: events in, cancel out
        now = time.monotonic()
        resumed = len(request.resume_tokens)
        seqs = [_Sequence(handle, request.id, choice, n_prompt, request.max_tokens, resumed, resumed, now)
                for choice in range(request.n)]
        self._by_request[request.id] = seqs
        self._waiting.extend(seqs)
        self._prompt_tokens += n_prompt
        self._admit(now)
        return handle

    def cancel(self, request_id: str) -> None:
        """A running sequence ends at the next step; one still waiting for a slot ends now."""
        for seq in list(self._by_request.get(request_id, ())):
            if seq.admitted_at:
                seq.cancelled = True
            elif not seq.ended:
                self._waiting.remove(seq)
                self._end(seq, FinishReason.CANCELLED, time.monotonic())

    # ------------------------------------------------------------------ the step loop
    async def _step_loop(self) -> None:
        step = self.params.step_s
        next_at = time.monotonic()
        while True:
            next_at += step
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            now = time.monotonic()
            if now - next_at > step:              # far behind (a loaded machine): do not try to catch up
                next_at = now
            self._step(now)

    def _admit(self, now: float) -> None:
        """Into a free slot at once (a GPU admits at its next step, milliseconds away); the first
        token leaves with the next simulated step."""
        while self._waiting and len(self._running) < self._limits.active_slots:
            seq = self._waiting.popleft()
            seq.admitted_at = now
            self._running.append(seq)

    def _step(self, now: float) -> None:
        self._steps += 1
        self._admit(now)
        self._busy_slot_steps += len(self._running)
        rate = self.params.tokens_per_s
        still: list[_Sequence] = []
        for seq in self._running:
            if seq.cancelled:
                self._end(seq, FinishReason.CANCELLED, now)
                continue
            due = min(seq.max_new, seq.resumed + int((now - seq.admitted_at) * rate) + 1)
            new = due - seq.generated
            if new > 0:
                first = seq.generated
                seq.generated = due
                self._generated += new
                seq.first_token_at = seq.first_token_at or now
                seq.handle.sink.receiver.receive([TextDelta(request_id=seq.request_id, choice=seq.choice,
                                             text="".join(WORDS[i % VOCAB] for i in range(first, due)),
                                             token_ids=[i % VOCAB for i in range(first, due)], n_tokens=due)])
            if seq.generated >= seq.max_new:
                self._end(seq, FinishReason.LENGTH, now)
            else:
                still.append(seq)
        self._running = still

    def _end(self, seq: _Sequence, reason: FinishReason, now: float, error: ErrorInfo | None = None) -> None:
        self._finished[reason.value] = self._finished.get(reason.value, 0) + 1
        seq.ended = True
        if all(s.ended for s in self._by_request.get(seq.request_id, ())):
            self._by_request.pop(seq.request_id, None)
        fresh = seq.generated - seq.resumed
        first = seq.first_token_at
        seq.handle.sink.receiver.receive([Finished(
            request_id=seq.request_id, choice=seq.choice, finish_reason=reason, error=error,
            usage=Usage(prompt_tokens=seq.n_prompt, completion_tokens=seq.generated),
            timings=Timings(queue_ms=(seq.admitted_at - seq.submitted_at) * 1000 if seq.admitted_at else 0.0,
                            ttft_ms=(first - seq.submitted_at) * 1000 if first else None,
                            total_ms=(now - seq.submitted_at) * 1000,
                            decode_tokens_per_s=(fresh - 1) / (now - first) if first and fresh > 1 and now > first
                            else None))])

    # ------------------------------------------------------------------ what the elastic worker adjusts
    async def warm_up(self) -> float:
        """Nothing to warm: a simulated slot has no weights to page in."""
        return 0.0

    def full_limits(self) -> SchedulerLimits:
        return SchedulerLimits(self.config.slots, self.config.batch, self.config.prefill_chunk)

    def set_limits(self, *, active_slots: int | None = None, n_batch: int | None = None,
                   prefill_chunk: int | None = None) -> SchedulerLimits:
        """Only ``active_slots`` means something here (no batches, no prefill); clamped as the engine does."""
        full = self.full_limits()
        self._limits = SchedulerLimits(
            active_slots=min(max(1, active_slots or self._limits.active_slots), full.active_slots),
            n_batch=min(max(1, n_batch or self._limits.n_batch), full.n_batch),
            prefill_chunk=min(max(1, prefill_chunk or self._limits.prefill_chunk), full.prefill_chunk))
        return self._limits

    # ------------------------------------------------------------------ health and introspection
    @property
    def failure(self) -> BaseException | None:
        return None

    async def wait_failed(self) -> BaseException:
        """A simulated engine never dies, so this never returns (as for a real engine that closes cleanly)."""
        never: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        return await never

    def stats(self) -> EngineStats:
        steps = self._steps
        return EngineStats(
            model=self.info.model_name, slots_total=self.config.slots, slots_active=self._limits.active_slots,
            slots_busy=len(self._running),
            waiting=len(self._waiting), decode_steps=steps, prompt_tokens_processed=self._prompt_tokens,
            prompt_tokens_cached=0, generated_tokens=self._generated, kv_cells_used=0, kv_cells_cached=0,
            kv_cells_total=self.config.total_kv_cells,
            avg_busy_slots_per_decode=self._busy_slot_steps / steps if steps else 0.0,
            preemptions=0, kv_full_events=0, decode_seconds=0.0, generating_steps=steps, stream_tokens=steps,
            generating_seconds=steps * self.params.step_s,
            batch_limit=self._limits.n_batch, prefill_chunk_limit=self._limits.prefill_chunk,
            finished=dict(self._finished))

    async def close(self) -> None:
        """Stop stepping; requests still held end with the retryable ``engine_stopped``, as in the real engine."""
        if self._closed:
            return
        self._closed = True
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        error = ErrorInfo(code=EngineStopped.code, message="the simulated engine was closed", retryable=True)
        now = time.monotonic()
        for seq in [*self._running, *self._waiting]:
            self._end(seq, FinishReason.ERROR, now, error)
        self._running.clear()
        self._waiting.clear()
