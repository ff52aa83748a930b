"""Which queue serves a model: read from the live workers' heartbeats and the fleet's catalog.

Each worker has one model loaded (its ``SLOTQ_MODEL_NAME``, or one of its ``SLOTQ_MODELS``) on that
model's queue. A model that live workers can load but none has loaded (the catalog,
:mod:`slotq.jobs.protocol.catalog`) is routed to its queue all the same: the job waits there,
durably, until a worker switches to it (``/v1/models`` says ``unloaded``). The map is rebuilt at
most every ``gateway_routing_ttl_s``, so a request costs no Redis round trip for routing. Models
seen recently are remembered in Redis (shared by every gateway replica), so a model no live worker
serves or can load any more is a 503 (come back later), while a name never served is a 404.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from slotq.jobs.gateway.records import ModelsSeen
from slotq.jobs.openai.errors import ApiError
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol import catalog
from slotq.jobs.protocol.catalog import CatalogModel
from slotq.jobs.protocol.schemas import JobKind, WorkerInfo

_REMEMBER_EVERY_S = 60


@dataclass
class ModelRoute:
    """Where ``model``'s jobs go: ``queue``, with the live ``workers`` that have it loaded there
    (none: only the ``offer`` of the catalog, workers that can load it)."""

    model: str
    queue: str
    workers: list[WorkerInfo] = field(default_factory=list)
    offer: CatalogModel | None = None

    @property
    def slots_total(self) -> int:
        return sum(w.slots_total for w in self.workers)

    @property
    def slots_busy(self) -> int:
        return sum(w.slots_busy for w in self.workers)

    @property
    def kind(self) -> JobKind:
        """What the model serves (its workers say, else the catalog; a queue's workers serve one kind)."""
        if self.workers:
            return self.workers[0].kind
        return self.offer.kind if self.offer is not None else JobKind.GENERATION

    @property
    def status(self) -> Literal["loaded", "loading", "unloaded"]:
        """``loaded``: a worker claims its jobs; ``loading``: a worker is loading it (or draining);
        ``unloaded``: none has it loaded, its jobs wait until one switches to it."""
        if any(w.ready for w in self.workers):
            return "loaded"
        return "loading" if self.workers else "unloaded"

    @property
    def load_s(self) -> float | None:
        """What loading the model cost a worker, last it was measured (None: never loaded yet)."""
        measured = [w.load_s for w in self.workers if w.load_s is not None]
        return min(measured) if measured else self.offer.load_s if self.offer is not None else None


def routes_from(workers: list[WorkerInfo], kind: JobKind | None = None,
                offers: Mapping[str, CatalogModel] | None = None) -> dict[str, ModelRoute]:
    """model -> the queue to use (among the workers that serve ``kind`` of job, if given). Several
    queues serving one model name: the one with the most free slots right now (ties by name, so
    every replica agrees). A model of the catalog's ``offers`` that no such worker has loaded: its
    catalog queue."""
    by_model: dict[str, dict[str, list[WorkerInfo]]] = defaultdict(lambda: defaultdict(list))
    for w in workers:
        if kind is None or w.kind == kind:
            by_model[w.model][w.queue].append(w)
    offers = offers or {}
    routes = {}
    for model, queues in by_model.items():
        candidates = [ModelRoute(model, queue, ws, offers.get(model)) for queue, ws in sorted(queues.items())]
        routes[model] = max(candidates, key=lambda r: r.slots_total - r.slots_busy)
    for model, offer in offers.items():
        if model not in routes and (kind is None or offer.kind == kind):
            routes[model] = ModelRoute(model, offer.queue, [], offer)
    return routes


class ModelRouter:
    def __init__(self, client: SlotqClient, *, ttl_s: float, memory_s: int) -> None:
        self.client = client
        self.ttl_s = ttl_s
        self.memory_s = memory_s
        self.seen = ModelsSeen(client.redis)
        self._routes: dict[str, ModelRoute] = {}
        self._by_kind: dict[JobKind, dict[str, ModelRoute]] = {}
        self._fetched_at = float("-inf")
        self._remembered: dict[str, float] = {}
        self._lock = asyncio.Lock()

    async def routes(self) -> dict[str, ModelRoute]:
        if time.monotonic() - self._fetched_at < self.ttl_s:
            return self._routes
        async with self._lock:                     # one refresh for all the requests waiting on it
            if time.monotonic() - self._fetched_at >= self.ttl_s:
                workers = await self.client.workers()
                offers = await catalog.read(self.client.redis, now=time.time())
                self._routes = routes_from(workers, offers=offers)
                self._by_kind = {kind: routes_from(workers, kind, offers) for kind in JobKind}
                self._fetched_at = time.monotonic()
                await self._remember(list(self._routes))
        return self._routes

    async def models_of(self, kind: JobKind) -> list[str]:
        """The models live workers serve, or offer to load, for ``kind`` of job, by name."""
        await self.routes()
        return sorted(self._by_kind.get(kind, {}))

    async def route(self, model: str, kind: JobKind | None = None) -> ModelRoute:
        """The queue for ``model``; with ``kind``, one whose workers serve that kind of job when any
        does (a model name served for both kinds, on two queues), else any (the caller refuses it)."""
        route = (await self.routes()).get(model)
        if route is not None:
            return self._by_kind.get(kind, {}).get(model, route) if kind is not None else route
        seen = await self.seen.last_seen(model)
        if seen is not None and time.time() - seen < self.memory_s:
            raise ApiError(503, f"no live worker serves or can load model {model!r} right now; try again later",
                           type="server_error", param="model", code="model_unavailable")
        served = ", ".join(sorted(self._routes)) or "none"
        raise ApiError(404, f"the model {model!r} does not exist (served now: {served})", param="model",
                       code="model_not_found")

    async def _remember(self, models: list[str]) -> None:
        now = time.time()
        due = {m: now for m in models if now - self._remembered.get(m, 0) > _REMEMBER_EVERY_S}
        if due:
            await self.seen.remember(due)
            self._remembered |= due
