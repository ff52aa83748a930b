"""Embeddings: many inputs pooled per ``llama_decode``, on one thread that owns the context.

    engine = await EmbeddingEngine.start(EngineConfig(model_path=..., pooling="mean"))
    result = await engine.embed(EmbeddingRequest(inputs=["a text", "another"]))
    result.vectors          # float32 array, one normalised row per input

Each input is a sequence of its own (its own seq id) and a decode packs as many whole inputs as fit
in ``n_batch`` tokens and ``slots`` sequences, taken round-robin from the requests waiting, so one
request of 2,000 inputs does not hold up a request of one. The KV memory is cleared between decodes:
nothing is generated, so nothing needs to stay. ``n_ubatch = n_batch`` and one KV pool (unified), so a
decode is one micro-batch holding every input whole: llama.cpp pools a sequence within a micro-batch
(and an encoder such as BERT needs the whole input in it).

An input longer than the limit (``ctx``, ``batch`` and the model's training context, the least of
them) is refused naming ``input`` and the limit, unless the request asks to ``truncate`` it, as
llama-server's ``truncate`` does (the first tokens are kept). Vectors are normalised as
llama-server's ``--embd-normalize`` does (``embd_normalize``, default 2 = L2).

The engine thread is the only one that touches the context; ``embed`` tokenizes on the caller's
side (a worker thread) and waits on a future the engine thread resolves. The lifecycle, errors and
counters are the generation engine's (:mod:`slotq.engine.state`, :mod:`slotq.engine.errors`,
:class:`~slotq.engine.stats.EngineStats`), so the worker watches, reports and stops both alike.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn, TypeAlias

import llama_cpp
import numpy as np

from slotq.engine.config import EngineConfig, KVLayout, Pooling
from slotq.engine.errors import DecodeFailed, EngineDead, EngineStopped, InvalidRequest
from slotq.engine.llama_devices import read_pooling_hint
from slotq.engine.llama_model import ContextShape, LlamaModel
from slotq.engine.outbox import StepReceiver
from slotq.engine.request import EmbeddingParams, EmbeddingRequest, GenerationRequest
from slotq.engine.scheduler import SchedulerLimits
from slotq.engine.state import EngineState, Lifecycle
from slotq.engine.stats import EngineStats

log = logging.getLogger(__name__)

_POOLING_TYPES = {Pooling.MEAN: llama_cpp.LLAMA_POOLING_TYPE_MEAN, Pooling.CLS: llama_cpp.LLAMA_POOLING_TYPE_CLS,
                  Pooling.LAST: llama_cpp.LLAMA_POOLING_TYPE_LAST}
_POOLING_NAMES = {value: name.value for name, value in _POOLING_TYPES.items()}
# Architectures that only encode (no text generation): llama.cpp's BERT family and T5's encoder.
ENCODER_ARCHITECTURES = frozenset({"bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "jina-bert-v3",
                                   "neo-bert", "modern-bert", "eurobert", "t5encoder"})


@dataclass(frozen=True)
class Embeddings:
    """One request's answer: a row per input, in input order."""

    request_id: str
    vectors: np.ndarray           # float32, shape (inputs, dimensions)
    prompt_tokens: int
    truncated_inputs: int         # inputs cut to the limit (``truncate``)


def normalize(vectors: np.ndarray, mode: int) -> np.ndarray:
    """Each row scaled as llama.cpp's ``common_embd_normalize``: -1 as is, 0 by its largest absolute
    value into the int16 range, 1 by its sum of absolute values, 2 by its Euclidean length, p > 2 by
    its p-norm. A zero row stays zero."""
    if mode < 0:
        return vectors
    magnitudes = np.abs(vectors.astype(np.float64))
    if mode == 0:
        norms = magnitudes.max(axis=1) / 32760.0
    elif mode == 2:
        norms = np.sqrt((magnitudes ** 2).sum(axis=1))
    else:
        norms = (magnitudes ** mode).sum(axis=1) ** (1.0 / mode)
    scale = np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0)
    scaled: np.ndarray = (vectors * scale[:, None]).astype(np.float32)
    return scaled


def is_embedding_model(path: Path) -> bool:
    """Whether the GGUF says it is an embedding model: an encoder architecture (BERT and kin), or a
    pooling type in its header (embedding fine-tunes of decoder models carry one)."""
    architecture, pooling = read_pooling_hint(path)
    return architecture in ENCODER_ARCHITECTURES or (pooling is not None
                                                     and pooling != llama_cpp.LLAMA_POOLING_TYPE_NONE)


def _pooling_type(config: EngineConfig) -> int:
    """llama.cpp's pooling type for ``config.pooling``; ``auto``: the GGUF's own, or mean for a
    model that declares none (a text generator), as ``llama-server --pooling mean`` serves one."""
    if config.pooling != Pooling.AUTO:
        return _POOLING_TYPES[config.pooling]
    _architecture, declared = read_pooling_hint(config.model_path)
    if declared is None or declared == llama_cpp.LLAMA_POOLING_TYPE_NONE:
        return llama_cpp.LLAMA_POOLING_TYPE_MEAN
    return llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED


@dataclass(eq=False)
class _Job:
    """A request inside the engine thread: its tokenized inputs and the rows filled so far."""

    request_id: str
    inputs: list[list[int]]
    vectors: np.ndarray
    prompt_tokens: int
    truncated_inputs: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Embeddings]
    next_input: int = 0
    remaining: int = field(init=False)

    def __post_init__(self) -> None:
        self.remaining = len(self.inputs)

    def resolve(self, outcome: Embeddings | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, outcome)
        except RuntimeError:        # the caller's loop is closed: nobody waits
            pass


