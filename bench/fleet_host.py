"""One process of the fleet benchmark's simulated fleet: many workers on simulated engines.

``python -m bench.fleet_host '<HostConfig as JSON>'`` runs ``workers`` real workers in one event
loop -- :class:`~slotq.jobs.worker.worker.SlotqWorker` (design ``slotq``) or the old claim path of
:mod:`bench.arq_baseline` (design ``baseline``) -- each on its own
:class:`~bench.sim_engine.SimulatedEngine`, against the benchmark's Valkey. It tells the driver
what only it can see by appending lines to ``record_path`` (a file, so nothing it reports adds
Redis traffic):

* ``READY <workers>`` once every worker has started (its engine is up);
* ``P <job id> <ready ms> <claimed ms>`` for each claim (the pickup: enqueue -> claim);
* ``S <unix time> <generated tokens> <busy slots> <event loop lag max ms>`` twice a second.

:class:`RecordReader` is the driver's side.

SIGTERM stops every worker and ends the process; a worker that fails ends it with exit code 1
(the driver watches this process and stops with its log tail).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal, Protocol

from pydantic import BaseModel

from bench.arq_baseline import BaselineWorker
from bench.fleet_counters import LagProbe
from bench.sim_engine import SimulatedEngine, SimulationParams
from slotq.jobs.protocol.redis_queue import ClaimedJob
from slotq.jobs.worker.engine_api import EngineFactory, JobEngine
from slotq.jobs.worker.settings import WorkerSettings
from slotq.jobs.worker.worker import SlotqWorker

log = logging.getLogger(__name__)

Design = Literal["slotq", "baseline"]
REPORT_EVERY_S = 0.5
# Python's cyclic GC in a process of a hundred workers: a full collection scans every tracked object of
# every worker and their running jobs (250,000 at 10,000 slots), and took 180-260 ms every 4-5 s,
# collecting nothing (jobs' objects are freed by reference counting), so every claim and write of the
# process waited. A worker process on its own machine holds a hundredth of that. The simulator
# collects far less often, and never scans what was built at start-up (gc.freeze): measured at
# 10,000 slots and 500 enqueues/s, loop lag max 280 -> 5 ms, pickup p99 31-140 -> 5 ms.
GC_THRESHOLDS = (50_000, 50, 1_000)
# Workers start spread over this: each keeps the phase of its once-a-second loops (engine step,
# stream flush, heartbeat, elastic tick) from its start, as workers on separate machines do. Started
# together, a process's hundred workers did all of that in one event-loop iteration each second
# (measured at 10,000 slots and 500 enqueues/s, with the GC as above: loop lag max 71-243 ms and
# pickup p99 61-109 ms started together; 8-9 ms and 7 ms spread).
START_SPREAD_S = 1.0
# SIGTERM ends the process within this: its workers are asked to stop at once (grace 0), and one
# still waiting on Redis (the benchmark's Valkey gone with the driver) is not waited for.
STOP_WITHIN_S = 5.0


class HostConfig(BaseModel):
    design: Design
    redis_url: str
    queues: list[str]            # worker i serves queues[i % len(queues)], as the model named after its queue
    partitions: int = 1          # each queue split into this many partitions (SLOTQ_QUEUE_PARTITIONS)
    workers: int
    slots: int
    name_prefix: str
    sim: SimulationParams
    stream_flush_ms: float
    record_path: Path


class Recorder:
    """Buffers the lines for the driver and appends them to the record file twice a second."""

    def __init__(self, path: Path) -> None:
        self._file: IO[str] = open(path, "a")  # noqa: SIM115 - open for the life of the process
        self._lines: list[str] = []

    def pickup(self, job_id: str, ready_ms: int) -> None:
        self._lines.append(f"P {job_id} {ready_ms} {time.time() * 1000:.1f}\n")

    def line(self, text: str) -> None:
        self._lines.append(text + "\n")

    def flush(self) -> None:
        if self._lines:
            self._file.write("".join(self._lines))
            self._file.flush()
            self._lines.clear()


@dataclass
class HostSample:
    at: float                  # unix time
    generated_tokens: int
    busy_slots: int
    lag_max_ms: float


class RecordReader:
    """The driver's side of a record file: reads what was appended since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = ""
        self.ready = False
        self.pickups: dict[str, tuple[int, float]] = {}      # job id -> (ready ms, claimed ms), first claim
        self.samples: list[HostSample] = []

    def poll(self) -> None:
        try:
            with open(self.path) as f:
                f.seek(self._offset)
                text = f.read()
                self._offset = f.tell()
        except FileNotFoundError:
            return                      # the process has not written anything yet
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            kind, *fields = line.split()
            if kind == "P":
                self.pickups.setdefault(fields[0], (int(fields[1]), float(fields[2])))
            elif kind == "S":
                self.samples.append(HostSample(float(fields[0]), int(fields[1]), int(fields[2]), float(fields[3])))
            elif kind == "READY":
                self.ready = True


