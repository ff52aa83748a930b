"""The slotq worker: one engine (one model, N slots) fed from a Redis queue.

* It claims at most as many jobs as it has slots (:class:`~slotq.jobs.worker.runtime.QueueRuntime`), and
  only while its heartbeat is current and its engine alive.
* A heartbeat renews the lease of every job it runs (``lock_ttl_s``, renewed every third of it) and
  advertises the worker (queue, model, context, slots, KV use, tokens/s) for ``slotq status``, the
  gateway and producers' limit checks. A killed worker's jobs are requeued by any other worker's
  reaper once their lease expires; a worker that stalled past its lease is fenced off.
* The heartbeat, the cancel listener and the metrics loop run under a :class:`Supervisor`: an
  unexpected exception is logged, sent to Sentry, and the loop restarted.
* It serves one model and kind on one queue at a time: loading a model, it joins the queue's
  serving record, which refuses a worker of another model or kind while one serves the queue
  (:class:`~slotq.jobs.errors.QueueServedByAnotherModel`, before the model loads), and every job
  is checked against its model before it runs (:mod:`slotq.jobs.worker.served_model`). Given
  several models (``SLOTQ_MODELS``, ``SLOTQ_MODELS_DIR``), each on a queue of its own, it offers
  them all in the fleet's catalog (:mod:`slotq.jobs.protocol.catalog`) and loads the first.
* Before it claims anything it runs one warm-up decode; only then is it ready (heartbeat field
  ``ready``, HTTP ``/ready`` next to ``/metrics``; ``/live`` for liveness, see :mod:`slotq.jobs.worker.health`).
* Its active slots follow memory, KV use, decode speed and waiting work, and it degrades in steps
  under sustained pressure (:mod:`slotq.jobs.worker.elastic`): it holds at most as many jobs as active slots.
* SIGTERM/SIGINT: stop claiming, let running jobs finish within ``drain_grace_s``, then hand the
  rest back without using a try; a second signal hands everything back at once. The process exits
  within ``drain_grace_s + EXIT_MARGIN_S`` of the first signal, always (:meth:`SlotqWorker._arm_exit_deadline`).
* If the engine thread dies, the worker stops claiming, hands its jobs back (no try used: they
  resume elsewhere from what they streamed), reports to Sentry and exits with code 70 so that its
  supervisor (honcho, systemd, Kubernetes) restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIServer

import sentry_sdk
from redis.asyncio import Redis
from redis.exceptions import RedisError

from slotq.engine import Engine, EngineStats
from slotq.engine.process import EngineProcess
from slotq.jobs.aio import wait_until_set
from slotq.jobs.errors import QueuePartitionsDiffer, QueueServedByAnotherModel
from slotq.jobs.protocol import catalog, registry
from slotq.jobs.protocol.arq_adapter import Attempt
from slotq.jobs.protocol.catalog import CatalogEntry
from slotq.jobs.protocol.connection import connect
from slotq.jobs.protocol.keys import JOB_FUNCTION, loading_key
from slotq.jobs.protocol.partitioned_queue import Queue, open_queue
from slotq.jobs.protocol.preemption import NOT_STARTED, Progress
from slotq.jobs.protocol.redis_queue import AttemptLedger, ClaimedJob, not_started
from slotq.jobs.protocol.registry import QueueMembership, QueueServer
from slotq.jobs.protocol.replies import reply
from slotq.jobs.protocol.schemas import JobKind, WorkerInfo
from slotq.jobs.protocol.serialization import deserialize, serialize
from slotq.jobs.worker import health, metrics, model_switch
from slotq.jobs.worker.elastic import metrics as elastic_metrics
from slotq.jobs.worker.elastic.loop import ElasticLoop
from slotq.jobs.worker.engine_api import EngineFactory, JobEmbedder, JobEngine, JobRanker
from slotq.jobs.worker.fault_injection import JobFaults, WorkerFaults
from slotq.jobs.worker.job_run import JobRun
from slotq.jobs.worker.runtime import QueueRuntime
from slotq.jobs.worker.served_model import ServedModel, gguf_fingerprint
from slotq.jobs.worker.settings import WorkerSettings
from slotq.jobs.worker.start_gate import StartGate
from slotq.jobs.worker.stream_writer import StreamWriter
from slotq.jobs.worker.supervisor import Supervisor

log = logging.getLogger(__name__)

_MODEL_LOOPS = ("cancel-listener", "engine-watch", "elastic")    # bound to the loaded model's engine and queue

EXIT_ENGINE_DIED = 70               # EX_SOFTWARE: restart me
EXIT_STOP_OVERDUE = 70              # also EX_SOFTWARE: something kept the worker from stopping in time
# The worker's exit bound is drain_grace_s + EXIT_MARGIN_S: the margin holds the hand-back (up to
# 15 s), flushing streams and stopping the loops (a few seconds), and Redis commands retrying
# through a short outage. Deploy manifests allow a little more (deploy/README.md, "Graceful drain").
EXIT_MARGIN_S = 30
# A stopping worker's farewell writes (registry, catalog, the queue's serving record) get this long in all
FAREWELL_S = 5.0
# How often a worker serving metrics reads the queue's gauges (slotq_queue_*): Prometheus scrapes every 15 s
# or more, and every worker exports the same queue-wide figures
QUEUE_SAMPLE_S = 5.0


@dataclass(frozen=True)
class ModelOffer:
    """A model this worker can load: its file, and its entry in the fleet's catalog."""

    path: Path
    entry: CatalogEntry


