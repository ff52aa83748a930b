"""The engine in a process of its own: :class:`EngineProcess`, a proxy with :class:`Engine`'s surface.

Why: the engine thread and the caller's event loop share one GIL in one process. With many streams
the job layer's per-token Python (stream writes, replies) and the engine thread's Python
(scheduling, sampling, detokenizing) take turns on it, and each waits for the other. vLLM V1 moved
its engine core into a process of its own for this reason; so does this module, opt-in
(``SLOTQ_ENGINE_PROCESS``).

The child (started with the ``spawn`` context, so it inherits no event loop, thread or lock of the
parent) owns llama.cpp, the scheduler, sampling, detokenization, stop strings and the reply parser:
it runs an :class:`Engine` as it runs in-process. What crosses the boundary, as msgpack frames
(4-byte big-endian length, then the body) on one socket pair:

* parent -> child: ``submit`` (the request as JSON), ``cancel``, ``limits``, ``warm``, ``close``;
* child -> parent: ``hello`` (sizes, once), ``ack`` / ``refused`` per submit, ``warmed``, and ONE
  ``step`` message per engine step: every event of the step for every request (the outbox already
  gathers them per event loop), with the step's stats, so :meth:`EngineProcess.stats` needs no
  round trip; ``failed`` when the engine thread died.

A text delta travels as a flat array (no pydantic on either side); a final event, once per
choice, as its model's dict. ``prompt_tokens`` (synchronous, rare: a cancelled or already
delivered job's usage) is answered on a second pipe by a thread of the child.

The child writes its step messages without waiting for the parent to read them (no ``drain``):
the engine must not hold a step back for a slow event loop, which would slow every sequence, and
what can pile up is bounded by what its running requests may still generate (at most the slots'
``max_tokens``), as the in-process outbox's is. A worker held still (SIGSTOP) past its leases
finds its jobs moved on when it resumes; the chaos run's ``engine-process`` variant does exactly that.

Failure is a clean signal. When the child dies (killed, out of memory, its engine thread crashed)
the parent's reader sees the socket close: the proxy becomes FAILED, ends every request it holds
with the retryable ``engine_dead`` (as a crashed engine thread ends them in-process) and wakes
:meth:`EngineProcess.wait_failed`, so the worker exits as it does when its engine thread dies. When
the parent dies, the child's reader sees the socket close and the child exits: no orphan keeps
the model's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import signal
import socket
import struct
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgpack

from slotq.engine.config import EngineConfig
from slotq.engine.engine import Engine, RequestHandle
from slotq.engine.errors import (
    DecodeFailed,
    EngineDead,
    EngineError,
    EngineStopped,
    GrammarError,
    InvalidRequest,
    KVExhausted,
    PromptTooLong,
    RequestFailed,
)
from slotq.engine.events import ErrorInfo, Event, Finished, FinishReason, TextDelta, Timings, TokenLogprob, Usage
from slotq.engine.outbox import StepReceiver
from slotq.engine.reply_parser import ToolCallDelta
from slotq.engine.request import GenerationRequest
from slotq.engine.scheduler import SchedulerLimits
from slotq.engine.state import EngineState, Lifecycle
from slotq.engine.stats import EngineStats, StatsSnapshot

log = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")
PROMPT_TOKENS_TIMEOUT_S = 30.0
"""How long a ``prompt_tokens`` call waits for the child before it reports the engine dead."""
CLOSE_TIMEOUT_S = 30.0
"""How long :meth:`EngineProcess.close` waits for the child to end its requests and exit."""

_ERRORS: dict[str, type[EngineError]] = {cls.code: cls for cls in (
    EngineError, InvalidRequest, PromptTooLong, GrammarError, KVExhausted, DecodeFailed, EngineStopped, EngineDead,
    RequestFailed)}


# ---------------------------------------------------------------------------- the wire
def _frame(message: list[Any]) -> bytes:
    body: bytes = msgpack.packb(message)
    return _LENGTH.pack(len(body)) + body


async def _read_frame(reader: asyncio.StreamReader) -> list[Any] | None:
    """The next message, or None once the other side has closed the socket."""
    try:
        head = await reader.readexactly(_LENGTH.size)
        body = await reader.readexactly(_LENGTH.unpack(head)[0])
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    message: list[Any] = msgpack.unpackb(body)
    return message


def encode_event(event: Event) -> list[Any] | dict[str, Any]:
    """A text delta as a flat array, without its request id (the step message groups by request);
    a final event as its model's dict."""
    if isinstance(event, Finished):
        return event.model_dump(mode="json")
    return [event.choice, event.text, event.reasoning, event.token_ids, event.n_tokens,
            [[c.index, c.id, c.name, c.arguments] for c in event.tool_calls] if event.tool_calls else None,
            [lp.model_dump(mode="json") for lp in event.logprobs] if event.logprobs is not None else None,
            event.prompt_tokens, event.cached_prompt_tokens]


