"""The engine's public, asyncio-friendly API.

    engine = await Engine.start(EngineConfig(model_path=...))
    async for event in engine.generate(GenerationRequest(prompt="Hello", max_tokens=32)):
        ...
    await engine.close()

``submit`` validates on the caller's thread (tokenization and grammar parsing only touch the
vocabulary), so a bad request raises :class:`~slotq.engine.errors.InvalidRequest` before it is queued.
Events cross from the engine thread into the caller's event loop once per decode step, as one
batch for all the loop's requests (see ``slotq.engine.outbox``).

An engine is RUNNING, FAILED (its thread crashed) or CLOSED (see ``slotq.engine.state``). The owner of
an engine -- the worker -- watches for a crash with :meth:`Engine.wait_failed` rather than polling.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from slotq.engine.chat import ESCAPE_OPEN, ChatTemplate, ControlTokens
from slotq.engine.config import EngineConfig, KVLayout, SpecMode
from slotq.engine.constraints import ConstraintCompiler, TokenMatcher, constraint_for
from slotq.engine.errors import EngineError, InvalidRequest, PromptTooLong
from slotq.engine.events import Event, Finished
from slotq.engine.fault_injection import EngineFaults
from slotq.engine.llama_model import LlamaModel
from slotq.engine.lora import resolve_adapters
from slotq.engine.outbox import Sink, StepReceiver
from slotq.engine.reply_parser import ToolCallFormat, detect_tool_format
from slotq.engine.request import GenerationRequest, SamplingParams
from slotq.engine.runner import PreparedRequest, Runner
from slotq.engine.sampling import SamplerChain, build_chain
from slotq.engine.scheduler import Scheduler, SchedulerConfig, SchedulerLimits
from slotq.engine.speculation import Drafter, DraftPlanner, NgramDrafter, StepCost
from slotq.engine.state import EngineState, Lifecycle
from slotq.engine.stats import EngineStats, StatsSnapshot
from slotq.engine.tools import LazyCall, plan_tools, reply_setup, template_messages

CALIBRATION_TOKENS = 64
"""The largest step the start-up timing measures (speculation's step cost extrapolates beyond it,
and every real step corrects it): 1, 2, 4, ... 64 tokens take about 0.4 s on the bundled model on
two CPU cores."""


class CancelsRequests(Protocol):
    def cancel(self, request_id: str) -> None: ...


class RequestHandle:
    """Events of one submitted request, as an async iterator. Leaving the iteration early
    (``break``, an exception, task cancellation) cancels the request so its slot is freed.
    Whoever produces the events calls ``sink.receiver.receive`` on the request's event loop with
    each step's events (the engine thread through its outbox; ``bench/sim_engine.py`` directly).

    ``receiver``: where the events go instead, for a consumer that takes each step's output as it
    is delivered rather than one awaited event at a time (the worker's jobs); such a handle is not
    iterated, only cancelled."""

    def __init__(self, engine: CancelsRequests, request: GenerationRequest,
                 receiver: StepReceiver | None = None) -> None:
        self.id = request.id
        self.request = request
        self._engine = engine
        self._steps: asyncio.Queue[list[Event]] = asyncio.Queue()
        self.sink = Sink(asyncio.get_running_loop(), receiver or self)
        self._open_choices = request.n
        self.finished: list[Finished] = []

    def receive(self, events: list[Event]) -> None:
        """One step's events (:class:`~slotq.engine.outbox.StepReceiver`): one wake-up of the
        iterating task per step, however many events the step had."""
        self._steps.put_nowait(events)

    def cancel(self) -> None:
        self._engine.cancel(self.id)

    async def __aiter__(self) -> AsyncIterator[Event]:
        try:
            while self._open_choices:
                for event in await self._steps.get():
                    if isinstance(event, Finished):
                        self._open_choices -= 1
                        self.finished.append(event)
                    yield event
        finally:
            if self._open_choices:
                self.cancel()


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model = LlamaModel(config)
        self.info = self.model.info
        self.ctx_per_seq = min(config.ctx, self.info.n_ctx_seq)   # a split layout caps it at one stream
        self.template = ChatTemplate(self.model.chat_template(), self.model.token_text(self.model.bos_token),
                                     self.model.token_text(self.model.eos_token),
                                     ControlTokens(self.model.control_tokens()))
        self.tool_format = detect_tool_format(self.model.chat_template())    # how this model's calls are written
        self._eog_tokens = [t for t in range(self.info.n_vocab) if self.model.is_eog(t)]
        self._constraints = ConstraintCompiler(self.model.vocab, self.info.n_vocab, self._eog_tokens, config)
        self.lora_adapters = config.lora_adapters
        try:
            self.model.load_adapters(self.lora_adapters)
            self.drafter, make_planner = self._speculation(config)
        except BaseException:
            self.model.close()
            raise
        cache_slots = config.usable_cache_slots
        # the reserve lends the cache slots to a higher lane (scheduler rule 6) while one batch can hold them
        self.reserve_slots = cache_slots if self.info.n_batch >= config.slots + cache_slots else 0
        self.scheduler = Scheduler(SchedulerConfig(
            n_slots=config.slots,
            cache_slots=cache_slots,
            reserve_slots=self.reserve_slots,
            n_batch=self.info.n_batch,
            kv_cells=self.info.n_ctx,
            prefill_chunk=min(config.prefill_chunk, self.info.n_batch),
            mode=config.batching,
            prefix_cache=config.prefix_cache,
            kv_overcommit=config.kv_overcommit,
            kv_stream_cells=self.info.n_ctx_seq if self.info.kv_layout == KVLayout.SPLIT else None,
            lora_turn_max_steps=config.lora_turn_max_steps,
        ))
        self._limits = SchedulerLimits.full(self.scheduler.config)
        self._lifecycle = Lifecycle()
        self._runner = Runner(self.model, self.scheduler, self.ctx_per_seq,
                              lifecycle=self._lifecycle, faults=EngineFaults.from_env(), drafter=self.drafter,
                              make_planner=make_planner)
        self._runner.counters.spec = config.spec_source.value
        self._runner.thread.start()
        self._runner.started.wait()
        if self._lifecycle.failure is not None:
            self._runner.thread.join()
            if self.drafter is not None:
                self.drafter.close()
            self.model.close()
            raise RuntimeError(f"the engine could not start: {self._lifecycle.failure}") from self._lifecycle.failure
        self._closed = False

    def _speculation(self, config: EngineConfig) -> tuple[Drafter | None, Callable[[], DraftPlanner] | None]:
        """The drafter of ``config.spec`` (none when off; a draft model is loaded and its vocabulary
        checked here, so a wrong file fails the start), and how the engine thread makes the
        planner: its step cost is timed there, on this model and device, as the thread's first work
        (every llama.cpp call runs on that one thread: see ``Drafter.prepare``)."""
        source = config.spec_source
        if source == SpecMode.OFF:
            return None, None
        drafter: Drafter
        if source == SpecMode.DRAFT:
            from slotq.engine.draft_model import DraftModelDrafter  # loads a second model: only when asked

            drafter = DraftModelDrafter(config, self.model)
        else:
            drafter = NgramDrafter()

        def planner() -> DraftPlanner:
            drafter.prepare()
            cost = StepCost.calibrate(self._time_decode, max_tokens=min(self.info.n_batch, CALIBRATION_TOKENS),
                                      split_streams=self.info.kv_layout == KVLayout.SPLIT, ubatch=self.info.n_ubatch)
            return DraftPlanner(cost, k_min=config.spec_k_min, k_max=config.spec_k_max, prior=drafter.prior,
                                draft_seconds=drafter.draft_seconds)
        return drafter, planner

    def _time_decode(self, n_tokens: int) -> float:
        """Seconds one llama_decode of ``n_tokens`` takes, each with logits (as a draft's are), in
        the last KV sequence (empty at start)."""
        seq_id = self.info.n_seq_max - 1
        started = time.perf_counter()
        ret = self.model.decode([self.model.bos_token] * n_tokens, range(n_tokens), [seq_id] * n_tokens,
                                [True] * n_tokens)
        seconds = time.perf_counter() - started
        self.model.kv_remove(seq_id)
        if ret != 0:
            raise RuntimeError(f"timing a decode of {n_tokens} tokens failed (llama_decode returned {ret})")
        return seconds

    @classmethod
    async def start(cls, config: EngineConfig) -> Engine:
        """Load the model off the event loop (it can take seconds) and start the engine thread."""
        return await asyncio.to_thread(cls, config)

    # ------------------------------------------------------------------ requests
    def prompt_tokens(self, request: GenerationRequest) -> list[int]:
        return self._tokens_of(self._prompt_text(request))

    def _prompt_text(self, request: GenerationRequest) -> str:
        if request.messages is None:
            return request.prompt or ""
        native_tools = request.calls_tools and self.tool_format != ToolCallFormat.GENERIC
        return self.template.render(template_messages(request, self.tool_format),
                                    tools=[t.model_dump(exclude_none=True) for t in request.tools or ()]
                                    if native_tools else None)

    def _tokens_of(self, text: str) -> list[int]:
        """The prompt's tokens; a rendered chat with escaped text (a message spelling a control
        token) is split so that only the template's own control tokens are read as such."""
        if ESCAPE_OPEN in text and self.template.control_tokens is not None:
            tokens = self.model.tokenize_pieces(self.template.control_tokens.split(text))
        else:
            tokens = self.model.tokenize(text)
        bos = self.model.bos_token
        if len(tokens) >= 2 and tokens[0] == tokens[1] == bos:
            tokens = tokens[1:]      # the template wrote BOS itself
        return tokens

    def prepare(self, request: GenerationRequest, handle: RequestHandle) -> PreparedRequest:
        """Every check that needs the model; raises InvalidRequest naming the field and the limit
        (or EngineDead / EngineStopped when the engine cannot run requests any more)."""
        self._lifecycle.raise_unless_running()
        if request.n > self.config.slots:
            raise InvalidRequest(f"n is {request.n}; it must be <= the number of slots ({self.config.slots})",
                                 field="n")
        prompt = self._prompt_text(request)
        tokens = self._tokens_of(prompt)
        if not tokens:
            raise InvalidRequest("prompt is empty after tokenization", field="prompt")
        limit = self.ctx_per_seq
        if len(tokens) + request.max_tokens > limit:
            raise PromptTooLong(
                f"prompt is {len(tokens)} tokens and max_tokens is {request.max_tokens}; "
                f"prompt + max_tokens must be <= {limit} ({self._context_limit_reason()})",
                field="max_tokens" if len(tokens) < limit else "prompt",
            )
        bad = [t for t in request.resume_tokens if not 0 <= t < self.info.n_vocab]
        if bad:
            raise InvalidRequest(f"resume_tokens: token id {bad[0]} is outside the vocabulary "
                                 f"(0..{self.info.n_vocab - 1})", field="resume_tokens")
        adapters = resolve_adapters([(ref.id, ref.scale) for ref in request.lora], self.lora_adapters)
        plan = plan_tools(request, self.tool_format)
        constraint = plan.constraint if plan is not None else constraint_for(request.sampling)
        lazy = plan is not None and plan.lazy
        matcher: TokenMatcher | None = None
        if constraint is not None:
            if request.ignore_eos:
                # A satisfied constraint allows only end-of-generation tokens: with them banned there is
                # nothing the request could end with.
                raise InvalidRequest(f"ignore_eos cannot be combined with {constraint.field}", field="ignore_eos")
            # A lazy grammar is armed at the call's marker, past the tokens from there on (a resumed
            # reply's too, as the runner replays them), so it starts here at its start.
            matcher = self._constraints.matcher(constraint, [] if lazy else request.resume_tokens)
        lazy_call = LazyCall(matcher, self._constraints.tokenize) if lazy and matcher is not None else None
        chain_matcher = None if lazy else matcher
        seed = request.sampling.seed

        def make_chain(choice: int) -> SamplerChain:
            return build_chain(request, self.model.vocab, self.info.n_vocab, self._eog_tokens,
                               chain_matcher.fork() if chain_matcher is not None else None,
                               seed=(seed + choice) % 0xFFFFFFFF if seed is not None else self.config.seed)

        # Build one chain now so logit-bias errors surface at submit time, then free it.
        make_chain(0).free()
        return PreparedRequest(request, tokens, handle.sink, make_chain,
                               reply=reply_setup(request, request.id, prompt, plan, lazy_call), adapters=adapters)

    def _context_limit_reason(self) -> str:
        if self.ctx_per_seq < self.config.ctx:
            return (f"per-sequence context: each of the {self.config.slots} slots owns a KV stream of "
                    f"{self.info.n_ctx_seq} cells; raise SLOTQ_KV_CELLS or set SLOTQ_KV_LAYOUT=unified")
        return "per-sequence context"

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Validate and queue a request; iterate the returned handle for its events.

        Raises :class:`~slotq.engine.errors.InvalidRequest` (not retryable) for a bad request,
        :class:`~slotq.engine.errors.EngineDead` (retryable) at once if the engine thread has crashed,
        :class:`~slotq.engine.errors.EngineStopped` (retryable) after :meth:`close`. A request accepted
        here always ends with a ``Finished`` event per choice, even if the engine dies meanwhile
        (then with the retryable error ``engine_dead``)."""
        handle = RequestHandle(self, request)
        self._runner.submit(self.prepare(request, handle))
        return handle

    async def submit_async(self, request: GenerationRequest, receiver: StepReceiver | None = None) -> RequestHandle:
        """:meth:`submit` with validation (tokenizing a long prompt, parsing a grammar) on a worker
        thread, so a server's event loop keeps serving meanwhile. ``receiver``: takes each step's
        events of this request instead of the returned handle (see :class:`RequestHandle`)."""
        handle = RequestHandle(self, request, receiver)
        self._runner.submit(await asyncio.to_thread(self.prepare, request, handle))
        return handle

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Event]:
        async for event in self.submit(request):
            yield event

    def cancel(self, request_id: str) -> None:
        """Cancel a queued or running request; it ends with finish_reason 'cancelled'."""
        self._runner.cancel(request_id)

    # ------------------------------------------------------------------ runtime limits
    def set_limits(self, *, active_slots: int | None = None, n_batch: int | None = None,
                   prefill_chunk: int | None = None) -> SchedulerLimits:
        """Change, while running, how many sequences may hold a slot (1..slots), the token budget of
        one decode (1..batch) and the prefill chunk (1..prefill_chunk); None keeps a value. Values
        are clamped to the configured sizes, which stay the ceiling; the result says what applies
        from the next step on. Lowering ``active_slots`` never stops a running sequence: no new one
        is admitted until enough have finished."""
        current = self._limits
        self._limits = SchedulerLimits(
            active_slots=current.active_slots if active_slots is None else active_slots,
            n_batch=current.n_batch if n_batch is None else n_batch,
            prefill_chunk=current.prefill_chunk if prefill_chunk is None else prefill_chunk,
        ).clamped(self.scheduler.config)
        self._runner.set_limits(self._limits)
        return self._limits

    @property
    def full_limits(self) -> SchedulerLimits:
        """The configured sizes: the ceiling of :meth:`set_limits`."""
        return SchedulerLimits.full(self.scheduler.config)

    async def warm_up(self) -> float:
        """Run one real request (a one-token greedy generation) through the whole path -- admission,
        ``llama_decode``, sampling -- so the first job does not pay for first-touch costs (page faults
        on the mmapped weights, compute buffers, GPU kernels). Returns the seconds it took; raises
        the engine's error if it failed."""
        started = time.perf_counter()
        request = GenerationRequest(prompt="Hello", max_tokens=1, ignore_eos=True,
                                    sampling=SamplingParams(temperature=0.0))
        handle = await self.submit_async(request)
        async for event in handle:
            if isinstance(event, Finished) and event.error is not None:
                raise EngineError(f"warm-up failed: {event.error.code}: {event.error.message}")
        return time.perf_counter() - started

    # ------------------------------------------------------------------ health
    @property
    def state(self) -> EngineState:
        return self._lifecycle.state

    @property
    def failure(self) -> BaseException | None:
        """The exception that killed the engine thread, or None. Stays set after :meth:`close`."""
        return self._lifecycle.failure

    async def wait_failed(self) -> BaseException:
        """Wait until the engine thread dies, and return the exception that killed it.

        The contract the worker relies on:

        * It returns at once if the engine has already failed; otherwise it is woken from the
          engine thread (``call_soon_threadsafe`` on the awaiting task's own event loop) as the
          thread dies, without polling. Any number of tasks may wait.
        * By then the engine is FAILED: ``submit``/``submit_async`` raise ``EngineDead`` at once.
        * Every request the engine held ends with a ``Finished`` event whose error has code
          ``engine_dead`` and ``retryable=True``. Those events and this wake-up race (a task
          already running may read its event first), so a job that sees ``engine_dead`` should
          be handed back like one cancelled by the owner, not counted as a failed try.
        * A clean :meth:`close` is not a failure: this then never returns (cancel the waiting task
          when you close the engine).

        The worker uses it to stop claiming jobs, hand its running jobs back and exit non-zero
        so its supervisor restarts it.
        """
        return await self._lifecycle.wait_failed()

    # ------------------------------------------------------------------ introspection
    def stats(self) -> EngineStats:
        """The engine's counters at the end of its latest step: an immutable snapshot published by
        the engine thread (never read from live structures), with a ``finished`` dict of your own.
        It includes every event already delivered to you."""
        snapshot = self._runner.stats
        return snapshot.model_copy(update={"finished": dict(snapshot.finished)})

    def stats_snapshot(self) -> StatsSnapshot:
        """The latest step's raw snapshot, published by the engine thread with the step's events
        (an engine process sends its values to its owner with each step: ``slotq.engine.process``)."""
        return self._runner.snapshot

    async def close(self) -> None:
        """Stop the engine thread (requests still running end with the retryable
        ``engine_stopped``) and free the model. Safe after a failure; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._runner.stop()
        await asyncio.to_thread(self._runner.thread.join)
        if self.drafter is not None:
            self.drafter.close()
        self.model.close()
