"""The engine surface the job layer uses, as a Protocol.

:class:`~engine.Engine` satisfies it; so does the fleet benchmark's simulated engine
(``bench/sim_engine.py``), which stands in for llama.cpp where thousands of slots must fit on a
small machine. Naming the surface here keeps the worker honest about what it needs, and lets a
worker be built on either (``SlotqWorker(..., engine_factory=...)``) without ``engine/`` knowing
about ``jobs/``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from slotq.engine import EngineConfig, EngineStats, Event, GenerationRequest
from slotq.engine.outbox import StepReceiver
from slotq.engine.request import EmbeddingRequest, RerankRequest
from slotq.engine.scheduler import SchedulerLimits

if TYPE_CHECKING:
    from slotq.engine.embedding import Embeddings
    from slotq.engine.rerank import Ranking


class RunningRequest(Protocol):
    """One submitted request: its events (``TextDelta``, then one ``Finished`` per choice) go to the
    receiver it was submitted with, each step's at once, or, without one, to whoever iterates it
    (leaving the iteration early cancels it)."""

    def cancel(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[Event]: ...


class ModelName(Protocol):
    @property
    def model_name(self) -> str: ...


class JobEngine(Protocol):
    @property
    def config(self) -> EngineConfig: ...

    @property
    def info(self) -> ModelName: ...

    @property
    def ctx_per_seq(self) -> int: ...

    @property
    def reserve_slots(self) -> int:
        """Sequences beyond the active slots that a job of a higher lane than a running one may run
        in at once (the engine's spare KV streams, ``engine.scheduler`` rule 6); 0 = none."""
        ...

    @property
    def failure(self) -> BaseException | None:
        """The exception that killed the engine, or None while it can run requests."""
        ...

    async def submit_async(self, request: GenerationRequest, receiver: StepReceiver | None = None) -> RunningRequest:
        """Queue a request; raises ``EngineError`` (``InvalidRequest``, ``EngineDead``, ...). Its
        events go to ``receiver`` (on this event loop, once per engine step), or to the handle."""
        ...

    def cancel(self, request_id: str) -> None: ...

    def prompt_tokens(self, request: GenerationRequest) -> list[int]: ...

    def stats(self) -> EngineStats: ...

    async def warm_up(self) -> float:
        """Run one request through the whole path before serving; returns the seconds it took."""
        ...

    @property
    def full_limits(self) -> SchedulerLimits:
        """The configured sizes: the ceiling of :meth:`set_limits`."""
        ...

    def set_limits(self, *, active_slots: int | None = None, n_batch: int | None = None,
                   prefill_chunk: int | None = None) -> SchedulerLimits:
        """What the elastic worker adjusts while running (see ``engine.Engine.set_limits``)."""
        ...

    async def wait_failed(self) -> BaseException:
        """Return once the engine has died (never, if it closes cleanly)."""
        ...

    async def close(self) -> None: ...


EngineFactory = Callable[[EngineConfig], Awaitable[JobEngine]]
"""Builds a worker's engine from its settings (``Engine.start`` by default)."""


class JobEmbedder(Protocol):
    """What an embedding worker's engine adds to :class:`JobEngine` (``engine.embedding.EmbeddingEngine``,
    whose generation entry points refuse generation jobs by name)."""

    async def embed(self, request: EmbeddingRequest) -> Embeddings:
        """The request's vectors; raises ``EngineError`` (``InvalidRequest``, ``EngineDead``, ...)."""
        ...


class JobRanker(Protocol):
    """What a rerank worker's engine adds to :class:`JobEngine` (``engine.rerank.RerankEngine``, whose
    generation entry points refuse generation jobs by name)."""

    async def rerank(self, request: RerankRequest) -> Ranking:
        """The request's scores, in document order; raises ``EngineError`` (``InvalidRequest``, ``EngineDead``, ...)."""
        ...
