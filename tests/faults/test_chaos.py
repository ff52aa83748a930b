"""The chaos run, bounded: every fault slotq promises to survive, against one stream of jobs, with
consumers that follow each job exactly as the README shows (``async for e in handle.stream()``).

It runs on two backends. ``single``: three ``slotq worker`` subprocesses (tiny model, 4 slots, 3 s
lease) reach a Valkey server (AOF, every write fsynced) through a TCP proxy; the producer and its
followers talk to Valkey directly. ``cluster``: the same workers on a Valkey Cluster of 3 primaries
with a replica each (tests/support/proxied_cluster.py), every node behind a TCP proxy whose port it
announces, so the workers, and the producer and its followers too (they read the same slot map),
reach every node through a proxy. While 150 jobs (ignore_eos, 40-250 tokens, 16 outstanding at
any time) run, a seeded schedule applies, in random order, one fault each time another eleventh of
the jobs has been enqueued (so each finds jobs running):

* eight kill -9 of a serving worker, each replaced at once, as a supervisor would;
* one SIGSTOP longer than the lease, then SIGCONT (the frozen worker's jobs move on; its late
  writes must be refused);
* ``single``: one kill -9 of Valkey and a restart on the same data directory (it replays its AOF);
  ``cluster``: one kill -9 of the primary that holds the queue's slot, and its replica promoted
  (both once every worker is held still for a moment, as in the other Valkey kills of the fault
  tests: a write in flight at a crash is tested on its own, and replication is asynchronous);
* one network cut between the workers and Valkey (on a cluster: between every client and every
  node, at once): nothing passes for 1.5 s, then every connection drops.

``engine-process``: the ``single`` run with every worker's engine in a process of its own
(``SLOTQ_ENGINE_PROCESS``); every other kill is of a worker's engine process instead of the worker
(the worker hands its jobs back and exits with code 70, and is replaced), and each killed worker's
engine process must exit by itself. Its SIGSTOP stops the worker and not its engine process, whose
steps pile up unread until SIGCONT.

Asserted: no job lost or failed; every follower ended with its job's final entry, and what it was
given is exactly what the stream holds (nothing duplicated, nothing missing); stream text ==
result text and completion tokens == max_tokens; the queue is empty; every worker exits on
SIGTERM within its bound (drain_grace_s + EXIT_MARGIN_S), with status 0.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.schemas import JobRequest, JobResult, JobStatus, StreamEntry
from slotq.jobs.redis_server import EmbeddedRedis
from slotq.jobs.worker.worker import EXIT_ENGINE_DIED, EXIT_MARGIN_S
from tests.support.faults import (
    LOCK_TTL_S,
    Fleet,
    LatencyProxy,
    check_job,
    engine_process_of,
    report,
    wait_exited,
    worker_env,
)
from tests.support.jobs import job_request, raw_entries, settings_for
from tests.support.proxied_cluster import ProxiedCluster

pytestmark = pytest.mark.fault

SEED = 20261130
JOBS = 150
WORKERS = 3
OUTSTANDING = 16             # more than the fleet's 12 slots: every worker is busy when a fault hits
MIN_TOKENS, MAX_TOKENS = 40, 250
KILLS = 8
STOP_S = LOCK_TTL_S + 2      # a SIGSTOP longer than the lease
CUT_HOLD_S = 1.5
DRAIN_GRACE_S = 5
EXIT_BOUND_S = DRAIN_GRACE_S + EXIT_MARGIN_S


@dataclass
class ChaosValkey:
    """Where a backend's Valkey is for the run, and how its own two faults are applied."""

    backend: str
    producer_url: str                             # the producer and its followers
    worker_url: str                               # through the proxies that :attr:`cut` cuts
    outage: str                                   # the Valkey fault's name in the schedule
    fail: Callable[[Fleet, SlotqClient, random.Random], Awaitable[None]]
    cut: Callable[[float], Awaitable[int]]        # a network cut held that long; the connections dropped
    engine_process: bool = False                  # the workers' engines in processes of their own