class _Member(Protocol):
    """One worker of either design, seen the same way."""

    ready: asyncio.Event

    def run(self) -> Awaitable[object]: ...

    def engine(self) -> JobEngine | None: ...

    def observe_pickups(self) -> None: ...

    def stop(self) -> None: ...


class _SlotqMember:
    def __init__(self, settings: WorkerSettings, factory: EngineFactory, recorder: Recorder) -> None:
        self.worker = SlotqWorker(settings, settings.redis_url or "", engine_factory=factory)
        self.ready = self.worker.ready
        self.recorder = recorder

    def run(self) -> Awaitable[object]:
        return self.worker.run(handle_signals=False)

    def engine(self) -> JobEngine | None:
        return self.worker.engine

    def observe_pickups(self) -> None:
        """Claims are reported through the runtime's ``on_job_started`` hook (the pickup metric's)."""
        runtime = self.worker.runtime
        assert runtime is not None
        observed = runtime.on_job_started
        record = self.recorder.pickup

        def on_job_started(job: ClaimedJob) -> None:
            record(job.id, job.ready_ms)
            if observed is not None:
                observed(job)

        runtime.on_job_started = on_job_started

    def stop(self) -> None:
        self.worker.request_stop("benchmark step over", grace_s=0)


class _BaselineMember:
    def __init__(self, settings: WorkerSettings, factory: EngineFactory, recorder: Recorder) -> None:
        self.worker = BaselineWorker(settings, settings.redis_url or "", factory, recorder.pickup)
        self.ready = self.worker.ready

    def run(self) -> Awaitable[object]:
        return self.worker.run()

    def engine(self) -> JobEngine | None:
        return self.worker.engine

    def observe_pickups(self) -> None:
        """Already wired: the baseline reports each claim from its ``run_job``."""

    def stop(self) -> None:
        self.worker.request_stop()


def _member(config: HostConfig, index: int, recorder: Recorder) -> _Member:
    queue = config.queues[index % len(config.queues)]
    settings = WorkerSettings(redis_url=config.redis_url, queue_name=queue, model_name=queue.rpartition(":")[2],
                              slots=config.slots, ctx=4096, worker_name=f"{config.name_prefix}-{index}",
                              stream_flush_ms=config.stream_flush_ms, queue_partitions=config.partitions)
    kind = _SlotqMember if config.design == "slotq" else _BaselineMember
    return kind(settings, SimulatedEngine.factory(config.sim), recorder)


async def serve(config: HostConfig) -> int:
    gc.set_threshold(*GC_THRESHOLDS)
    recorder = Recorder(config.record_path)
    members = [_member(config, i, recorder) for i in range(config.workers)]
    tasks = [asyncio.create_task(_run_after(i * START_SPREAD_S / len(members), m), name=f"worker-{i}")
             for i, m in enumerate(members)]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready = asyncio.gather(*(m.ready.wait() for m in members))
    done, _ = await asyncio.wait({ready, *tasks}, return_when=asyncio.FIRST_COMPLETED)
    if ready not in done:
        ready.cancel()
        return _failed(tasks)
    for m in members:
        m.observe_pickups()
    gc.freeze()
    recorder.line(f"READY {len(members)}")
    recorder.flush()
    lag = LagProbe()
    reporter = asyncio.create_task(_report(members, recorder, lag))
    prober = asyncio.create_task(lag.run())
    stopping = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({stopping, *tasks}, return_when=asyncio.FIRST_COMPLETED)
    code = 0 if stopping in done else _failed(tasks)
    for task in (reporter, prober, stopping):
        task.cancel()
    for m in members:
        m.stop()
    _, waiting = await asyncio.wait(tasks, timeout=STOP_WITHIN_S)
    recorder.flush()
    if waiting:
        # asyncio.run would cancel them and wait again: a worker handing its jobs back keeps retrying
        # Redis through a cancel, and the process would outlive the benchmark
        log.warning("%d workers still stopping after %g s (is Redis gone?); leaving without them",
                    len(waiting), STOP_WITHIN_S)
        logging.shutdown()
        os._exit(code)
    return code


async def _run_after(delay_s: float, member: _Member) -> object:
    await asyncio.sleep(delay_s)
    return await member.run()


def _failed(tasks: list[asyncio.Task[object]]) -> int:
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            log.error("%s failed", task.get_name(), exc_info=task.exception())
            return 1
    log.error("a worker stopped on its own")
    return 1


async def _report(members: list[_Member], recorder: Recorder, lag: LagProbe) -> None:
    while True:
        await asyncio.sleep(REPORT_EVERY_S)
        stats = [engine.stats() for engine in (m.engine() for m in members) if engine is not None]
        tokens = sum(s.generated_tokens for s in stats)
        busy = sum(s.slots_busy for s in stats)
        recorder.line(f"S {time.time():.3f} {tokens} {busy} {lag.take_max_ms():.1f}")
        recorder.flush()


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    config = HostConfig.model_validate_json(sys.argv[1])
    sys.exit(asyncio.run(serve(config)))


if __name__ == "__main__":
    main()
