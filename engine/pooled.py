"""The engine of models that answer a pooled output per input instead of generating: embeddings and rerank.

Each input is a sequence of its own (its own seq id) and a decode packs as many whole inputs as fit
in ``n_batch`` tokens and ``slots`` sequences, taken round-robin from the requests waiting, so one
request of 2,000 inputs does not hold up a request of one. The KV memory is cleared between decodes:
nothing is generated, so nothing needs to stay. ``n_ubatch = n_batch`` and one KV pool (unified), so a
decode is one micro-batch holding every input whole: llama.cpp pools a sequence within a micro-batch
(and an encoder such as BERT needs the whole input in it).

:class:`PooledEngine` is that loop; what a row means is its subclass's: a normalised vector
(:class:`~slotq.engine.embedding.EmbeddingEngine`) or a relevance score
(:class:`~slotq.engine.rerank.RerankEngine`, rank pooling). A subclass accepts or refuses the model's
pooling type, turns its request into token lists, reads the rows of a decode, and builds its answer from
a request's :class:`Pooled` rows.

The engine thread is the only one that touches the context; a request is tokenized on the caller's
side (a worker thread) and waits on a future the engine thread resolves. The lifecycle, errors and
counters are the generation engine's (:mod:`slotq.engine.state`, :mod:`slotq.engine.errors`,
:class:`~slotq.engine.stats.EngineStats`), so the worker watches, reports and stops every kind alike.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar, NoReturn, TypeAlias

import numpy as np

from slotq.engine.config import EngineConfig, KVLayout
from slotq.engine.errors import DecodeFailed, EngineDead, EngineStopped, InvalidRequest
from slotq.engine.llama_model import ContextShape, LlamaModel
from slotq.engine.outbox import StepReceiver
from slotq.engine.request import GenerationRequest
from slotq.engine.scheduler import SchedulerLimits
from slotq.engine.state import EngineState, Lifecycle
from slotq.engine.stats import EngineStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pooled:
    """One request's rows, in input order, as the engine thread filled them."""

    rows: np.ndarray              # float32, shape (inputs, width)
    prompt_tokens: int
    truncated_inputs: int


@dataclass(eq=False)
class _Job:
    """A request inside the engine thread: its tokenized inputs and the rows filled so far."""

    request_id: str
    inputs: list[list[int]]
    rows: np.ndarray
    truncated_inputs: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Pooled]
    next_input: int = 0
    remaining: int = field(init=False)

    def __post_init__(self) -> None:
        self.remaining = len(self.inputs)

    def resolve(self, outcome: Pooled | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, outcome)
        except RuntimeError:        # the caller's loop is closed: nobody waits
            pass

    def pooled(self) -> Pooled:
        return Pooled(self.rows, sum(len(t) for t in self.inputs), self.truncated_inputs)


def _settle(future: asyncio.Future[Pooled], outcome: Pooled | BaseException) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


@dataclass
class _Counters:
    decodes: int = 0
    tokens: int = 0
    sequences: int = 0             # inputs, summed over decodes
    finished: int = 0              # requests
    decode_seconds: float = 0.0


_Cancel: TypeAlias = str
_Command: TypeAlias = _Job | _Cancel | SchedulerLimits | None       # None: stop