@pytest.fixture(params=["single", "cluster", "engine-process"])
async def chaos_valkey(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ChaosValkey]:
    if request.param == "cluster":
        cluster = ProxiedCluster(tmp_path / "cluster")
        try:
            await cluster.start()

            async def fail_over(fleet: Fleet, client: SlotqClient, rng: random.Random) -> None:
                await cluster.fail_over_quietly(fleet, cluster.queue_primary(client))

            yield ChaosValkey("cluster", cluster.url, cluster.url, "primary_failover", fail_over, cluster.cut)
        finally:
            await cluster.close()
        return
    server: EmbeddedRedis = request.getfixturevalue("fsync_redis")
    proxy = LatencyProxy(server.port or 0)
    await proxy.start()

    async def restart(fleet: Fleet, client: SlotqClient, rng: random.Random) -> None:
        await fleet.kill_redis_quietly(server)
        await asyncio.sleep(rng.uniform(0.3, 1.0))
        await asyncio.to_thread(server.restart)

    try:
        yield ChaosValkey(request.param, server.url, proxy.url, "redis_restart", restart, proxy.cut,
                          engine_process=request.param == "engine-process")
    finally:
        await proxy.close()


async def test_chaos_nothing_lost_nothing_duplicated_no_stream_ends_early(chaos_valkey: ChaosValkey,
                                                                           tiny_model_path: Path,
                                                                           tmp_path: Path) -> None:
    valkey = chaos_valkey
    client = await SlotqClient.connect(valkey.producer_url, settings_for(valkey.producer_url))
    rng = random.Random(SEED)
    # max_worker_deaths 5 (max_tries' default): random kills may catch a job before its first token
    # twice in a row, which would dead-letter it as killed_its_worker; that quarantine is not under test
    env = worker_env(valkey.worker_url, tiny_model_path, slots=4, ctx=1024, drain_grace_s=DRAIN_GRACE_S,
                     max_worker_deaths=5, engine_process=str(valkey.engine_process).lower())
    fleet = Fleet(client, env, tmp_path)
    names = [fleet.spawn().name for _ in range(WORKERS)]
    requests = [job_request(f"chaos {i}", max_tokens=rng.randint(MIN_TOKENS, MAX_TOKENS)) for i in range(JOBS)]
    faults = ["kill"] * KILLS + ["sigstop", valkey.outage, "network_cut"]
    rng.shuffle(faults)
    applied: list[tuple[str, int]] = []           # (fault, jobs outstanding when it hit)
    outstanding: set[str] = set()
    exits: dict[str, tuple[int | None, float]] = {}
    orphans: list[int] = []                       # engine processes of killed workers, which must exit
    try:
        await fleet.wait_ready(*names)
        started = time.monotonic()

        enqueued = 0
        enqueued_more = asyncio.Condition()

        async def run_job(request: JobRequest, room: asyncio.Semaphore) -> tuple[list[StreamEntry], JobResult]:
            nonlocal enqueued
            try:
                handle = await client.enqueue(request)
                outstanding.add(handle.id)
                async with enqueued_more:
                    enqueued += 1
                    enqueued_more.notify_all()
                entries = [e async for e in handle.stream()]
                return entries, await handle.result(timeout=60)
            finally:
                room.release()

        milestones = [i * JOBS // (len(faults) + 1) for i in range(1, len(faults) + 1)]
        fault_done = {m: asyncio.Event() for m in milestones}

        async def produce() -> list[tuple[list[StreamEntry], JobResult]]:
            """Closed loop of OUTSTANDING jobs that holds still at each milestone until its fault
            has been applied, so the fault meets a busy fleet however fast the fleet is."""
            room = asyncio.Semaphore(OUTSTANDING)
            jobs = []
            for k, request in enumerate(requests):
                if k in fault_done:
                    await fault_done[k].wait()
                await room.acquire()
                jobs.append(asyncio.create_task(run_job(request, room)))
            return await asyncio.gather(*jobs)

        async def serving() -> list[str]:
            """Workers that serve (not ones still starting), waiting for one if need be."""
            while not (ready := sorted({w.id for w in (await client.queue_info()).workers if w.ready}
                                       & set(fleet.alive()))):
                await asyncio.sleep(0.1)
            return ready

        async def chaos() -> None:
            """Fault i hits once the producer reached milestone i (and holds there)."""
            for milestone, fault in zip(milestones, faults):
                async with enqueued_more:
                    await enqueued_more.wait_for(lambda milestone=milestone: enqueued >= milestone)
                running = len(outstanding) - len(await client.finished(list(outstanding)))
                if fault == "kill":
                    victim = rng.choice(await serving())
                    if valkey.engine_process and sum(f == "kill" for f, _ in applied) % 2 == 0:
                        code = await fleet.kill_engine(victim)
                        assert code == EXIT_ENGINE_DIED, (code, fleet.logs())
                    else:
                        if valkey.engine_process:
                            orphans.append(engine_process_of(fleet.procs[victim].proc.pid))
                        fleet.kill(victim)
                    fleet.spawn()                         # the supervisor's replacement
                elif fault == "sigstop":
                    victim = rng.choice(await serving())
                    fleet.pause(victim)
                    await asyncio.sleep(STOP_S)
                    fleet.resume(victim)
                elif fault == valkey.outage:
                    await valkey.fail(fleet, client, rng)
                else:
                    assert await valkey.cut(CUT_HOLD_S) > 0
                applied.append((fault, running))
                fault_done[milestone].set()

        producing = asyncio.create_task(produce())
        async with asyncio.timeout(150):
            await chaos()
            outcomes = await producing
        wall = time.monotonic() - started

        # ---- each fault hit a running fleet
        assert sorted(f for f, _ in applied) == sorted(faults), applied
        assert all(running > 0 for _, running in applied), applied

        # ---- nothing lost, duplicated, or cut short
        failed = [(r.id, r.status, r.error) for _, r in outcomes if r.status != JobStatus.SUCCEEDED]
        assert not failed, (failed[:3], fleet.logs())
        for (followed, result), request in zip(outcomes, requests):
            assert followed and followed[-1].final, (result.id, "the stream ended before its final entry")
            stored = await raw_entries(client, result.id)
            assert [e.id for e in followed] == [e.id for e in stored], (result.id, "the follower missed or repeated")
            await check_job(client, result, max_tokens=request.max_tokens)
        info = await client.queue_info()
        assert info.queued == info.running == info.deferred == 0, info
        assert info.dead_letters == 0
        for pid in orphans:
            await wait_exited(pid, 20)
        retried = sum(r.attempts > 1 for _, r in outcomes)
        # the exit bound is a serving worker's: one SIGTERMed while it still starts (the last kill's
        # replacement, when the run ends soon after) dies of the signal before its handlers are set
        await fleet.wait_ready(*fleet.alive())
    finally:
        async def timed_stop(name: str) -> None:
            proc = fleet.procs[name]
            proc.proc.send_signal(signal.SIGCONT)
            t = time.monotonic()
            code = await asyncio.to_thread(proc.stop, EXIT_BOUND_S + 10)    # the proxy runs on this loop
            exits[name] = (code, time.monotonic() - t)

        await asyncio.gather(*(timed_stop(name) for name in fleet.procs))     # SIGTERM all at once
        fleet.procs.clear()
        await client.close()
    slow = {n: e for n, e in exits.items() if e[0] != 0 or e[1] > EXIT_BOUND_S}
    assert not slow, (slow, fleet.logs())
    engine_kills = KILLS - len(orphans) if valkey.engine_process else 0
    report(f"CHAOS backend={valkey.backend} jobs={JOBS} faults={[f for f, _ in applied]} engine_kills={engine_kills} "
           f"retried={retried} lost=0 duplicated=0 ended_early=0 wall_s={wall:.1f} "
           f"slowest_exit_s={max(e[1] for e in exits.values()):.1f}")