def decode_event(request_id: str, data: list[Any] | dict[str, Any]) -> Event:
    if isinstance(data, dict):
        return Finished.model_validate(data)
    choice, text, reasoning, token_ids, n_tokens, calls, logprobs, prompt_tokens, cached_prompt_tokens = data
    return TextDelta(request_id=request_id, choice=choice, text=text, reasoning=reasoning, token_ids=token_ids,
                     n_tokens=n_tokens, tool_calls=[ToolCallDelta(*c) for c in calls] if calls else [],
                     logprobs=[TokenLogprob.model_validate(lp) for lp in logprobs] if logprobs is not None else None,
                     prompt_tokens=prompt_tokens, cached_prompt_tokens=cached_prompt_tokens)


def _error_fields(exc: EngineError) -> list[Any]:
    return [exc.code, exc.message, exc.field]


def _error_of(code: str, message: str, field: str | None) -> EngineError:
    return _ERRORS.get(code, EngineError)(message, field=field)


def _limits(values: list[int]) -> SchedulerLimits:
    return SchedulerLimits(active_slots=values[0], n_batch=values[1], prefill_chunk=values[2])


def _limit_values(limits: SchedulerLimits) -> list[int]:
    return [limits.active_slots, limits.n_batch, limits.prefill_chunk]


# ---------------------------------------------------------------------------- the child
def child_main(config: EngineConfig, sock: socket.socket, rpc: Connection, log_level: int) -> None:
    """The engine process: serve one :class:`Engine` until the parent closes it or goes away. It
    ignores SIGINT and SIGTERM, which a terminal or a service manager sends the whole process group:
    the worker drains on them and then closes its engine itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [engine process] %(name)s: %(message)s")
    asyncio.run(_serve(config, sock, rpc))


class _StepRelay:
    """Gathers a step's events of every request into one ``step`` message. The engine delivers a
    step to this loop in one callback (``outbox.deliver_step``); the first event of it schedules
    the send, which runs right after that callback, so one message carries the whole step."""

    def __init__(self, engine: Engine, writer: asyncio.StreamWriter) -> None:
        self._engine = engine
        self._writer = writer
        self._loop = asyncio.get_running_loop()
        self._groups: list[list[Any]] = []
        self._sent_stats: StatsSnapshot | None = None

    def receiver(self, request_id: str) -> StepReceiver:
        return _Forward(self, request_id)

    def add(self, request_id: str, events: list[Event]) -> None:
        if not self._groups:
            self._loop.call_soon(self.flush)
        self._groups.append([request_id, [encode_event(e) for e in events]])

    def flush(self) -> None:
        if not self._groups:
            return
        groups, self._groups = self._groups, []
        snapshot = self._engine.stats_snapshot()
        stats = None if snapshot is self._sent_stats else snapshot.values
        self._sent_stats = snapshot
        self._writer.write(_frame(["step", groups, stats]))

    def send(self, message: list[Any]) -> None:
        self.flush()                # whatever a step delivered goes first
        self._writer.write(_frame(message))


@dataclass(frozen=True, slots=True, eq=False)
class _Forward:
    relay: _StepRelay
    request_id: str

    def receive(self, events: list[Event]) -> None:
        self.relay.add(self.request_id, events)


async def _serve(config: EngineConfig, sock: socket.socket, rpc: Connection) -> None:
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        engine = await Engine.start(config)
    except BaseException as exc:
        writer.write(_frame(["start_failed", f"{type(exc).__name__}: {exc}"]))
        await writer.drain()
        raise
    gc.freeze()         # the model's and start-up's objects: never scanned by the collector again
    relay = _StepRelay(engine, writer)
    relay.send(["hello", engine.info.model_name, engine.ctx_per_seq, engine.reserve_slots,
                _limit_values(engine.full_limits), engine.stats_snapshot().values])
    threading.Thread(target=_answer_prompt_tokens, args=(engine, rpc), name="slotq-engine-rpc", daemon=True).start()
    commands = asyncio.create_task(_commands(reader, engine, relay))
    died = asyncio.create_task(engine.wait_failed())
    await asyncio.wait({commands, died}, return_when=asyncio.FIRST_COMPLETED)
    commands.cancel()
    await engine.close()        # after a crash too: joins the thread, whose last step ended every request
    relay.flush()
    if died.done():
        relay.send(["failed", f"{type(died.result()).__name__}: {died.result()}"])
    died.cancel()
    with contextlib.suppress(ConnectionError):
        await writer.drain()
    writer.close()


async def _commands(reader: asyncio.StreamReader, engine: Engine, relay: _StepRelay) -> None:
    """Serve the parent's commands until it sends ``close`` or goes away."""
    preparing: dict[str, bool] = {}      # submits being validated -> cancelled meanwhile?
    tasks: set[asyncio.Task[None]] = set()

    async def submit(request: GenerationRequest) -> None:
        try:
            await engine.submit_async(request, relay.receiver(request.id))
        except EngineError as exc:
            relay.send(["refused", request.id, *_error_fields(exc)])
            return
        except Exception as exc:
            log.exception("request %s: submit failed", request.id)
            relay.send(["refused", request.id, *_error_fields(RequestFailed.from_exception(exc, "submitting"))])
            return
        finally:
            cancelled = preparing.pop(request.id)
        relay.send(["ack", request.id])
        if cancelled:
            engine.cancel(request.id)

    async def warm() -> None:
        try:
            relay.send(["warmed", await engine.warm_up(), None])
        except EngineError as exc:
            relay.send(["warmed", 0.0, str(exc)])

    def spawn(coro: Any) -> None:
        task = asyncio.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    while (message := await _read_frame(reader)) is not None:
        kind = message[0]
        if kind == "submit":
            request = GenerationRequest.model_validate_json(message[1])
            preparing[request.id] = False       # before the next command: a cancel right behind it finds it
            spawn(submit(request))
        elif kind == "cancel":
            if message[1] in preparing:
                preparing[message[1]] = True
            engine.cancel(message[1])
        elif kind == "limits":
            active_slots, n_batch, prefill_chunk = message[1]
            engine.set_limits(active_slots=active_slots, n_batch=n_batch, prefill_chunk=prefill_chunk)
        elif kind == "warm":
            spawn(warm())
        elif kind == "close":
            return


