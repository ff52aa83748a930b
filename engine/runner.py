"""The engine thread: executes the scheduler's plan on llama.cpp, one decode per step.

This is the only code that touches the llama_context after start-up. It turns scheduler output
into KV operations and one ``llama_decode``, samples every sequence that reached the end of its
pending tokens, turns tokens into text (UTF-8 safe, stop strings held back), and reports events
through an :class:`~slotq.engine.outbox.Outbox` that leaves the thread once per step, as one batch per
event loop, right after the step's stats snapshot is published (so a caller that has seen an event
sees stats that include it). A token's event is a slotted dataclass, built without a pydantic model or
a reply delta of its own on the plain-text path: the thread makes one per token of every sequence.

What fails one request, and what kills the engine:

* **One request.** Anything raised while admitting a request -- building its sampler chains,
  feeding them the tokens an earlier attempt delivered, replaying their text -- touches only that
  request's new objects, so only that request fails: an :class:`EngineError` as it is, anything
  else as a retryable :class:`RequestFailed`. llama_decode's error codes are not exceptions either:
  a failed decode fails the sequences of that batch (``DecodeFailed``) and the engine goes on, and
  so does a sequence the KV cache can never hold (``KVExhausted``).
* **The engine.** An exception anywhere else in the loop (scheduler, KV ledger, KV operations,
  decode, sampling, cancellation, event delivery) may leave the Python-side bookkeeping out of step
  with llama.cpp's KV cache; going on could hand one request another's cells. The thread then
  fails the engine (``EngineState.FAILED``, which refuses new requests at once), ends every request
  it holds -- running, waiting, or still in its command queue -- with a retryable
  :class:`EngineDead`, and stops. The owner learns of it from ``Engine.wait_failed()``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TypeAlias

import numpy as np

from slotq.engine.constraints import StepMasks, TokenMatcher
from slotq.engine.errors import (
    DecodeFailed,
    EngineDead,
    EngineError,
    EngineStopped,
    GrammarError,
    InvalidRequest,
    KVExhausted,
    RequestFailed,
)
from slotq.engine.events import ErrorInfo, Event, Finished, FinishReason, TextDelta, Timings, Usage
from slotq.engine.fault_injection import EngineFaults
from slotq.engine.llama_model import LlamaModel
from slotq.engine.logprobs import RowLogprobs, StepLogprobs, TokenBytes, as_event
from slotq.engine.lora import BASE, AdapterSet
from slotq.engine.memory_ops import apply_admissions, apply_forks
from slotq.engine.outbox import Outbox, Sink
from slotq.engine.reply_parser import ReplyDelta, ReplyParser, ToolCallError
from slotq.engine.request import GenerationRequest
from slotq.engine.sampling import SamplerChain
from slotq.engine.scheduler import BatchItem, KVFullAction, Scheduler, SchedulerLimits, SchedulerOutput
from slotq.engine.sequence import SeqState, Sequence
from slotq.engine.speculation import Drafter, DraftPlanner, Proposal, propose_drafts
from slotq.engine.state import EngineState, Lifecycle
from slotq.engine.stats import EngineCounters, EngineStats, StatsSnapshot
from slotq.engine.text import StopMatcher, Utf8Stream
from slotq.engine.tools import CallTrigger, ReplySetup

log = logging.getLogger(__name__)


@dataclass(eq=False)
class PreparedRequest:
    """A validated request, ready for the engine thread: tokens are known, its constraint compiles."""

    request: GenerationRequest
    prompt_tokens: list[int]
    sink: Sink
    make_chain: Callable[[int], SamplerChain]     # choice index -> a fresh sampler chain
    reply: ReplySetup | None = None               # how a chat reply is split (None: plain text)
    adapters: AdapterSet = BASE                   # the LoRA adapters it runs under (resolved from request.lora)
    submitted_at: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class _Choice:
    """Runtime state of one sequence (kept on ``Sequence.payload``)."""

    prepared: PreparedRequest
    chain: SamplerChain
    utf8: Utf8Stream = field(default_factory=Utf8Stream)
    stops: StopMatcher = field(default_factory=lambda: StopMatcher([]))
    parser: ReplyParser | None = None
    trigger: CallTrigger | None = None  # watching for a native auto call's start, to arm its grammar there
    special_text: bool = False          # control tokens rendered as text (see ReplySetup.special_tokens_as_text)
    admitted_at: float | None = None
    first_token_at: float | None = None
    reasoning_tokens: int = 0           # tokens generated up to the last one inside (or closing) the think block


@dataclass(frozen=True)
class _End:
    """How a sequence ends, decided while its tokens are taken and applied once its KV is settled."""

    reason: FinishReason
    error: EngineError | None = None
    flush: bool = True
    stop_sequence: str | None = None    # the stop string that ended it


_Command: TypeAlias = PreparedRequest | SchedulerLimits | str
"""What other threads send the engine thread: a request to admit, new limits, or the id of a
request to cancel."""


class Runner:
    def __init__(self, model: LlamaModel, scheduler: Scheduler, ctx_per_seq: int, *,
                 lifecycle: Lifecycle, faults: EngineFaults, drafter: Drafter | None = None,
                 make_planner: Callable[[], DraftPlanner] | None = None) -> None:
        """``make_planner``: speculative decoding's policy, made on the engine thread before its
        first step (it times decodes) and handed to the scheduler."""
        self.model = model
        self.scheduler = scheduler
        self.drafter = drafter
        self._make_planner = make_planner
        self.started = threading.Event()        # set once the thread's start-up work is done (or failed)
        self.ctx_per_seq = ctx_per_seq
        self.lifecycle = lifecycle
        self.faults = faults
        self.counters = EngineCounters()
        self._snapshot: StatsSnapshot = self.counters.snapshot(scheduler, model.info.model_name)   # replaced
        self._outbox = Outbox()
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._eog_cache: dict[int, bool] = {}
        self._deadlines: dict[str, float] = {}      # request id -> unix time, while it has open choices
        self._open: dict[PreparedRequest, set[int]] = {}    # admitted requests -> choices without a Finished yet
        self._logprobs = StepLogprobs()
        self._logprob_rows: dict[int, RowLogprobs] = {}     # this step's batch index -> its raw row's logprobs
        self._masks = StepMasks(model.n_vocab)
        self.thread = threading.Thread(target=self._run, name="slotq-engine", daemon=True)

    # ------------------------------------------------------------------ any thread
    @property
    def stats(self) -> EngineStats:
        """The latest step's stats (built here, on the reader's thread, from the step's snapshot)."""
        return self._snapshot.stats()

    @property
    def snapshot(self) -> StatsSnapshot:
        """The latest step's snapshot, not yet built into stats."""
        return self._snapshot

    def submit(self, prepared: PreparedRequest) -> None:
        """Queue a request; raises EngineDead / EngineStopped unless the engine is running."""
        self.lifecycle.while_running(lambda: self._commands.put(prepared))
        self._wake.set()

    def cancel(self, request_id: str) -> None:
        self._commands.put(request_id)
        self._wake.set()

    def set_limits(self, limits: SchedulerLimits) -> None:
        """Takes effect at the start of the next step (see ``Scheduler.set_limits``)."""
        self._commands.put(limits)
        self._wake.set()

    def stop(self) -> None:
        self.lifecycle.close()
        self._wake.set()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            try:
                if self._make_planner is not None:
                    self.scheduler.drafts = self._make_planner()
            finally:
                self.started.set()
            while self.lifecycle.state is EngineState.RUNNING:
                self._iterate()
        except BaseException as exc:        # see the module docstring: fatal, but never silent
            log.critical("engine thread crashed; every request on it ends with engine_dead", exc_info=exc)
            self.lifecycle.fail(exc)        # refuse new requests before the queue is drained
            self._end_all(EngineDead.from_crash(exc))
        else:
            self._end_all(EngineStopped("the engine stopped before this request finished"))

    def _iterate(self) -> None:
        self._wake.clear()                  # before draining: a command queued after this wakes the wait below
        self._drain_commands()
        self._expire_deadlines()
        step_started = time.perf_counter()
        proposals = self._propose_drafts()
        out = self.scheduler.schedule(proposals)
        self._apply_memory_ops(out)
        if out.items:
            self._fill_drafts(out, proposals)
            self._step(out, proposals, step_started)
            self.faults.after_decode_step(self.counters.decode_steps)
        for request_id in self._publish():
            if self._has_open_choices(request_id):     # (its own final events come back here once more)
                log.warning("request %s: its event loop is closed; cancelling it", request_id)
                self._cancel(request_id)
        if not out.items:
            self._wake.wait(timeout=0.05)

    def _publish(self) -> set[str]:
        """Stats first, then the step's events. Returns requests whose event loop is closed."""
        self._snapshot = self.counters.snapshot(self.scheduler, self.model.info.model_name)
        return self._outbox.flush()

    def _emit(self, prepared: PreparedRequest, event: Event) -> None:
        if isinstance(event, Finished):
            choices = self._open.get(prepared)
            if choices is not None:
                choices.discard(event.choice)
                if not choices:
                    del self._open[prepared]
        self._outbox.put(prepared.sink, event)

    def _drain_commands(self) -> None:
        """One command at a time: after a crash, what was not taken is still in the queue."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, PreparedRequest):
                self._enqueue(command)
            elif isinstance(command, SchedulerLimits):
                self.scheduler.set_limits(command)
            else:
                self._cancel(command)

    def _enqueue(self, prepared: PreparedRequest) -> None:
        req = prepared.request
        self._open[prepared] = set(range(req.n))
        # Resumed tokens count as generated (n_prompt excludes them): they are part of the output.
        base = prepared.prompt_tokens + list(req.resume_tokens)
        leader: Sequence | None = None
        for choice in range(req.n):
            try:
                state = self._new_choice(prepared, choice)
            except EngineError as exc:
                self._fail_unstarted(prepared, choice, exc)
                continue
            except Exception as exc:            # contained: see the module docstring
                log.exception("request %s: admission failed; failing this request only", req.id)
                self._fail_unstarted(prepared, choice, RequestFailed.from_exception(exc, "admitting"))
                continue
            seq = Sequence(
                request_id=req.id,
                tokens=list(base),
                n_prompt=len(prepared.prompt_tokens),
                max_new_tokens=req.max_tokens,
                choice=choice,
                priority_class=req.priority_class,
                priority=req.priority,
                lent_reserve=req.lent_reserve,
                adapters=prepared.adapters,
                fork_of=leader,
                fork_len=len(base),
                payload=state,
            )
            leader = leader or seq
            self.scheduler.add(seq)
        if req.deadline is not None and leader is not None:
            self._deadlines[req.id] = req.deadline

    def _new_choice(self, prepared: PreparedRequest, choice: int) -> _Choice:
        """Everything one choice needs before it can be scheduled; touches no shared state."""
        self.faults.on_admission(prepared.request)
        chain = prepared.make_chain(choice)
        try:
            for token in prepared.request.resume_tokens:
                chain.accept(token)
            reply = prepared.reply
            state = _Choice(prepared, chain, stops=StopMatcher(list(prepared.request.stop)),
                            parser=reply.parser(choice) if reply is not None else None,
                            trigger=reply.trigger() if reply is not None else None,
                            special_text=reply is not None and reply.special_tokens_as_text)
            self._replay_delivered_text(state, prepared.request.resume_tokens)
        except BaseException:
            chain.free()
            raise
        return state

    def _replay_delivered_text(self, state: _Choice, tokens: list[int]) -> None:
        """A resumed attempt rebuilds its text state from the tokens already delivered, so a
        character, a stop-string match or a tool call that spanned the crash point continues
        seamlessly. What the parser makes of them was delivered by the earlier attempt (it is
        deterministic, call ids included), so it is dropped here: each piece reaches the stream once.
        A call's grammar armed on the way follows the tokens after the one that armed it."""
        armed = False
        for i, token in enumerate(tokens):
            piece = self.model.token_bytes(token, special=state.special_text)
            if armed:
                assert state.chain.matcher is not None
                if not state.chain.matcher.follows([token]):
                    raise InvalidRequest(f"resume_tokens: token {token} at position {i} is not allowed by the "
                                         "tool call's grammar", field="resume_tokens")
            elif state.trigger is not None:
                armed = self._arm_at_call(state, piece)
            text = state.stops.push(state.utf8.push(piece)).emit
            if state.parser is not None and text:
                self._push_reply(state, text, i + 1)

    @staticmethod
    def _arm_at_call(state: _Choice, piece: bytes) -> bool:
        """Feed a token's bytes to the choice's call trigger; at a call's start, arm the call's
        grammar past the reply from there on (True). Raises ToolCallError when that text already
        breaks the grammar."""
        assert state.trigger is not None and state.prepared.reply is not None
        call = state.trigger.push(piece)
        if call is None:
            return False
        state.trigger = None
        lazy_call = state.prepared.reply.lazy_call
        assert lazy_call is not None
        state.chain.arm(lazy_call.arm(call))
        return True

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
        apply_admissions(self.model, out)
        now = time.monotonic()
        for adm in out.admitted:
            state: _Choice = adm.seq.payload
            if state.admitted_at is None:
                state.admitted_at = now

    def _propose_drafts(self) -> dict[Sequence, Proposal]:
        """The drafter's proposals for the sequences the planner wants offers from this step."""
        if self.drafter is None or self.scheduler.drafts is None:
            return {}
        return propose_drafts(self.drafter, self.scheduler.drafts, self.scheduler.running, self.ctx_per_seq)

    def _fill_drafts(self, out: SchedulerOutput, proposals: dict[Sequence, Proposal]) -> None:
        """The planned drafts: a proposal's own tokens, or the drafter's work for the rest."""
        on_demand: list[BatchItem] = []
        for item in out.items:
            if item.draft_room:
                tokens = proposals[item.seq].tokens
                if tokens is None:
                    on_demand.append(item)
                else:
                    item.set_draft(tokens)
        if on_demand:
            assert self.drafter is not None
            drafts = self.drafter.draft([(item.seq, item.draft_room) for item in on_demand])
            for item, tokens in zip(on_demand, drafts, strict=True):
                item.set_draft(tokens)

    def _step(self, out: SchedulerOutput, proposals: dict[Sequence, Proposal], step_started: float) -> None:
        tokens: list[int] = []
        positions: list[int] = []
        seq_ids: list[int] = []
        wants: list[bool] = []
        sample_at: list[tuple[Sequence, int, list[int]]] = []
        n_decoding = sum(item.seq.is_decoding for item in out.items)
        generating = n_decoding > 0                                     # someone gets a token this step
        for item in out.items:
            seq = item.seq
            slot = seq.slot
            own = item.n_tokens - len(item.draft)
            tokens.extend(seq.tokens[item.start:item.start + own])
            tokens.extend(item.draft)
            positions.extend(range(item.start, item.start + item.n_tokens))
            seq_ids.extend([slot] * item.n_tokens)
            wants.extend([False] * (own - 1))
            if item.sample:
                wants.extend([True] * (1 + len(item.draft)))     # the last own token's row, and each draft's
                sample_at.append((seq, len(tokens) - 1 - len(item.draft), item.draft))
            else:
                wants.append(False)
        switched = self.model.set_adapters(out.adapters)      # another set's turn (scheduler rule 10)
        started = time.perf_counter()
        ret = self.model.decode(tokens, positions, seq_ids, wants)
        decode_seconds = time.perf_counter() - started
        self.counters.decoded(len(tokens), n_seqs=len(out.items), seconds=decode_seconds)
        if switched:
            self.counters.lora_switches += 1
            self.counters.lora_switch_seconds += decode_seconds
        if ret == 1:
            self._on_kv_full(out)
            return
        if ret != 0:
            self._on_decode_error(out, ret)
            return
        self.scheduler.commit(out)
        apply_forks(self.model, out)
        leader_index = {id(seq): idx for seq, idx, _ in sample_at}
        for fork in out.forks:
            if fork.seq.n_pending == 0:     # an n > 1 sibling: sample from the leader's prompt logits
                sample_at.append((fork.seq, leader_index[id(fork.leader)], []))
        self._compute_logprobs(sample_at)
        self._mask_rows(sample_at)
        generated_before = self.counters.generated
        for seq, index, draft in sample_at:
            if seq.state == SeqState.RUNNING:
                self._generate(seq, index, draft, proposals.get(seq))
        if generating:
            step_seconds = time.perf_counter() - step_started
            self.counters.generating_step(step_seconds, (self.counters.generated - generated_before) / len(sample_at))
            if self.scheduler.drafts is not None:
                self.scheduler.drafts.observe_step(
                    [item.n_tokens for item in out.items], decode_seconds, step_seconds, started=step_started,
                    n_generating=n_decoding, tokens=self.counters.generated - generated_before,
                    drafted=any(item.draft for item in out.items))

    def _generate(self, seq: Sequence, index: int, draft: list[int], proposal: Proposal | None) -> None:
        """Take the tokens of one sequence's step: the row at ``index``, and one row more per draft
        token while each sampled token equals the draft token before its row (so every kept token
        was sampled from the model given the real tokens before it: the speculation module's
        docstring says why that is exact). Then forget the rejected drafts' cells, and end the
        sequence if a token ended it. An offered proposal that was not sent is shadow-tested
        against the sampled token, so the planner learns its acceptance for free."""
        tested = accepted = 0
        end: _End | None = None
        for i in range(len(draft) + 1):
            token, end = self._take(seq, index + i)
            if i < len(draft):
                tested += 1
                accepted += token == draft[i]
            if end is not None or i == len(draft) or token != draft[i]:
                break
        planner = self.scheduler.drafts
        if draft:
            assert planner is not None
            self.counters.spec_draft_tokens += len(draft)
            self.counters.spec_accepted_tokens += accepted
            planner.observe(seq, tested, accepted, proposal.match if proposal is not None else 0)
        elif planner is not None and proposal is not None and proposal.tokens and end is None:
            planner.observe(seq, 1, int(seq.tokens[-1] == proposal.tokens[0]), proposal.match)
        if draft and self.scheduler.settle_drafts(seq):
            self.model.kv_remove(seq.slot, seq.n_computed)
        if end is not None:
            self._finish(seq, end.reason, error=end.error, flush=end.flush, stop_sequence=end.stop_sequence)

    def _take(self, seq: Sequence, batch_index: int) -> tuple[int | None, _End | None]:
        """Sample one token from a row, append it and emit its text; returns it and, if it ends the
        sequence, how (the caller ends it once its KV is settled)."""
        state: _Choice = seq.payload
        logprobs = self._logprob_rows.get(batch_index) if state.prepared.request.logprobs is not None else None
        try:
            token = self.model.sample(state.chain, batch_index)
        except GrammarError as exc:     # its constraint ran out of fuel: this request ends, the batch goes on
            return None, _End(FinishReason.ERROR, error=exc)
        seq.tokens.append(token)
        self.counters.generated += 1
        now = time.monotonic()
        first = state.first_token_at is None
        if first:
            state.first_token_at = now
        request = state.prepared.request
        if self._is_eog(token) and not request.ignore_eos:
            return token, _End(FinishReason.STOP)
        piece = self.model.token_bytes(token, special=state.special_text)
        if state.trigger is not None:
            try:
                self._arm_at_call(state, piece)
            except ToolCallError as exc:
                return token, _End(FinishReason.ERROR, error=exc)
        match = state.stops.push(state.utf8.push(piece))
        token_logprobs = None if logprobs is None else [as_event(logprobs.of(token))]
        if state.parser is None:        # plain text (the common case): no ReplyDelta per token
            delta = TextDelta(request_id=seq.request_id, choice=seq.choice, text=match.emit, token_ids=[token],
                              n_tokens=seq.n_generated, logprobs=token_logprobs)
        else:
            reply = self._push_reply(state, match.emit, seq.n_generated)
            delta = TextDelta(request_id=seq.request_id, choice=seq.choice, text=reply.content,
                              reasoning=reply.reasoning, tool_calls=reply.tool_calls, token_ids=[token],
                              n_tokens=seq.n_generated, logprobs=token_logprobs)
        if first:
            delta.prompt_tokens, delta.cached_prompt_tokens = seq.n_prompt, seq.n_reused
        self._emit(state.prepared, delta)
        if match.stopped or (state.parser is not None and state.parser.error is not None):
            # a broken call fails it there (_reply_tail)
            return token, _End(FinishReason.STOP, flush=False, stop_sequence=match.stop)
        if seq.n_generated >= request.max_tokens or len(seq.tokens) >= self.ctx_per_seq:
            return token, _End(FinishReason.LENGTH)
        return token, None

    @staticmethod
    def _push_reply(state: _Choice, text: str, n_generated: int) -> ReplyDelta:
        """Parse a token's text as the reply's; the token is a reasoning token if the reply was in
        its think block before it or is after it (``<think>`` and ``</think>`` count as reasoning).
        ``n_generated``: the choice's tokens so far, this one included."""
        assert state.parser is not None
        inside = state.parser.thinking
        reply = state.parser.push(text)
        if inside or state.parser.thinking:
            state.reasoning_tokens = n_generated
        return reply

    @staticmethod
    def _reply_tail(state: _Choice, text: str, reason: FinishReason) -> list[ReplyDelta]:
        """What is left of a reply that ends for ``reason``: the text held back, and (a reply
        that ended normally) what its parser held. Raises ToolCallError for a call left unfinished."""
        if state.parser is None:
            return [ReplyDelta(content=text)] if text else []
        tails = [state.parser.push(text)] if text else []
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            tails.append(state.parser.finish(cut=reason == FinishReason.LENGTH))
        return [t for t in tails if t.content or t.reasoning or t.tool_calls]

    def _compute_logprobs(self, sample_at: list[tuple[Sequence, int, list[int]]]) -> None:
        """The raw rows' log-softmax of every row this step samples for a request that asks for
        logprobs (the row of its last token and one per draft token), in one call, before any
        sampler chain or constraint mask touches a row. The siblings of an n > 1 request sample
        their first token from the leader's row, so a row is computed once and read by each."""
        self._logprob_rows = {}
        wanted: dict[int, tuple[int, TokenBytes]] = {}      # batch index -> (top, how its tokens read)
        for seq, index, draft in sample_at:
            state: _Choice = seq.payload
            top = state.prepared.request.logprobs
            if top is not None:
                names = partial(self.model.token_bytes, special=state.special_text)   # as the reply's text reads
                for batch_index in range(index, index + len(draft) + 1):
                    wanted.setdefault(batch_index, (top, names))
        if wanted:
            tops, names_of = zip(*wanted.values(), strict=True)
            rows = self._logprobs.compute([self.model.logits_row(i) for i in wanted], tops, names_of)
            self._logprob_rows = dict(zip(wanted, rows, strict=True))

    def _mask_rows(self, sample_at: list[tuple[Sequence, int, list[int]]]) -> None:
        """Every constrained sequence's first row of this step masked at once (after the logprobs
        read the raw rows). A row two sequences sample (an n > 1 sibling's first token) is masked
        here for the first; the other masks it again at its sample, as a draft row is."""
        rows: dict[int, tuple[TokenMatcher, np.ndarray]] = {}
        for seq, index, _ in sample_at:
            matcher = seq.payload.chain.matcher
            if matcher is not None and index not in rows and seq.state == SeqState.RUNNING:
                rows[index] = (matcher, self.model.logits_row(index))
        self._masks.apply(list(rows.values()))

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
                flush: bool = True, reusable: bool = True, stop_sequence: str | None = None) -> None:
        if seq.state == SeqState.FINISHED:
            return
        state: _Choice = seq.payload
        request = state.prepared.request
        self.scheduler.finish(seq, reusable=reusable, cancelled=reason == FinishReason.CANCELLED)
        if request.id in self._deadlines and not self._has_open_choices(request.id):
            del self._deadlines[request.id]
        if reason != FinishReason.ERROR:
            # Held partial stop matches are text; a held incomplete character is dropped (Utf8Stream).
            try:
                for tail in self._reply_tail(state, state.stops.flush() if flush else "", reason):
                    self._emit(state.prepared, TextDelta(request_id=seq.request_id, choice=seq.choice,
                                                         text=tail.content, reasoning=tail.reasoning,
                                                         tool_calls=tail.tool_calls, token_ids=[],
                                                         n_tokens=seq.n_generated))
            except ToolCallError as exc:        # a call the reply cannot stand by: this request fails
                reason, error = FinishReason.ERROR, exc
            else:
                if reason == FinishReason.STOP and state.parser is not None and state.parser.tool_calls:
                    reason, stop_sequence = FinishReason.TOOL_CALLS, None
        state.chain.free()
        if self.drafter is not None:
            self.drafter.forget(seq)
        if self.scheduler.drafts is not None:
            self.scheduler.drafts.forget(seq)
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
        usage = Usage(prompt_tokens=seq.n_prompt, completion_tokens=n_new, cached_prompt_tokens=seq.n_reused,
                      reasoning_tokens=state.reasoning_tokens)
        self.counters.finished(reason)
        self._emit(state.prepared, Finished(request_id=seq.request_id, choice=seq.choice, finish_reason=reason,
                                            stop_sequence=stop_sequence if reason == FinishReason.STOP else None,
                                            usage=usage, timings=timings, error=_error_info(error)))

    def _fail_unstarted(self, prepared: PreparedRequest, choice: int, error: EngineError) -> None:
        """End a choice that holds no sequence state (never admitted, or its state is unusable)."""
        self.counters.finished(FinishReason.ERROR)
        self._emit(prepared, Finished(request_id=prepared.request.id, choice=choice, finish_reason=FinishReason.ERROR,
                                      usage=Usage(prompt_tokens=len(prepared.prompt_tokens)), timings=Timings(),
                                      error=_error_info(error)))

    def _end_all(self, error: EngineError) -> None:
        """The thread is ending: every request it holds, running, waiting or still in the command
        queue, ends with ``error``. After a crash the scheduler may be inconsistent (or the crash
        came half-way through admitting a request), so every choice still open in ``_open`` gets
        its final event even when its sequence cannot be finished normally."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, PreparedRequest):   # never admitted; the rest need nothing: every request ends here
                self._open[command] = set(range(command.request.n))
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            try:
                if seq.state == SeqState.WAITING:
                    self.scheduler.cancel(seq.request_id)
                self._finish(seq, FinishReason.ERROR, error=error, reusable=False)
            except Exception:
                log.exception("request %s: could not be ended cleanly; reporting %s anyway", seq.request_id, error.code)
        for prepared, choices in list(self._open.items()):
            for choice in sorted(choices):
                self._fail_unstarted(prepared, choice, error)
        try:
            self._snapshot = self.counters.snapshot(self.scheduler, self.model.info.model_name)
        except Exception:
            log.exception("could not publish the final engine stats")
        self._outbox.flush()


def _error_info(error: EngineError | None) -> ErrorInfo | None:
    if error is None:
        return None
    return ErrorInfo(code=error.code, message=error.message, retryable=error.retryable, field=error.field)