def _settle(future: asyncio.Future[Embeddings], outcome: Embeddings | BaseException) -> None:
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


class EmbeddingEngine:
    """Asyncio API over the embedding thread. Its surface matches the generation engine's where the
    worker uses both (config, info, ctx_per_seq, stats, limits, warm-up, failure, close); generation
    requests are refused by name."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # One KV pool for the whole decode (unified), never a stream per sequence: with streams, llama.cpp cuts a
        # batch into micro-batches of equal tokens per sequence (split_equal), so a longer input is pooled over
        # its last part only (tests/engine/test_embedding.py). The price: attention spans the decode's tokens.
        per_input = min(config.ctx, config.batch)
        self.model = LlamaModel(config, ContextShape(n_ctx=config.batch, n_batch=config.batch, n_ubatch=config.batch,
                                                     n_seq_max=config.slots, kv_layout=KVLayout.UNIFIED,
                                                     pooling_type=_pooling_type(config)))
        self.info = self.model.info
        pooling = self.model.pooling_type
        if pooling not in _POOLING_NAMES:
            self.model.close()
            raise RuntimeError(f"{config.model_path.name}: pooling type {pooling} gives no vector per input "
                               "(none or rank); set SLOTQ_POOLING to mean, cls or last")
        self.pooling = _POOLING_NAMES[pooling]
        self.dimensions = self.model.n_embd_out
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
        self.thread = threading.Thread(target=self._run, name="slotq-embeddings", daemon=True)
        self.thread.start()
        self._closed = False
        log.info("embedding model %s: %d dimensions, %s pooling, inputs up to %d tokens, %d per decode of %d tokens",
                 self.info.model_name, self.dimensions, self.pooling, self.ctx_per_seq, self.info.n_seq_max,
                 self.info.n_batch)

    @classmethod
    async def start(cls, config: EngineConfig) -> EmbeddingEngine:
        """Load the model off the event loop and start the engine thread."""
        return await asyncio.to_thread(cls, config)

    # ------------------------------------------------------------------ requests (any thread)
    def tokenize(self, request: EmbeddingParams) -> tuple[list[list[int]], int]:
        """Each input's tokens, checked against the vocabulary and the limit (cut to it when the
        request asks to ``truncate``); also how many were cut. Raises InvalidRequest naming the input."""
        limit, cut = self.ctx_per_seq, 0
        inputs: list[list[int]] = []
        items: list[str | list[int]] = list(request.inputs)
        for i, item in enumerate(items):
            tokens = self.model.tokenize(item) if isinstance(item, str) else item
            if not isinstance(item, str) and max(tokens) >= self.info.n_vocab:
                raise InvalidRequest(f"input {i}: token id {max(tokens)} is outside the vocabulary "
                                     f"(0..{self.info.n_vocab - 1})", field="input")
            if len(tokens) > limit:
                if not request.truncate:
                    raise InvalidRequest(
                        f"input {i} is {len(tokens)} tokens; an input may have at most {limit} (the least of "
                        f"SLOTQ_CTX, SLOTQ_BATCH and the model's training context {self.info.n_ctx_train}); "
                        "ask to truncate it to cut it there", field="input")
                tokens, cut = tokens[:limit], cut + 1
            inputs.append(tokens)
        return inputs, cut

    async def embed(self, request: EmbeddingRequest) -> Embeddings:
        """The vectors of every input. Raises InvalidRequest for an input that cannot be embedded,
        EngineDead / EngineStopped when the engine cannot run it; cancelling the caller cancels
        the request's inputs still waiting."""
        self._lifecycle.raise_unless_running()
        inputs, cut = await asyncio.to_thread(self.tokenize, request)
        loop = asyncio.get_running_loop()
        job = _Job(request.id, inputs, np.zeros((len(inputs), self.dimensions), np.float32),
                   sum(len(t) for t in inputs), cut, loop, loop.create_future())
        self._lifecycle.while_running(lambda: self._commands.put(job))
        try:
            return await job.future
        except asyncio.CancelledError:
            self.cancel(request.id)
            raise

    def cancel(self, request_id: str) -> None:
        """Drop a request's inputs not yet decoded; its ``embed`` ends cancelled."""
        if self._lifecycle.state is EngineState.RUNNING:
            self._commands.put(request_id)

    async def submit_async(self, request: GenerationRequest, receiver: StepReceiver | None = None) -> NoReturn:
        """The generation engine's entry point: this engine generates nothing."""
        raise self._not_a_generator()

    def prompt_tokens(self, request: GenerationRequest) -> NoReturn:
        raise self._not_a_generator()

    def _not_a_generator(self) -> InvalidRequest:
        return InvalidRequest(f"a generation job reached an embedding worker (model {self.info.model_name}, "
                              f"{self.pooling} pooling): send it to the queue of a generation model", field="model")

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

    async def warm_up(self) -> float:
        """Embed one short text through the whole path; returns the seconds it took."""
        started = time.perf_counter()
        await self.embed(EmbeddingRequest(inputs=["Hello"]))
        return time.perf_counter() - started

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
        the tokens embedded."""
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
            log.critical("embedding thread crashed; every request on it ends with engine_dead", exc_info=exc)
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
        rows = normalize(np.stack([self.model.sequence_embedding(seq) for seq in range(len(picked))]),
                         self.config.embd_normalize)
        for (job, index), row in zip(picked, rows, strict=True):
            job.vectors[index] = row
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
            job.resolve(Embeddings(job.request_id, job.vectors, job.prompt_tokens, job.truncated_inputs))

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
