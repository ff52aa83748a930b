"""The engine thread: executes the scheduler's plan on llama.cpp, one decode per step.

This is the only code that touches the llama_context after start-up. It turns scheduler output
into KV operations and one ``llama_decode``, samples every sequence that reached the end of its
pending tokens, turns tokens into text (UTF-8 safe, stop strings held back), and reports events
through each request's ``emit`` callback. A failure is contained to the sequences involved: the
thread itself only stops when told to.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.errors import DecodeFailed, EngineError, EngineStopped, KVExhausted
from engine.events import ErrorInfo, Event, Finished, FinishReason, TextDelta, Timings, Usage
from engine.llama_model import LlamaModel
from engine.request import GenerationRequest
from engine.sampling import SamplerChain
from engine.scheduler import KVFullAction, Scheduler, SchedulerOutput
from engine.sequence import Sequence, SeqState
from engine.stats import EngineCounters
from engine.text import StopMatcher, Utf8Stream

log = logging.getLogger(__name__)

Emit = Callable[[Event], None]


@dataclass
class PreparedRequest:
    """A validated request, ready for the engine thread: tokens are known, the grammar parses."""

    request: GenerationRequest
    prompt_tokens: list[int]
    grammar: str | None
    emit: Emit
    make_chain: Callable[[int], SamplerChain]     # choice index -> a fresh sampler chain
    submitted_at: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class _Choice:
    """Runtime state of one sequence (kept on ``Sequence.payload``)."""

    prepared: PreparedRequest
    chain: SamplerChain
    utf8: Utf8Stream = field(default_factory=Utf8Stream)
    stops: StopMatcher = field(default_factory=lambda: StopMatcher([]))
    admitted_at: float | None = None
    first_token_at: float | None = None


class Runner:
    def __init__(self, model: LlamaModel, scheduler: Scheduler, counters: EngineCounters, ctx_per_seq: int) -> None:
        self.model = model
        self.scheduler = scheduler
        self.counters = counters
        self.ctx_per_seq = ctx_per_seq
        self._commands: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._eog_cache: dict[int, bool] = {}
        self._deadlines: dict[str, float] = {}      # request id -> unix time, while it has open choices
        self.thread = threading.Thread(target=self._run, name="slotq-engine", daemon=True)

    # ------------------------------------------------------------------ any thread
    def submit(self, prepared: PreparedRequest) -> None:
        self._commands.put(("submit", prepared))
        self._wake.set()

    def cancel(self, request_id: str) -> None:
        self._commands.put(("cancel", request_id))
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_commands()
                self._expire_deadlines()
                out = self.scheduler.schedule()
                self._apply_memory_ops(out)
                if not out.items:
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
                    continue
                self._step(out)
        except Exception:  # pragma: no cover - a bug in the engine itself
            log.exception("engine thread crashed; failing all requests")
            raise
        finally:
            self._fail_everything(EngineStopped("the engine stopped before this request finished"))

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                self._enqueue(arg)  # type: ignore[arg-type]
            elif kind == "cancel":
                self._cancel(arg)  # type: ignore[arg-type]

    def _enqueue(self, prepared: PreparedRequest) -> None:
        req = prepared.request
        # Resumed tokens count as generated (n_prompt excludes them): they are part of the output.
        base = prepared.prompt_tokens + list(req.resume_tokens)
        leader: Sequence | None = None
        for choice in range(req.n):
            seq = Sequence(
                request_id=req.id,
                tokens=list(base),
                n_prompt=len(prepared.prompt_tokens),
                max_new_tokens=req.max_tokens,
                choice=choice,
                priority=req.priority,
                fork_of=leader,
                fork_len=len(base),
            )
            try:
                chain = prepared.make_chain(choice)
            except EngineError as exc:
                self._finish_unstarted(seq, prepared, exc)
                continue
            for token in req.resume_tokens:
                chain.accept(token)
            state = _Choice(prepared, chain, stops=StopMatcher(list(req.stop)))
            self._replay_delivered_text(state, req.resume_tokens)
            seq.payload = state
            leader = leader or seq
            self.scheduler.add(seq)
        if req.deadline is not None and leader is not None:
            self._deadlines[req.id] = req.deadline

    def _replay_delivered_text(self, state: _Choice, tokens: list[int]) -> None:
        """A resumed attempt rebuilds its text state from the tokens already delivered, so a
        character or stop-string match that spanned the crash point continues seamlessly."""
        for token in tokens:
            state.stops.push(state.utf8.push(self.model.token_bytes(token)))

    def _cancel(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> None:
        """End every choice of a request, queued or running."""
        for seq in self.scheduler.cancel(request_id):
            self._finish(seq, reason)
        for seq in [s for s in self.scheduler.running if s.request_id == request_id]:
            self._finish(seq, reason)

    def _expire_deadlines(self) -> None:
        """Only requests that have a deadline are looked at, so the common case costs nothing."""
        if not self._deadlines:
            return
        now = time.time()
        for request_id in [r for r, deadline in self._deadlines.items() if now >= deadline]:
            del self._deadlines[request_id]
            self._cancel(request_id, FinishReason.DEADLINE)

    def _apply_memory_ops(self, out: SchedulerOutput) -> None:
        for seq_id in out.evicted_caches:
            self.model.kv_remove(seq_id)
        now = time.monotonic()
        for adm in out.admitted:
            slot = adm.seq.seq_id
            assert slot is not None
            self.model.kv_remove(slot, adm.keep if adm.keep > 0 else -1)
            if adm.copy_from is not None:
                self.model.kv_copy_prefix(adm.copy_from, slot, adm.n_reused)
            state: _Choice = adm.seq.payload
            if state.admitted_at is None:
                state.admitted_at = now

    def _step(self, out: SchedulerOutput) -> None:
        tokens: list[int] = []
        positions: list[int] = []
        seq_ids: list[int] = []
        wants: list[bool] = []
        sample_at: list[tuple[Sequence, int]] = []
        for item in out.items:
            seq = item.seq
            for j in range(item.n_tokens):
                tokens.append(seq.tokens[item.start + j])
                positions.append(item.start + j)
                seq_ids.append(seq.seq_id)
                wants.append(False)
            if item.sample:
                wants[-1] = True
                sample_at.append((seq, len(tokens) - 1))
        started = time.perf_counter()
        ret = self.model.decode(tokens, positions, seq_ids, wants)
        self.counters.decoded(len(tokens), n_seqs=len(out.items), seconds=time.perf_counter() - started)
        if ret == 1:
            self._on_kv_full(out)
            return
        if ret != 0:
            self._on_decode_error(out, ret)
            return
        self.scheduler.commit(out)
        leader_index = {id(seq): idx for seq, idx in sample_at}
        for fork in out.forks:
            self.model.kv_remove(fork.seq.seq_id)       # drop any partial reuse: the copy covers it
            self.model.kv_copy_prefix(fork.leader.seq_id, fork.seq.seq_id, fork.n_tokens)
            if fork.seq.n_pending == 0:     # an n > 1 sibling: sample from the leader's prompt logits
                sample_at.append((fork.seq, leader_index[id(fork.leader)]))
        for seq, index in sample_at:
            if seq.state == SeqState.RUNNING:
                self._sample(seq, index)

    def _sample(self, seq: Sequence, batch_index: int) -> None:
        state: _Choice = seq.payload
        token = self.model.sample(state.chain.handle, batch_index)
        seq.tokens.append(token)
        self.counters.generated += 1
        now = time.monotonic()
        if state.first_token_at is None:
            state.first_token_at = now
        request = state.prepared.request
        if self._is_eog(token) and not request.ignore_eos:
            self._finish(seq, FinishReason.STOP)
            return
        match = state.stops.push(state.utf8.push(self.model.token_bytes(token)))
        state.prepared.emit(TextDelta(request_id=seq.request_id, choice=seq.choice, text=match.emit,
                                      token_ids=[token], n_tokens=seq.n_generated))
        if match.stopped:
            self._finish(seq, FinishReason.STOP, flush=False)
        elif seq.n_generated >= request.max_tokens or len(seq.tokens) >= self.ctx_per_seq:
            self._finish(seq, FinishReason.LENGTH)

    def _has_open_choices(self, request_id: str) -> bool:
        return any(s.request_id == request_id for s in (*self.scheduler.running, *self.scheduler.waiting))

    def _is_eog(self, token: int) -> bool:
        hit = self._eog_cache.get(token)
        if hit is None:
            hit = self._eog_cache[token] = self.model.is_eog(token)
        return hit

    def _on_kv_full(self, out: SchedulerOutput) -> None:
        action = self.scheduler.on_kv_full(out)
        self.counters.kv_full_events += 1
        if action == KVFullAction.PREEMPTED:
            self.counters.preemptions += 1
        elif action == KVFullAction.STUCK:
            for item in out.items:
                self._finish(item.seq, FinishReason.ERROR, error=KVExhausted(
                    f"the KV cache ({self.scheduler.config.kv_cells} cells) cannot hold this sequence; "
                    "raise SLOTQ_KV_CELLS or lower max_tokens"), reusable=False)

    def _on_decode_error(self, out: SchedulerOutput, ret: int) -> None:
        log.error("llama_decode returned %d for a batch of %d sequences; failing them", ret, len(out.items))
        error = DecodeFailed(f"llama_decode failed with code {ret}")
        for item in out.items:
            self._finish(item.seq, FinishReason.ERROR, error=error, reusable=False)

    def _finish(self, seq: Sequence, reason: FinishReason, *, error: EngineError | None = None,
                flush: bool = True, reusable: bool = True) -> None:
        if seq.state == SeqState.FINISHED:
            return
        state: _Choice = seq.payload
        request = state.prepared.request
        self.scheduler.finish(seq, reusable=reusable)
        if request.id in self._deadlines and not self._has_open_choices(request.id):
            del self._deadlines[request.id]
        if flush and reason != FinishReason.ERROR:
            # Held partial stop matches are text; a held incomplete character is dropped (Utf8Stream).
            tail = state.stops.flush()
            if tail:
                state.prepared.emit(TextDelta(request_id=seq.request_id, choice=seq.choice, text=tail, token_ids=[],
                                              n_tokens=seq.n_generated))
        state.chain.free()
        now = time.monotonic()
        n_new = max(0, seq.n_generated)
        fresh = n_new - len(request.resume_tokens)        # generated by this attempt
        timings = Timings(
            queue_ms=((state.admitted_at or now) - state.prepared.submitted_at) * 1000,
            ttft_ms=(state.first_token_at - state.prepared.submitted_at) * 1000 if state.first_token_at else None,
            total_ms=(now - state.prepared.submitted_at) * 1000,
            decode_tokens_per_s=((fresh - 1) / (now - state.first_token_at)
                                 if state.first_token_at and fresh > 1 and now > state.first_token_at else None),
        )
        usage = Usage(prompt_tokens=seq.n_prompt, completion_tokens=n_new, cached_prompt_tokens=seq.n_reused)
        info = ErrorInfo(code=error.code, message=error.message, retryable=error.retryable) if error else None
        self.counters.finished(reason)
        state.prepared.emit(Finished(request_id=seq.request_id, choice=seq.choice, finish_reason=reason,
                                     usage=usage, timings=timings, error=info))

    def _finish_unstarted(self, seq: Sequence, prepared: PreparedRequest, error: EngineError) -> None:
        seq.state = SeqState.FINISHED
        prepared.emit(Finished(request_id=seq.request_id, choice=seq.choice, finish_reason=FinishReason.ERROR,
                               usage=Usage(prompt_tokens=seq.n_prompt), timings=Timings(),
                               error=ErrorInfo(code=error.code, message=error.message, retryable=error.retryable)))

    def _fail_everything(self, error: EngineError) -> None:
        self._drain_commands()
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.state == SeqState.WAITING:
                self.scheduler.cancel(seq.request_id)
            self._finish(seq, FinishReason.ERROR, error=error, reusable=False)