@dataclass(frozen=True)
class SwitchTimes:
    """Where a switch's time went: it began (``time.monotonic()``) with the claim gate closed,
    unloaded the old model in ``unload_s`` and loaded (and warmed up) the new one in ``load_s``."""

    started_at: float
    unload_s: float
    load_s: float
    kept: bool = False      # the model was kept loaded (SLOTQ_MODELS_MAX): load_s is no load


def engine_heartbeat_fields(stats: EngineStats) -> dict[str, int | str]:
    """What a heartbeat (:class:`WorkerInfo`) carries of the engine's snapshot: slots, tokens, KV
    use and speculative decoding's counters."""
    return {"slots_total": stats.slots_total, "slots_busy": stats.slots_busy, "waiting": stats.waiting,
            "generated_tokens": stats.generated_tokens, "kv_cells_used": stats.kv_cells_used,
            "kv_cells_cached": stats.kv_cells_cached, "kv_cells_total": stats.kv_cells_total,
            "spec": stats.spec, "spec_draft_tokens": stats.spec_draft_tokens,
            "spec_accepted_tokens": stats.spec_accepted_tokens}


class SlotqWorker:
    """Owns the engine, the stream writer, the heartbeat and the queue runtime."""

    def __init__(self, settings: WorkerSettings, redis_url: str, engine_factory: EngineFactory | None = None) -> None:
        self.settings = settings
        self.redis_url = redis_url
        # the fleet benchmark passes a simulated engine
        self.engine_factory = engine_factory or (EngineProcess.start if settings.engine_process else Engine.start)
        self.id = settings.worker_name or f"{socket.gethostname()}:{os.getpid()}"
        self.token = f"{self.id}:{uuid.uuid4().hex[:8]}"
        self.lease_ms = settings.lock_ttl_s * 1000
        self.engine: JobEngine | None = None
        self.embedder: JobEmbedder | None = None      # the engine again, on an embedding worker
        self.ranker: JobRanker | None = None          # the engine again, on a rerank worker
        self.served: ServedModel | None = None          # known once the model file is found
        self.membership: QueueMembership | None = None   # this worker's entry in its queue's serving record
        self.offers: dict[str, ModelOffer] = {}         # the models it can load, the loaded one first (catalog)
        self._catalog = catalog.CatalogPublisher(self.id)   # each beat offers them
        self._load_started = 0.0
        self._switching = False                         # deciding to unload: claims nothing
        self.last_switch: SwitchTimes | None = None     # where the last switch's time went
        # idle models kept loaded (SLOTQ_MODELS_MAX), the least recently used first
        self._kept: dict[str, tuple[JobEngine, JobEmbedder | None, JobRanker | None]] = {}
        self._reused = False                            # the model now served came back from _kept: no load
        self._first_name = ""                           # the model it loads at start-up (_first_model)
        self._loading_mark: str | None = None           # a switch's loading mark, until a beat advertises the model
        self.writer: StreamWriter | None = None
        self.runtime: QueueRuntime | None = None
        self.queue: Queue | None = None
        self.started_at = time.time()
        self.exit_code = 0
        self.ready = asyncio.Event()         # set once warmed up: jobs may be claimed
        self.elastic: ElasticLoop | None = None
        self.health = health.Health(ready_check=self._readiness)
        self.supervisor = Supervisor(
            on_restart=lambda name: elastic_metrics.LOOP_RESTARTS.labels(loop=name).inc())
        self._draining = False
        self._hand_back_now = asyncio.Event()
        self._beat_now = asyncio.Event()
        self._http: WSGIServer | None = None
        self._heartbeat_ok_at = 0.0
        self._main: asyncio.Task[None] | None = None
        # held so the loop's weak reference is not the only one: a drain collected midway never cancels _main
        self._drain_task: asyncio.Task[None] | None = None
        self._owns_process = False
        self._exit_deadline: threading.Timer | None = None
        self._tokens_seen: tuple[float, int] | None = None
        self._faults = WorkerFaults.from_env()
        self._job_faults = JobFaults.from_env()
        self._runs: dict[str, JobRun] = {}   # the attempts running here, by job id
        self._start_gate = StartGate(flush=self._write_all_streams)     # suspects start isolated

    # ------------------------------------------------------------------ running
    async def run(self, *, handle_signals: bool = True) -> int:
        """Serve until stopped; returns the process exit code (0, or 70 if the engine died)."""
        self.supervisor.start("liveness", self._liveness_loop)
        if self.settings.metrics_port:          # probes answer from the start, even while Redis is unreachable
            self._http = health.serve(self.settings.metrics_port, self.health)
            log.info("Prometheus metrics on :%d/metrics, readiness on /ready, liveness on /live",
                     self.settings.metrics_port)
        redis = await connect(self.redis_url, patient=True, ca_file=self.settings.redis_ca_file)
        self._first_name = await self._first_model(redis)
        self.queue = self._open_queue(redis, self.settings.queue_of(self._first_name))
        self.runtime = QueueRuntime(
            function_name=JOB_FUNCTION, job=self.run_job, queue=self.queue, token=self.token, lease_ms=self.lease_ms,
            slots=self.settings.slots, job_timeout_s=self.settings.job_timeout_s,
            keep_result_s=self.settings.keep_result_s, max_tries=self.settings.max_attempts + 1,
            poll_delay_s=self.settings.poll_delay_s, serializer=serialize, deserializer=deserialize,
            lane_min_share=self.settings.lane_min_share, may_claim=self._may_claim,
            on_job_started=self._observe_pickup, progress=self._progress,
            on_preempted=lambda victim: metrics.LANE_PREEMPTIONS.labels(lane=victim.lane).inc(),
            on_reserve=lambda job: (metrics.TENANT_RESERVE_RUNS if job.lent_reserve
                                    else metrics.LANE_RESERVE_RUNS).labels(lane=job.lane).inc(),
            on_startup=self._on_startup, on_shutdown=self._on_shutdown)
        if handle_signals:
            self._owns_process = True
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.request_stop, sig.name)
        self._main = asyncio.create_task(self.runtime.run(), name="slotq-runtime")
        try:
            await self._main
        except asyncio.CancelledError:
            if not self._draining:
                raise
        finally:
            await self.runtime.close()
        log.info("worker %s stopped", self.id)
        return self.exit_code

    def _open_queue(self, redis: Redis, name: str) -> Queue:
        """The queue ``name`` in this worker's partitions (``SLOTQ_QUEUE_PARTITIONS``: every model's queue is
        split the same way). Its claims skip a partition found empty for up to one poll delay: a partition is
        still claimed once per poll, as the idle loop claims every poll (due retries get no wake token)."""
        return open_queue(redis, name, self.settings.lanes, partitions=self.settings.queue_partitions,
                          clock_offset_s=self.settings.clock_offset_s, dry_recheck_s=self.settings.poll_delay_s)

    def _may_claim(self) -> bool:
        """Claim only once warmed up, while the heartbeat renews leases, the engine runs and the
        elastic controller is not refusing new jobs."""
        return self._readiness()[0] and (self.elastic is None or self.elastic.accepting)

    def _readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready = warmed up, heartbeat current, engine alive, not draining (``/ready``, heartbeat)."""
        # Two beats may be late (a loaded machine) before claiming stops; leases last three beats.
        fresh = time.monotonic() - self._heartbeat_ok_at < self.settings.lock_ttl_s * 2 / 3
        if self.runtime is None:
            state = "connecting_to_redis"
        elif self._switching and self.ready.is_set():
            state = "switching_model"           # claims nothing: about to unload (a worker of several models)
        elif self.engine is None:
            state = "loading_model"
        elif self.engine.failure is not None:
            state = "engine_failed"
        elif not self.ready.is_set() or not self._heartbeat_ok_at:
            state = "warming_up"        # or its first heartbeat (which advertises it) has not landed yet
        elif self._draining:
            state = "draining"
        elif not fresh:
            state = "redis_unreachable"
        elif self._stalled():
            state = "redis_stalled"
        else:
            state = "ready"
        detail: dict[str, Any] = {"state": state, "worker": self.id}
        if self.elastic is not None:
            detail |= self.elastic.heartbeat_fields()
        return state == "ready", detail

    def _stalled(self) -> bool:
        """Past ``SLOTQ_HEALTH_MAX_STALL_S``: a stream entry still waits for Redis to take it, or the
        claims and reaps have all failed (Redis reachable, so the heartbeat stays current, yet refusing
        what the worker asks: a Lua error, OOM, WRONGTYPE)."""
        limit = self.settings.health_max_stall_s
        waited = self.writer.backlog()[1] if self.writer is not None else 0.0
        return waited > limit or (self.runtime is not None and self.runtime.failing_for() > limit)

    # ------------------------------------------------------------------ lifecycle
    async def _on_startup(self) -> None:
        assert self.queue is not None and self.runtime is not None
        self.offers = await asyncio.to_thread(self._model_offers)
        self.writer = StreamWriter(self.queue.redis, flush_ms=self.settings.stream_flush_ms,
                                   maxlen=self.settings.stream_maxlen, ttl_s=self.settings.stream_ttl_s,
                                   ttl_live_s=self.settings.job_timeout_s + self.settings.stream_ttl_s,
                                   writer_id=self.token,
                                   on_fenced=self.runtime.lose_lease)   # a refused write: that attempt stops
        await self._load_model(self._first_name)
        self.writer.start()
        self.supervisor.start("heartbeat", self._heartbeat_loop)
        if self.settings.metrics_port:
            self.supervisor.start("metrics", self._metrics_loop)
        await self._warm_up()
        if len(self.offers) > 1:
            self.supervisor.start("model-switch", self._model_switch_loop)

    def _model_offers(self) -> dict[str, ModelOffer]:
        """Every model this worker can load (:meth:`WorkerSettings.model_files`), with its queue, kind
        and fingerprint: what it offers the fleet's catalog. Reads each file's header (a thread)."""
        return {name: ModelOffer(path, CatalogEntry(model=name, queue=self.settings.queue_of(name),
                                                    kind=self.settings.job_kind(path),
                                                    fingerprint=gguf_fingerprint(path)))
                for name, path in self.settings.model_files().items()}

    async def _load_model(self, name: str) -> None:
        """Serve ``name``: join its queue's serving record (refused by name before a long load when
        another model holds the queue), start its engine, and the loops bound to the engine and the
        queue. Claiming waits for :meth:`_warm_up`."""
        assert self.queue is not None and self.runtime is not None
        offer = self.offers[name]
        config = self.settings.engine_config(offer.path)
        self._load_started = time.monotonic()
        self.served = ServedModel(name=name, kind=offer.entry.kind, fingerprint=offer.entry.fingerprint)
        self.membership = QueueMembership(self.queue.redis, self.queue.keys, QueueServer(
            worker=self.id, kind=self.served.kind, model=self.served.name, partitions=self.settings.queue_partitions))
        await self._join_queue()                # refused before a long model load
        log.info("loading %s as %r (fingerprint %s) for %s jobs (%d slots, ctx %d)", config.model_path.name,
                 self.served.name, self.served.fingerprint, self.kind.value, config.slots, config.ctx)
        kept = self._kept.pop(name, None)
        self._reused = kept is not None
        while len(self._kept) > self.settings.models_max - 1:     # room for this one first
            lru, (oldest, _, _) = next(iter(self._kept.items()))
            del self._kept[lru]
            log.info("unloading model %s (kept loaded, the least recently used)", lru)
            await oldest.close()
        if kept is not None:
            self.engine, self.embedder, self.ranker = kept   # kept loaded (SLOTQ_MODELS_MAX): no load
        elif self.kind == JobKind.EMBEDDING:
            from slotq.engine.embedding import EmbeddingEngine

            self.engine = self.embedder = await EmbeddingEngine.start(config)
        elif self.kind == JobKind.RERANK:
            from slotq.engine.rerank import RerankEngine

            self.engine = self.ranker = await RerankEngine.start(config)
        else:
            self.engine = await self.engine_factory(config)
        await self._join_queue()                # the load may have outlasted the entry; before any claim
        self.runtime.reserve = self.engine.reserve_slots
        self.supervisor.start("cancel-listener", self._cancel_listener)
        self.supervisor.start("engine-watch", self._engine_watch)
        if self.kind == JobKind.GENERATION:     # its signals (KV use, decode speed) are a generator's
            self.elastic = ElasticLoop(self.settings, engine=self.engine, runtime=self.runtime, queue=self.queue,
                                       faults=self._faults, worker_id=self.id)

    async def _warm_up(self) -> float:
        """One warm-up decode, then claim: the model's load ends here (``slotq_model_load_seconds``,
        the heartbeat's ``load_s``, the catalog). Returns the seconds since :meth:`_load_model` began."""
        assert self.engine is not None and self.runtime is not None and self.served is not None
        warm_s = 0.0 if self._reused else await self.engine.warm_up()
        if self._faults.warmup_delay_s:
            await asyncio.sleep(self._faults.warmup_delay_s)
        if self.elastic is not None:
            self.supervisor.start("elastic", self.elastic.run)
        took_s = time.monotonic() - self._load_started
        if not self._reused:                    # a kept engine's return is no load: the figures stay the loads'
            metrics.MODEL_LOAD.labels(model=self.served.name).observe(took_s)
            offer = self.offers[self.served.name]
            self.offers[self.served.name] = ModelOffer(offer.path, replace(offer.entry, load_s=round(took_s, 3)))
        self.ready.set()
        self._beat_now.set()
        self.runtime.nudge()
        log.info("worker %s ready (warm-up decode %.2f s, %s %.2f s): model %s, %d slots, queue %s, lanes %s",
                 self.id, warm_s, "kept loaded, back in" if self._reused else "load", took_s,
                 self.engine.info.model_name, self.settings.slots,
                 self.runtime.queue.keys.queue, ",".join(self.settings.lanes))
        return took_s

    async def _unload_model(self) -> None:
        """Stop serving the loaded model: claim nothing more, stop the loops bound to its engine and
        queue, leave the queue's serving record (the queue is free for any worker at once), and close
        the engine -- or, with ``SLOTQ_MODELS_MAX`` > 1, keep it loaded (its limits back to full;
        :meth:`_load_model` closes the least recently used kept one when the next needs room). Only
        with nothing running here (:meth:`_switch_to`)."""
        assert self.runtime is not None
        self.ready.clear()
        await self.supervisor.stop(only=_MODEL_LOOPS)
        self.elastic = None
        self.runtime.slots = self.settings.slots        # the next model's elastic loop starts from the full count
        if self.membership is not None:
            membership, self.membership = self.membership, None
            with contextlib.suppress(RedisError):      # unreachable: the entry ends three beats after its last
                await membership.leave()
        engine, embedder, ranker = self.engine, self.embedder, self.ranker
        self.engine = self.embedder = self.ranker = None
        if engine is None:
            return
        name = self.served.name if self.served is not None else None
        if self.settings.models_max > 1 and name in self.offers and engine.failure is None:   # not a failed load
            full = engine.full_limits
            engine.set_limits(active_slots=full.active_slots, n_batch=full.n_batch, prefill_chunk=full.prefill_chunk)
            self._kept[name] = (engine, embedder, ranker)       # the most recently used last
        else:
            await engine.close()

    async def _switch_to(self, name: str) -> None:
        """Serve ``name`` instead of the loaded model (:mod:`slotq.jobs.worker.model_switch` said so):
        close the claim gate, and only if nothing came in meanwhile, unload, claim from ``name``'s
        queue, load and warm up. A model that fails to load is dropped from this worker's offers and
        the previous model loaded again; if that fails too, the worker stops (exit code 70) for its
        supervisor to restart it."""
        assert self.queue is not None and self.runtime is not None and self.served is not None
        redis = self.queue.redis
        if not await catalog.claim_load(redis, name, self.id):
            return                                      # another worker is loading it
        previous = self.served.name
        if self._loading_mark is not None:     # the last switch's mark, its beat not landed yet
            await catalog.release_load(redis, self._loading_mark)
            self._loading_mark = None
        try:
            self._switching = True
            while self.runtime.claiming_now:
                await asyncio.sleep(0.01)
            if self.runtime.running or not self.runtime.idle or self._draining:
                return                                  # a claim raced the decision: stay (policy rule 1)
            log.info("switching from model %s to %s (its jobs wait, no worker has it loaded)", previous, name)
            started = time.monotonic()
            await self._unload_model()
            unloaded_s = time.monotonic() - started
            self._switching = False                     # no engine: the gate stays closed until the next is warm
            try:
                loaded_s = await self._serve(name)
                self.last_switch = SwitchTimes(started_at=started, unload_s=unloaded_s, load_s=loaded_s,
                                               kept=self._reused)
                log.info("switched from model %s to %s in %.2f s: unload %.2f s, %s %.2f s", previous, name,
                         time.monotonic() - started, unloaded_s, "kept loaded" if self._reused else "load", loaded_s)
            except Exception as exc:
                sentry_sdk.capture_exception(exc)
                if isinstance(exc, RedisError):          # not the model's fault: it stays offered
                    log.error("switching to model %s failed (%s: %s); loading %s again", name,
                              type(exc).__name__, exc, previous)
                else:
                    log.exception("model %s failed to load (%s: %s); this worker no longer offers it and loads "
                                  "%s again", name, type(exc).__name__, exc, previous)
                    del self.offers[name]
                    with contextlib.suppress(RedisError):
                        await catalog.withdraw(redis, self.id, [name])
                await self._unload_model()
                try:
                    await self._serve(previous)
                except Exception:
                    log.exception("model %s failed to load again; stopping (exit code %d)", previous,
                                  EXIT_ENGINE_DIED)
                    self.exit_code = EXIT_ENGINE_DIED
                    self.request_stop("no model could be loaded", grace_s=0)
        finally:
            self._switching = False
            if self.served is not None and self.served.name == name and self.ready.is_set():
                self._loading_mark = name       # the heartbeat that advertises it releases the mark
                self._beat_now.set()
            else:
                await catalog.release_load(redis, name)

    async def _serve(self, name: str) -> float:
        """Claim from ``name``'s queue, load the model and warm it up (the switch's second half);
        returns the seconds the load and warm-up took."""
        assert self.queue is not None and self.runtime is not None
        queue = self.offers[name].entry.queue
        if queue != self.queue.keys.queue:
            self.queue = self._open_queue(self.queue.redis, queue)
            await self.runtime.retarget(self.queue)
        await self._load_model(name)
        return await self._warm_up()

    async def _model_switch_loop(self) -> None:
        """A worker of several models: every :data:`model_switch.POLL_S`, note whether its model's
        queue is quiet, and once it has been for ``SLOTQ_MODEL_IDLE_S``, read the other models'
        queues and switch where :func:`model_switch.choose` says."""
        assert self.runtime is not None
        quiet_since = time.monotonic()
        while True:
            await asyncio.sleep(model_switch.POLL_S)
            if self.queue is None or self.served is None or not self.ready.is_set() or self._draining:
                quiet_since = time.monotonic()
                continue
            if self.runtime.running:            # busy: not quiet, and no Redis read needed to know it
                quiet_since = time.monotonic()
                continue
            pending = not_started(await self.queue.counts())
            if pending:
                quiet_since = time.monotonic()
            quiet_s = time.monotonic() - quiet_since
            if not model_switch.may_leave(running_here=self.runtime.running, pending=pending, quiet_s=quiet_s,
                                          idle_s=self.settings.model_idle_s):
                continue
            others = [name for name in self.offers if name != self.served.name]
            target = model_switch.neediest(await self._demands(self.queue.redis, others))
            if target is not None:
                await self._switch_to(target)
                quiet_since = time.monotonic()

    async def _first_model(self, redis: Redis) -> str:
        """The model to load first: of several, the one whose jobs have waited longest with no worker
        (the switch policy's rules 4 and 5: a worker started by a scaler for a model's demand loads
        that model), else the first given."""
        names = list(self.settings.model_files())
        if len(names) == 1:
            return names[0]
        return model_switch.neediest(await self._demands(redis, names)) or names[0]

    async def _demands(self, redis: Redis, models: list[str]) -> list[model_switch.Demand]:
        """What the queues of ``models`` hold, and whether another worker serves each (a ready one
        has it loaded, or one is loading it)."""
        workers = await registry.live_workers(redis)
        demands = []
        for name in models:
            queue = self.settings.queue_of(name)
            lanes = await self._open_queue(redis, queue).counts()
            ages = [lane.oldest_waiting_age_s for lane in lanes if lane.oldest_waiting_age_s is not None]
            served = any(w.model == name and w.queue == queue and not w.draining and w.id != self.id
                         for w in workers) or bool(await reply(redis.exists(loading_key(name))))
            demands.append(model_switch.Demand(
                model=name, waiting=sum(lane.waiting for lane in lanes), deferred=sum(lane.deferred for lane in lanes),
                oldest_wait_s=max(ages) if ages else None, served=served))
        return demands

    @property
    def kind(self) -> JobKind:
        """The kind of job this worker serves (generation until its model is known)."""
        return self.served.kind if self.served is not None else JobKind.GENERATION

    async def _join_queue(self) -> None:
        """Hold this worker's entry in the queue's serving record for three beats; raise
        :class:`QueueServedByAnotherModel` when a live worker of another model or kind holds the queue,
        :class:`QueuePartitionsDiffer` when one of this model splits it into another number of partitions."""
        assert self.membership is not None and self.served is not None
        other = await self.membership.join(ttl_s=self.settings.lock_ttl_s)
        if other is not None and (other.kind, other.model) == (self.served.kind, self.served.name):
            raise QueuePartitionsDiffer(queue=self.membership.keys.queue, partitions=self.settings.queue_partitions,
                                        other_partitions=other.partitions, other=f"worker {other.worker}")
        if other is not None:
            raise QueueServedByAnotherModel(
                queue=self.membership.keys.queue, model=self.served.name, kind=self.served.kind.value,
                other_worker=other.worker, other_model=other.model, other_kind=other.kind.value)

    async def _on_shutdown(self) -> None:
        assert self.queue is not None
        await self._faults.before_loops_stop(self._beat_now, lambda: self._heartbeat_ok_at)
        await self.supervisor.stop()
        if self.writer:
            await self.writer.close()
        try:
            # a courtesy (the heartbeat's TTL removes the same records), so bounded: after a cluster failover
            # a farewell's reply never came on a node connection, and the stop waited for it until the exit
            # bound (docs/cluster.md, "Operating it")
            async with asyncio.timeout(FAREWELL_S):
                await registry.leave(self.queue.redis, self.id)
                await catalog.withdraw(self.queue.redis, self.id, list(self.offers))
                if self.membership is not None:
                    await self.membership.leave()
        except (RedisError, TimeoutError) as exc:
            log.warning("leaving the worker registry, catalog and queue failed (%s: %s); they expire with the "
                        "heartbeat", type(exc).__name__, exc)
        if self.engine:
            await self.engine.close()
        for kept, _, _ in self._kept.values():
            await kept.close()
        if self._http is not None:
            await asyncio.to_thread(self._http.shutdown)
            self._http.server_close()

    def request_stop(self, reason: str = "stop requested", *, grace_s: float | None = None) -> None:
        """Drain: no new jobs, running ones get ``grace_s`` (default ``drain_grace_s``) to finish,
        then they are handed back and :meth:`run` returns. A second request hands back at once."""
        if self._draining:
            log.warning("%s again: handing every running job back now", reason)
            self._hand_back_now.set()
            return
        self._draining = True
        self._beat_now.set()                 # advertise "draining" at once
        grace = self.settings.drain_grace_s if grace_s is None else grace_s
        self._arm_exit_deadline(grace)
        if self.runtime is not None:
            self.runtime.stop_claiming()
            log.info("%s: draining (no new jobs; up to %g s for %d running)", reason, grace, len(self.runtime.claimed))
        self._drain_task = asyncio.create_task(self._drain(grace), name="slotq-drain")

    async def _drain(self, grace_s: float) -> None:
        if self.runtime is not None:
            deadline = time.monotonic() + grace_s
            while not self.runtime.idle and time.monotonic() < deadline and not self._hand_back_now.is_set():
                await asyncio.sleep(0.05)
            await self.runtime.hand_back_and_wait()
        if self._main is not None:
            self._main.cancel()

    def _arm_exit_deadline(self, grace_s: float) -> None:
        """Enforce the exit bound: if the process still runs ``grace_s + EXIT_MARGIN_S`` after the
        stop began, log why and exit with :data:`EXIT_STOP_OVERDUE`.

        A clean stop ends well before; this is for what nobody foresaw (a loop that ignores its
        cancellation, a Redis call stuck in a half-open connection, the engine thread not joining),
        so that a rollout never waits for SIGKILL and a worker whose engine died never sits
        forever. A timer thread, because it must fire even if the event loop is what is stuck. Its
        jobs are safe: what was not handed back returns to the queue when its lease expires. Only
        for a worker that owns its process (``run(handle_signals=True)``, i.e. ``slotq worker``),
        never for one embedded in another program or a test.
        """
        if not self._owns_process or self._exit_deadline is not None:
            return
        bound_s = grace_s + EXIT_MARGIN_S
        self._exit_deadline = threading.Timer(bound_s, self._exit_overdue, args=(bound_s,))
        self._exit_deadline.daemon = True
        self._exit_deadline.start()

    def _exit_overdue(self, bound_s: float) -> None:
        log.critical("worker %s did not stop within its exit bound of %g s; exiting now with code %d (jobs it "
                     "still holds return to the queue when their leases expire)", self.id, bound_s, EXIT_STOP_OVERDUE)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(EXIT_STOP_OVERDUE)

    async def _engine_watch(self) -> None:
        """The engine thread died: hand the jobs back and exit non-zero so a supervisor restarts us."""
        assert self.engine is not None
        failure = await self.engine.wait_failed()       # never returns when the engine closes cleanly
        log.critical("the engine thread died (%s: %s); handing jobs back and exiting with code %d",
                     type(failure).__name__, failure, EXIT_ENGINE_DIED)
        sentry_sdk.capture_exception(failure)
        self.exit_code = EXIT_ENGINE_DIED
        self._draining = True
        self._arm_exit_deadline(0)
        self._hand_back_now.set()
        await self._drain(0)
        await asyncio.Event().wait()        # the worker is stopping; nothing left to watch

    # ------------------------------------------------------------------ background loops
    async def _heartbeat_loop(self) -> None:
        """Every third of the lease, or at once when the worker's state changes (e.g. it became ready)."""
        while True:
            self._beat_now.clear()
            await self._heartbeat_once()
            await wait_until_set(self._beat_now, self.settings.lock_ttl_s / 3)

    async def _heartbeat_once(self) -> None:
        """Renew the leases of running jobs and advertise this worker."""
        assert self.runtime is not None and self.queue is not None and self.served is not None
        self._faults.on_heartbeat()
        runtime = self.runtime
        jobs = runtime.leases()
        await self._faults.before_renew(lambda: any(job.id in runtime.claimed for job in jobs))
        owned = await self.queue.renew(jobs, self.lease_ms)
        for job, ok in zip(jobs, owned):
            if not ok and runtime.is_current(job):
                log.warning("job %s: its lease expired and the job was requeued; abandoning this attempt", job.id)
                runtime.lose_lease(job.id, job.lease)
        try:
            if self.membership is not None:     # None while a worker of several models switches
                await self._join_queue()
        except (QueueServedByAnotherModel, QueuePartitionsDiffer) as exc:
            # Only after this worker went unheard past its entry's time (stalled, cut off from Redis) and
            # another model took the queue: the queue is theirs now. Its running jobs (leases just renewed)
            # may finish; it no longer advertises itself, so no route leads here.
            if not self._draining:
                log.error("%s; stopping", exc)
                self.request_stop("the queue is served by another model")
            return
        engine = self.engine                    # None while a worker of several models switches
        load_s = self.offers[self.served.name].entry.load_s     # what loading its model cost here (None: not yet)
        fields = (engine_heartbeat_fields(engine.stats()) if engine is not None else
                  {"slots_total": self.settings.slots, "slots_busy": 0, "waiting": 0, "generated_tokens": 0})
        generated = int(fields["generated_tokens"])
        now = time.time()
        rate = 0.0
        if self._tokens_seen is not None and now > self._tokens_seen[0]:
            # a new engine counts from 0 again: no negative rate after a switch
            rate = max(0.0, (generated - self._tokens_seen[1]) / (now - self._tokens_seen[0]))
        self._tokens_seen = (now, generated)
        advertised = self.served.name
        await registry.beat(self.queue.redis, WorkerInfo.model_validate({
            "id": self.id, "queue": self.queue.keys.queue, "model": advertised, "kind": self.served.kind,
            "ctx": engine.ctx_per_seq if engine is not None else 0, **fields,
            "adapters": [spec.name for spec in engine.config.lora_adapters] if engine is not None else [],
            "tokens_per_s": round(rate, 1), "started_at": self.started_at, "updated_at": now,
            "draining": self._draining, "ready": self.ready.is_set() and not self._draining,
            "models": len(self.offers), "partitions": self.settings.queue_partitions,
            **({} if load_s is None else {"load_s": load_s}),
            **(self.elastic.heartbeat_fields() if self.elastic else {})}), interval_s=self.settings.lock_ttl_s / 3)
        if not self._draining:
            await self._catalog.beat(self.queue.redis, [offer.entry for offer in self.offers.values()],
                                     ttl_s=self.settings.lock_ttl_s, now=now)
        if self._loading_mark is not None and self._loading_mark == advertised:
            # this beat advertises the model switched to: other workers count it from now on
            await catalog.release_load(self.queue.redis, self._loading_mark)
            self._loading_mark = None
        was_stale = not self._may_claim()
        self._heartbeat_ok_at = time.monotonic()
        if was_stale:
            self.runtime.nudge()        # the claim gate just opened (start-up, or the heartbeat recovered)

    async def _cancel_listener(self) -> None:
        """Cancels of jobs this worker runs arrive on its own channel: act on them at once."""
        assert self.queue is not None and self.runtime is not None
        await self.queue.follow_aborts(self.token, self.runtime.abort_now)

    async def _metrics_loop(self) -> None:
        """The gauges: this worker's own every second; the queue's, which every worker exports alike (the
        dashboard takes their max), every :data:`QUEUE_SAMPLE_S` (two round trips to Redis each: read every
        second by every worker, a fleet of N workers asked N times a second what one answer says)."""
        assert self.queue is not None
        sampler = metrics.EngineSampler()
        queue_sampled = -math.inf
        while True:
            if self.engine is not None:         # None while a worker of several models switches
                sampler.update(self.engine.stats())
            if self.writer is not None:
                metrics.sample_stream_backlog(*self.writer.backlog())
            elastic_metrics.WORKER_READY.set(int(self._readiness()[0]))
            if time.monotonic() - queue_sampled >= QUEUE_SAMPLE_S:
                metrics.sample_queue(await self.queue.counts())
                queue_sampled = time.monotonic()
            await asyncio.sleep(1)

    async def _liveness_loop(self) -> None:
        """Stamps the time every second: ``/live`` fails if the event loop stops running it."""
        while True:
            self.health.tick()
            await asyncio.sleep(1)

    def _progress(self, job_id: str) -> Progress:
        """How far a running job's attempt has got, for the preemption policy (not started until
        its attempt runs here)."""
        run = self._runs.get(job_id)
        return run.progress if run is not None else NOT_STARTED

    async def _write_all_streams(self) -> None:
        """Return once every entry the running attempts have added is in their streams."""
        assert self.writer is not None
        for job_id in list(self._runs):
            await self.writer.write_all(job_id)

    def _observe_pickup(self, job: ClaimedJob) -> None:
        metrics.PICKUP.labels(lane=job.lane).observe(max(0.0, (job.claimed_ms - job.ready_ms) / 1000))

    # ------------------------------------------------------------------ the job function
    async def run_job(self, attempt: Attempt, payload: Any) -> dict[str, Any]:
        assert self.engine is not None and self.writer is not None and self.runtime is not None
        assert self.queue is not None
        runtime = self.runtime
        job_id = attempt.job_id
        claim = runtime.claimed[job_id]
        run = JobRun(engine=self.engine, writer=self.writer, settings=self.settings, worker_id=self.id,
                     job_id=job_id, attempt=attempt.number, payload=payload, enqueued_at=attempt.enqueued_at,
                     is_abort=lambda: runtime.is_aborting(job_id),
                     lease_lost=lambda: runtime.has_lost_lease(job_id),
                     verdict=self.elastic.verdict if self.elastic else None,
                     ledger=AttemptLedger(self.queue, claim), lent_reserve=claim.lent_reserve,
                     faults=self._job_faults, gate=self._start_gate, embedder=self.embedder, ranker=self.ranker,
                     served=self.served)
        started = time.monotonic()
        log.info("job %s attempt %d started", job_id, attempt.number)
        self._faults.on_job_start(self._beat_now)
        self.writer.bind(job_id, claim.lease)
        try:        # from the bind on: a fence that fails to rise unbinds too
            opening = await self.writer.open(job_id)
            if not opening.raised:
                runtime.lose_lease(job_id, claim.lease)     # a newer claim holds the job's stream: this attempt stops
            self._runs[job_id] = run
            if runtime.full:
                # The claim that filled the slots went back to waiting before this attempt ran, so it
                # saw no preemption candidate and is not listening for preemption tokens; wake it to
                # wait again with one, rather than up to SLOTQ_POLL_DELAY_S later. No Redis command:
                # a full worker does not claim.
                runtime.nudge()
            result = await run.run(opening)
        except asyncio.CancelledError:
            log.info("job %s %s", job_id, "abandoned (lease lost)" if runtime.has_lost_lease(job_id) else "handed back")
            raise
        finally:
            self._start_gate.leave(job_id)
            self.writer.unbind(job_id)
            if self._runs.get(job_id) is run:
                del self._runs[job_id]
        metrics.observe_result(result)
        log.info("job %s %s (%s) in %.2f s: %d prompt + %d completion tokens", job_id, result.status.value,
                 result.finish_reason.value if result.finish_reason else "-", time.monotonic() - started,
                 result.usage.prompt_tokens, result.usage.completion_tokens)
        return result.model_dump(mode="json")