def _answer_prompt_tokens(engine: Engine, rpc: Connection) -> None:
    """The child's thread for ``prompt_tokens``: a request's JSON in, its tokens (or an error) out."""
    while True:
        try:
            body = rpc.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            answer: list[Any] = [engine.prompt_tokens(GenerationRequest.model_validate_json(body)), None]
        except Exception as exc:
            answer = [None, f"{type(exc).__name__}: {exc}"]
        rpc.send_bytes(msgpack.packb(answer))


# ---------------------------------------------------------------------------- the parent
@dataclass(frozen=True, slots=True)
class ServedModelName:
    model_name: str


@dataclass(eq=False)
class _Open:
    """A request the child holds: where its events go, and its choices without a final event."""

    handle: RequestHandle
    choices: set[int]


class EngineProcess:
    """:class:`Engine`'s surface (the worker's ``JobEngine``), served by an engine in a child process.

    Every method runs on the event loop that started it, except :meth:`prompt_tokens` and
    :meth:`stats`, which any thread may call."""

    def __init__(self, config: EngineConfig, process: multiprocessing.process.BaseProcess,
                 reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rpc: Connection,
                 hello: list[Any]) -> None:
        self.config = config
        self._process = process
        self._reader = reader
        self._writer = writer
        self._rpc = rpc
        self._rpc_lock = threading.Lock()
        _, model_name, ctx_per_seq, reserve_slots, full, stats = hello
        self.info = ServedModelName(model_name)
        self.ctx_per_seq: int = ctx_per_seq
        self.reserve_slots: int = reserve_slots
        self._full = _limits(full)
        self._limits = self._full
        self._stats = StatsSnapshot(stats)
        self._lifecycle = Lifecycle()
        self._open: dict[str, _Open] = {}
        self._acks: dict[str, asyncio.Future[None]] = {}
        self._warm: asyncio.Future[float] | None = None
        self._failed_message: str | None = None      # the child's word on how its engine thread died
        self._read_task = asyncio.create_task(self._read(), name="slotq-engine-process-reader")
        self._closed = False

    @classmethod
    async def start(cls, config: EngineConfig) -> EngineProcess:
        """Start the child and wait until its engine runs (the model is loaded there)."""
        context = multiprocessing.get_context("spawn")
        ours, theirs = socket.socketpair()
        rpc, rpc_theirs = context.Pipe()
        process = context.Process(target=child_main, name="slotq-engine",
                                  args=(config, theirs, rpc_theirs, logging.getLogger().getEffectiveLevel()),
                                  daemon=True)
        try:
            await asyncio.to_thread(process.start)
        finally:
            theirs.close()
            rpc_theirs.close()
        reader, writer = await asyncio.open_connection(sock=ours)
        hello = await _read_frame(reader)
        if hello is None or hello[0] != "hello":
            writer.close()
            await asyncio.to_thread(process.join, CLOSE_TIMEOUT_S)
            reason = hello[1] if hello is not None else f"it exited with code {process.exitcode}"
            raise RuntimeError(f"the engine process could not start: {reason}")
        return cls(config, process, reader, writer, rpc, hello)

    @property
    def pid(self) -> int | None:
        """The engine process's id."""
        return self._process.pid

    # ------------------------------------------------------------------ requests
    async def submit_async(self, request: GenerationRequest, receiver: StepReceiver | None = None) -> RequestHandle:
        """:meth:`Engine.submit_async`: validated in the child; raises its ``EngineError`` here."""
        self._lifecycle.raise_unless_running()
        handle = RequestHandle(self, request, receiver)
        ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._open[request.id] = _Open(handle, set(range(request.n)))
        self._acks[request.id] = ack
        self._send(["submit", request.model_dump_json().encode()])
        try:
            await ack
        except BaseException:
            self._open.pop(request.id, None)
            raise
        finally:
            self._acks.pop(request.id, None)
        return handle

    def cancel(self, request_id: str) -> None:
        """Cancel a queued or running request; it ends with finish_reason 'cancelled'."""
        if self._lifecycle.state is EngineState.RUNNING:
            self._send(["cancel", request_id])

    def prompt_tokens(self, request: GenerationRequest) -> list[int]:
        """The request's prompt tokens, tokenized by the child (a round trip: the worker asks only
        for a cancelled or already delivered job's usage)."""
        self._lifecycle.raise_unless_running()
        with self._rpc_lock:
            try:
                self._rpc.send_bytes(request.model_dump_json().encode())
                if not self._rpc.poll(PROMPT_TOKENS_TIMEOUT_S):
                    raise EngineDead(f"the engine process did not answer within {PROMPT_TOKENS_TIMEOUT_S:.0f} s")
                tokens, error = msgpack.unpackb(self._rpc.recv_bytes())
            except (EOFError, OSError) as exc:
                raise EngineDead(f"the engine process is gone ({type(exc).__name__})") from exc
        if error is not None:
            raise RequestFailed(f"the engine process could not tokenize the prompt ({error})")
        result: list[int] = tokens
        return result

    # ------------------------------------------------------------------ limits, warm-up, stats
    @property
    def full_limits(self) -> SchedulerLimits:
        return self._full

    def set_limits(self, *, active_slots: int | None = None, n_batch: int | None = None,
                   prefill_chunk: int | None = None) -> SchedulerLimits:
        """:meth:`Engine.set_limits`: clamped here as the child clamps them, then sent."""
        current = self._limits
        self._limits = SchedulerLimits(
            active_slots=current.active_slots if active_slots is None else active_slots,
            n_batch=current.n_batch if n_batch is None else n_batch,
            prefill_chunk=current.prefill_chunk if prefill_chunk is None else prefill_chunk,
        ).within(self._full)
        if self._lifecycle.state is EngineState.RUNNING:
            self._send(["limits", _limit_values(self._limits)])
        return self._limits

    async def warm_up(self) -> float:
        """:meth:`Engine.warm_up`, run by the child's engine."""
        self._lifecycle.raise_unless_running()
        self._warm = asyncio.get_running_loop().create_future()
        self._send(["warm"])
        try:
            return await self._warm
        finally:
            self._warm = None

    def stats(self) -> EngineStats:
        """The stats the child sent with its latest step (they include every event delivered)."""
        stats = self._stats.stats()
        return stats.model_copy(update={"finished": dict(stats.finished)})

    # ------------------------------------------------------------------ health
    @property
    def state(self) -> EngineState:
        return self._lifecycle.state

    @property
    def failure(self) -> BaseException | None:
        return self._lifecycle.failure

    async def wait_failed(self) -> BaseException:
        """:meth:`Engine.wait_failed`: returns once the engine process has died (or its engine
        thread); every request it held has then ended with ``engine_dead``."""
        return await self._lifecycle.wait_failed()

    async def close(self) -> None:
        """Stop the child (requests still running end with the retryable ``engine_stopped``) and
        wait for it to exit. Safe after a failure; idempotent."""
        if self._closed:
            return
        self._closed = True
        was_running = self._lifecycle.state is EngineState.RUNNING
        self._lifecycle.close()
        if was_running:
            self._send(["close"])
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await asyncio.shield(self._read_task)
        except TimeoutError:
            log.error("the engine process did not stop within %.0f s; killing it", CLOSE_TIMEOUT_S)
            self._process.kill()
        await asyncio.to_thread(self._process.join, CLOSE_TIMEOUT_S)
        self._rpc.close()

    # ------------------------------------------------------------------ the reader
    def _send(self, message: list[Any]) -> None:
        if not self._writer.is_closing():
            self._writer.write(_frame(message))

    async def _read(self) -> None:
        """Hand each step's events to their receivers, until the child goes away."""
        failed: str | None = None
        try:
            await self._read_messages()
        except Exception as exc:        # a message this side cannot take: the engine is unusable
            log.exception("reading the engine process's messages failed")
            failed = f"{type(exc).__name__}: {exc}"
        finally:
            self._writer.close()        # the child sees its socket close and exits
            await asyncio.to_thread(self._process.join, CLOSE_TIMEOUT_S)
            self._ended(failed or self._failed_message)

    async def _read_messages(self) -> None:
        while (message := await _read_frame(self._reader)) is not None:
            kind = message[0]
            if kind == "step":
                self._deliver(message[1], message[2])
            elif kind == "ack":
                self._resolve(message[1], None)
            elif kind == "refused":
                self._resolve(message[1], _error_of(*message[2:]))
            elif kind == "warmed":
                if self._warm is not None and not self._warm.done():
                    if message[2] is None:
                        self._warm.set_result(message[1])
                    else:
                        self._warm.set_exception(EngineError(message[2]))
            elif kind == "failed":
                self._failed_message = message[1]

    def _deliver(self, groups: list[list[Any]], stats: dict[str, Any] | None) -> None:
        if stats is not None:
            self._stats = StatsSnapshot(stats)      # first: a receiver that reads stats sees its step's
        for request_id, encoded in groups:
            entry = self._open.get(request_id)
            if entry is None:
                continue
            events = [decode_event(request_id, data) for data in encoded]
            for event in events:
                if isinstance(event, Finished):
                    entry.choices.discard(event.choice)
            if not entry.choices:
                del self._open[request_id]
            entry.handle.sink.receiver.receive(events)

    def _resolve(self, request_id: str, error: EngineError | None) -> None:
        ack = self._acks.get(request_id)
        if ack is None or ack.done():
            return
        if error is None:
            ack.set_result(None)
        else:
            ack.set_exception(error)

    def _ended(self, failed: str | None) -> None:
        """The child is gone. Unless it was closed cleanly, that is a failure: every request still
        open ends as a crashed engine ends it, and :meth:`wait_failed` returns."""
        if self._lifecycle.state is EngineState.RUNNING or failed is not None:
            cause = failed or f"the engine process exited with code {self._process.exitcode}"
            error: EngineError = EngineDead(f"the engine process died ({cause}); this engine runs no more requests")
            self._lifecycle.fail(error)
            log.critical("the engine process died (%s); every request on it ends with engine_dead", cause)
        else:
            error = EngineStopped("the engine stopped before this request finished")
        for ack in self._acks.values():
            if not ack.done():
                ack.set_exception(error)
        if self._warm is not None and not self._warm.done():
            self._warm.set_exception(error)
        info = ErrorInfo(code=error.code, message=error.message, retryable=error.retryable)
        open_requests, self._open = self._open, {}
        for request_id, entry in open_requests.items():
            entry.handle.sink.receiver.receive([
                Finished(request_id=request_id, choice=choice, finish_reason=FinishReason.ERROR, usage=Usage(),
                         timings=Timings(), error=info) for choice in sorted(entry.choices)])