class PooledEngine:
    """Asyncio API over the thread that decodes whole inputs and reads one pooled row per input. Its
    surface matches the generation engine's where the worker uses both (config, info, ctx_per_seq, stats,
    limits, failure, close); generation requests are refused by name.

    Subclasses set :attr:`worker_name` and :attr:`thread_name` and implement :meth:`_accept` and
    :meth:`_read_rows`; their request methods tokenize and then await :meth:`_pool`."""

    worker_name: ClassVar[str]      # "an embedding worker": in the refusal of a generation request
    thread_name: ClassVar[str]

    def __init__(self, config: EngineConfig, *, pooling_type: int) -> None:
        self.config = config
        # One KV pool for the whole decode (unified), never a stream per sequence: with streams, llama.cpp cuts a
        # batch into micro-batches of equal tokens per sequence (split_equal), so a longer input is pooled over
        # its last part only (tests/engine/test_embedding.py). The price: attention spans the decode's tokens.
        per_input = min(config.ctx, config.batch)
        self.model = LlamaModel(config, ContextShape(n_ctx=config.batch, n_batch=config.batch, n_ubatch=config.batch,
                                                     n_seq_max=config.slots, kv_layout=KVLayout.UNIFIED,
                                                     pooling_type=pooling_type))
        self.info = self.model.info
        try:
            self.width = self._accept(self.model.pooling_type)
        except BaseException:
            self.model.close()
            raise
        # One input must fit in one decode (one micro-batch) and in what the model was trained on.
        self.ctx_per_seq = min(per_input, self.info.n_ctx_seq, self.info.n_ctx_train or per_input)
        self.reserve_slots = 0
        self._full = SchedulerLimits(active_slots=self.info.n_seq_max, n_batch=self.info.n_batch,
                                     prefill_chunk=self.info.n_batch)
        self._limits = self._full
        self._lifecycle = Lifecycle()
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._jobs: deque[_Job] = deque()
        self._counters = _Counters()          # engine thread only
        self._stats = self._snapshot()
        self.thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self.thread.start()
        self._closed = False

    # ------------------------------------------------------------------ what a subclass says
    def _accept(self, pooling_type: int) -> int:
        """Refuse a model whose pooling (llama.cpp's enum, as the context applies it) this engine cannot
        serve, by raising; else the floats of one row."""
        raise NotImplementedError

    def _read_rows(self, n: int) -> np.ndarray:
        """Engine thread: the rows of sequences ``0..n-1`` of the last decode, shape (n, width)."""
        raise NotImplementedError

    def _describe(self) -> str:
        """The model as a refusal names it."""
        return f"model {self.info.model_name}"

    # ------------------------------------------------------------------ requests (any thread)
    @property
    def limit_reason(self) -> str:
        """Why an input may have at most :attr:`ctx_per_seq` tokens, for the messages that refuse one."""
        return f"the least of SLOTQ_CTX, SLOTQ_BATCH and the model's training context {self.info.n_ctx_train}"

    async def _pool(self, request_id: str, inputs: list[list[int]], truncated_inputs: int = 0) -> Pooled:
        """The rows of ``inputs`` (each within :attr:`ctx_per_seq` tokens and the vocabulary: the caller
        checked). Raises EngineDead / EngineStopped when the engine cannot run them; cancelling the caller
        cancels the request's inputs still waiting."""
        self._lifecycle.raise_unless_running()
        loop = asyncio.get_running_loop()
        job = _Job(request_id, inputs, np.zeros((len(inputs), self.width), np.float32), truncated_inputs, loop,
                   loop.create_future())
        self._lifecycle.while_running(lambda: self._commands.put(job))
        try:
            return await job.future
        except asyncio.CancelledError:
            self.cancel(request_id)
            raise

    def cancel(self, request_id: str) -> None:
        """Drop a request's inputs not yet decoded; its caller's wait ends cancelled."""
        if self._lifecycle.state is EngineState.RUNNING:
            self._commands.put(request_id)

    async def submit_async(self, request: GenerationRequest, receiver: StepReceiver | None = None) -> NoReturn:
        """The generation engine's entry point: this engine generates nothing."""
        raise self._not_a_generator()

    def prompt_tokens(self, request: GenerationRequest) -> NoReturn:
        raise self._not_a_generator()

    def _not_a_generator(self) -> InvalidRequest:
        return InvalidRequest(f"a generation job reached {self.worker_name} ({self._describe()}): send it to the "
                              "queue of a generation model", field="model")

    # ------------------------------------------------------------------ runtime limits
    @property
    def full_limits(self) -> SchedulerLimits:
        return self._full

    def set_limits(self, *, active_slots: int | None = None, n_batch: int | None = None,
                   prefill_chunk: int | None = None) -> SchedulerLimits:
        """Cap the inputs (``active_slots``) and tokens (``n_batch``) of one decode while running; a
        decode always takes at least one input. ``prefill_chunk`` has no meaning here."""
        current = self._limits
        self._limits = SchedulerLimits(
            active_slots=min(max(1, current.active_slots if active_slots is None else active_slots),
                             self._full.active_slots),
            n_batch=min(max(1, current.n_batch if n_batch is None else n_batch), self._full.n_batch),
            prefill_chunk=self._full.prefill_chunk)
        self._commands.put(self._limits)
        return self._limits

    # ------------------------------------------------------------------ health
    @property
    def state(self) -> EngineState:
        return self._lifecycle.state

    @property
    def failure(self) -> BaseException | None:
        return self._lifecycle.failure

    async def wait_failed(self) -> BaseException:
        return await self._lifecycle.wait_failed()

    def stats(self) -> EngineStats:
        """A snapshot the engine thread published after its latest decode: ``slots_busy`` counts the
        requests in progress, ``waiting`` their inputs not yet decoded, ``prompt_tokens_processed``
        the tokens decoded."""
        return self._stats

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._lifecycle.close()
        self._commands.put(None)
        await asyncio.to_thread(self.thread.join)
        self.model.close()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while self._lifecycle.state is EngineState.RUNNING:
                if not self._take_commands(block=not self._jobs):
                    break
                self._step()
        except BaseException as exc:  # the context may be inconsistent: nothing more runs here
            log.critical("%s thread crashed; every request on it ends with engine_dead", self.thread_name,
                         exc_info=exc)
            self._lifecycle.fail(exc)
        self._end_all()

    def _take_commands(self, *, block: bool) -> bool:
        """Apply what other threads sent; False once asked to stop."""
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command is None:
                return False
            if isinstance(command, _Job):
                self._jobs.append(command)
            elif isinstance(command, SchedulerLimits):
                self._limits = command
            else:
                self._drop(command)

    def _drop(self, request_id: str) -> None:
        for job in [j for j in self._jobs if j.request_id == request_id]:
            self._jobs.remove(job)
            self._stats = self._snapshot()
            job.resolve(asyncio.CancelledError(f"request {request_id} cancelled"))

    def _plan(self) -> list[tuple[_Job, int]]:
        """Whole inputs for one decode, one per request in turn, within the sequence and token limits."""
        picked: list[tuple[_Job, int]] = []
        tokens, limits = 0, self._limits
        progress = True
        while progress and len(picked) < limits.active_slots:
            progress = False
            for job in self._jobs:
                if job.next_input == len(job.inputs):
                    continue
                size = len(job.inputs[job.next_input])
                if picked and tokens + size > limits.n_batch:
                    continue
                picked.append((job, job.next_input))
                job.next_input += 1
                tokens += size
                progress = True
                if len(picked) == limits.active_slots:
                    break
        self._jobs.rotate(-1)        # the next decode starts with the next request
        return picked

    def _step(self) -> None:
        picked = self._plan()
        if not picked:
            return
        tokens: list[int] = []
        positions: list[int] = []
        seq_ids: list[int] = []
        for seq, (job, index) in enumerate(picked):
            ids = job.inputs[index]
            tokens += ids
            positions += range(len(ids))
            seq_ids += [seq] * len(ids)
        self.model.kv_clear()
        started = time.perf_counter()
        code = self.model.decode(tokens, positions, seq_ids, [True] * len(tokens))
        counters = self._counters
        counters.decode_seconds += time.perf_counter() - started
        if code != 0:
            failed = {job for job, _ in picked}
            for job in failed:
                self._jobs.remove(job)
            self._stats = self._snapshot()
            for job in failed:
                job.resolve(DecodeFailed(f"llama_decode returned {code} for {len(picked)} inputs of "
                                         f"{len(tokens)} tokens"))
            return
        rows = self._read_rows(len(picked))
        for (job, index), row in zip(picked, rows, strict=True):
            job.rows[index] = row
            job.remaining -= 1
        done = [job for job in self._jobs if job.remaining == 0]
        for job in done:
            self._jobs.remove(job)
        counters.decodes += 1
        counters.tokens += len(tokens)
        counters.sequences += len(picked)
        counters.finished += len(done)
        self._stats = self._snapshot()       # before the answers: a caller that has one sees stats that count it
        for job in done:
            job.resolve(job.pooled())

    def _snapshot(self) -> EngineStats:
        """Engine thread only: the counters of this moment as the frozen stats readers get."""
        c = self._counters
        return EngineStats(
            model=self.info.model_name, slots_total=self.info.n_seq_max, slots_active=self._limits.active_slots,
            slots_busy=len(self._jobs), waiting=sum(len(j.inputs) - j.next_input for j in self._jobs),
            decode_steps=c.decodes, prompt_tokens_processed=c.tokens, prompt_tokens_cached=0, generated_tokens=0,
            kv_cells_used=0, kv_cells_cached=0, kv_cells_total=self.info.n_ctx,
            avg_busy_slots_per_decode=c.sequences / c.decodes if c.decodes else 0.0, preemptions=0, kv_full_events=0,
            decode_seconds=c.decode_seconds, generating_steps=0, generating_seconds=0.0,
            batch_limit=self._limits.n_batch,
            prefill_chunk_limit=self._limits.prefill_chunk, finished={"stop": c.finished})

    def _end_all(self) -> None:
        """The thread is ending: every request it holds or that is still queued ends with the
        retryable engine_dead (a crash) or engine_stopped (a close)."""
        failure = self._lifecycle.failure
        error = EngineDead.from_crash(failure) if failure is not None else EngineStopped("the engine is closed")
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Job):
                self._jobs.append(command)
        for job in self._jobs:
            job.resolve(error)
        self._jobs.clear()
