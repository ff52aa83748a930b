"""The model catalog: every model the fleet can serve, loaded or not, and the queue its jobs wait in.

A worker given several models (``SLOTQ_MODELS``, ``SLOTQ_MODELS_DIR``) has one loaded at a time but
can load any of them; a worker of one model can load that one. Each heartbeat writes one entry per
model the worker can load into the hash ``slotq:catalog``: field ``<model><TAB><worker id>``, value
JSON (queue, kind, fingerprint, what its last load cost, and ``until``, three beats ahead, as the
worker's serving record). The gateway reads it to route a request for a model that no worker has
loaded to that model's queue, where the job waits durably until a worker switches to it
(:mod:`slotq.jobs.worker.model_switch`), and ``/v1/models`` lists it as ``unloaded``.

Why a field per model and worker rather than one per model: each worker writes only its own
fields (one HSET per beat), so no two workers race on one value and no script is needed; a reader
groups them, O(entries). Readers ignore entries past ``until``; each worker's beat deletes those an
hour past (a worker killed without a word) every ten minutes (:class:`CatalogPublisher`: not every beat,
which would read the whole catalog, O(fleet) per beat); a worker that stops deletes its own at once.

``slotq:catalog:loading:<model>`` (SET NX, with a TTL) names the one worker switching to a model,
so that of several idle workers one answers a model's demand, not all of them.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from redis.asyncio import Redis

from slotq.jobs.protocol.keys import CATALOG, loading_key
from slotq.jobs.protocol.replies import reply
from slotq.jobs.protocol.schemas import JobKind

FORGET_AFTER_S = 3600          # an entry this far past its time is deleted by the next sweep of any worker
SWEEP_EVERY_S = 600            # how often each worker's beat looks for such entries (one HGETALL of the catalog)
LOADING_TTL_S = 120            # a switching worker that died frees the model's loading mark after this long


@dataclass(frozen=True)
class CatalogEntry:
    """One model a worker can load: its ``queue``, the ``kind`` of job it serves, its GGUF's
    fingerprint, and ``load_s``, what loading it (engine start + warm-up) cost this worker last time
    (None before the first load)."""

    model: str
    queue: str
    kind: JobKind
    fingerprint: str
    load_s: float | None = None


@dataclass(frozen=True)
class CatalogModel:
    """A model as the fleet offers it: the queue its jobs go to, its kind and fingerprint, the live
    workers that can load it, and the shortest load time one of them measured (None: none has)."""

    model: str
    queue: str
    kind: JobKind
    fingerprint: str
    workers: tuple[str, ...]
    load_s: float | None


def _field(model: str, worker: str) -> str:
    return f"{model}\t{worker}"


class CatalogPublisher:
    """One worker's side of the catalog, kept across its beats.

    Each beat writes the worker's entries (one HSET) and deletes its own entries of models it no longer
    offers, known from what it wrote last, without reading the catalog. Entries of workers gone silent
    (killed without a word) are looked for only every :data:`SWEEP_EVERY_S`, with one HGETALL. A beat
    that read the whole catalog cost each worker O(fleet) per beat, so O(fleet^2) for the fleet: at 200
    workers, 4 % of their processes' CPU in ``slotq bench fleet``."""

    def __init__(self, worker: str) -> None:
        self.worker = worker
        self._offered: set[str] = set()            # the models of the last beat's entries
        self._next_sweep = float("-inf")           # wall time: the first beat sweeps

    async def beat(self, redis: Redis, entries: Sequence[CatalogEntry], *, ttl_s: float, now: float) -> None:
        """Offer ``entries`` (the models this worker can load) until ``now + ttl_s``; delete this worker's
        entries of models it offered before but no longer does (one that failed to load), and, every
        :data:`SWEEP_EVERY_S`, the entries of any worker gone silent :data:`FORGET_AFTER_S` ago."""
        until = now + ttl_s
        mapping = {_field(e.model, self.worker): json.dumps({"queue": e.queue, "kind": e.kind.value,
                                                             "fingerprint": e.fingerprint, "load_s": e.load_s,
                                                             "until": until})
                   for e in entries}
        offered = {e.model for e in entries}
        stale = [_field(model, self.worker) for model in sorted(self._offered - offered)]
        sweeping = now >= self._next_sweep
        if sweeping:
            stale += [name.decode() for name, value in (await reply(redis.hgetall(CATALOG))).items()
                      if json.loads(value)["until"] < now - FORGET_AFTER_S]
        async with redis.pipeline(transaction=False) as pipe:
            if mapping:
                pipe.hset(CATALOG, mapping=mapping)
            if stale:
                pipe.hdel(CATALOG, *stale)
            await pipe.execute()
        self._offered = offered
        if sweeping:
            self._next_sweep = now + SWEEP_EVERY_S


async def withdraw(redis: Redis, worker: str, models: Sequence[str]) -> None:
    """A worker stopping: the models only it could load leave the catalog at once."""
    if models:
        await reply(redis.hdel(CATALOG, *(_field(model, worker) for model in models)))


async def read(redis: Redis, *, now: float) -> dict[str, CatalogModel]:
    """Model name -> what the live entries say of it. Workers that disagree on a model's queue (or
    kind): the most common answer wins, ties by name, so every reader agrees."""
    by_model: dict[str, list[tuple[str, dict[str, object]]]] = {}
    for name, value in (await reply(redis.hgetall(CATALOG))).items():
        model, _, worker = name.decode().rpartition("\t")
        entry = json.loads(value)
        if entry["until"] >= now:
            by_model.setdefault(model, []).append((worker, entry))
    models = {}
    for model, entries in sorted(by_model.items()):
        votes = Counter((str(e["queue"]), str(e["kind"])) for _, e in entries)
        (queue, kind), _ = min(votes.items(), key=lambda item: (-item[1], item[0]))
        chosen = sorted(((w, e) for w, e in entries if (e["queue"], e["kind"]) == (queue, kind)), key=lambda we: we[0])
        loads = [float(str(e["load_s"])) for _, e in chosen if e["load_s"] is not None]
        models[model] = CatalogModel(model=model, queue=queue, kind=JobKind(kind),
                                     fingerprint=str(chosen[0][1]["fingerprint"]),
                                     workers=tuple(w for w, _ in chosen), load_s=min(loads) if loads else None)
    return models


async def claim_load(redis: Redis, model: str, worker: str) -> bool:
    """Whether ``worker`` may switch to ``model`` now: no other worker is switching to it."""
    return bool(await redis.set(loading_key(model), worker, nx=True, ex=LOADING_TTL_S))


async def release_load(redis: Redis, model: str) -> None:
    """The switch to ``model`` failed, or its worker's heartbeat now advertises the model (and other
    workers count it from there): the mark goes."""
    await redis.delete(loading_key(model))
