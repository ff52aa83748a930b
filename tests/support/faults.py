"""Shared pieces of the fault-injection ("nothing lost") tests, tests/faults/.

Everything is real: a Valkey server per test with ``appendfsync always`` (so a SIGKILLed server
loses no acknowledged write), ``slotq worker`` subprocesses on the tiny random model with one
llama.cpp thread each, SIGKILL/SIGTERM sent to real processes.
"""

from __future__ import annotations

import asyncio
import os
import re
import resource
import signal
import ssl as ssl_module
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.schemas import EntryKind, JobResult, JobStatus, StreamEntry
from slotq.jobs.redis_cluster import LocalValkeyCluster
from slotq.jobs.redis_server import EmbeddedRedis
from tests.support.jobs import SLOTQ_BIN, WorkerProcess, clean_env, raw_entries, settings_for, wait_for_workers


class KnownBug(AssertionError):
    """An invariant broken by a documented bug. Tests that can hit one are marked
    ``xfail(strict=True, raises=KnownBug)``: any other failed assertion still fails them, and once
    the bug is fixed they XPASS, which strict turns into a failure (time to drop the marker)."""


def known_bug(ok: bool, message: str) -> None:
    if not ok:
        raise KnownBug(message)


LOCK_TTL_S = 3          # the smallest allowed: a killed worker's jobs are free again within 3 s


@pytest.fixture
def fault_backend() -> str:
    """What ``fsync_redis`` is: "single" (one Valkey); a test that must hold on a cluster too is
    marked :data:`ON_EVERY_FAULT_BACKEND`."""
    return "single"


ON_EVERY_FAULT_BACKEND = pytest.mark.parametrize("fault_backend", ["single", "cluster"])


@pytest.fixture
def fsync_redis(tmp_path: Path, fault_backend: str) -> Iterator[EmbeddedRedis | LocalValkeyCluster]:
    """A Valkey server of this test's own, every write fsynced before it is acknowledged; with the
    "cluster" ``fault_backend``, a 3-primary Valkey Cluster of its own (only its ``url`` is shared
    with a server: tests that restart or proxy the server run on one Valkey)."""
    if fault_backend == "cluster":
        with LocalValkeyCluster(tmp_path / "cluster", primaries=3, fsync="always") as cluster:
            yield cluster
        return
    server = EmbeddedRedis(tmp_path / "redis", port=0, fsync="always")
    server.start()
    try:
        yield server
    finally:
        try:
            server.stop()
        except Exception:
            pass


@pytest.fixture
async def fclient(fsync_redis: EmbeddedRedis | LocalValkeyCluster) -> AsyncIterator[SlotqClient]:
    c = await SlotqClient.connect(fsync_redis.url, settings_for(fsync_redis.url))
    try:
        yield c
    finally:
        await c.close()


def worker_env(url: str, model: Path, **overrides: Any) -> dict[str, str]:
    base: dict[str, Any] = {"redis_url": url, "model": model, "slots": 4, "threads": 1, "ctx": 512,
                            "lock_ttl_s": LOCK_TTL_S}
    return clean_env(**(base | overrides))


WORKER_MEMORY_LIMIT = 4 << 30     # address space per worker: a runaway allocation fails it, not the host


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_LIMIT, WORKER_MEMORY_LIMIT))


class LimitedWorkerProcess(WorkerProcess):
    """jobs_fixtures.WorkerProcess (``slotq worker``, stop() = SIGTERM then SIGKILL) with an
    address-space limit."""

    def __init__(self, name: str, env: dict[str, str], cwd: Path) -> None:
        self.name = name
        self.log = cwd / f"{name}.log"
        self._log_file = open(self.log, "wb")  # noqa: SIM115  (the child writes it until stop() closes it)
        self.proc = subprocess.Popen([str(SLOTQ_BIN), "worker"], env=env | {"SLOTQ_WORKER_NAME": name}, cwd=cwd,
                                     stdout=self._log_file, stderr=subprocess.STDOUT, preexec_fn=_limit_memory)


class Fleet:
    """``slotq worker`` subprocesses, started/killed/stopped by name; everything is reaped at the end."""

    def __init__(self, client: SlotqClient, env: dict[str, str], cwd: Path) -> None:
        self.client = client
        self.env = env
        self.cwd = cwd
        self.procs: dict[str, WorkerProcess] = {}
        self.retired: list[WorkerProcess] = []
        self._generation = 0

    def spawn(self, name: str | None = None, **env: Any) -> WorkerProcess:
        self._generation += 1
        name = name or f"fw{self._generation}"
        extra = {f"SLOTQ_{k.upper()}": str(v) for k, v in env.items()}
        proc = LimitedWorkerProcess(name, self.env | extra, self.cwd)
        self.procs[name] = proc
        return proc

    async def wait_ready(self, *names: str, timeout: float = 90) -> None:
        procs = [self.procs[n] for n in names]
        await wait_for_workers(self.client, set(names), timeout=timeout, procs=procs)

    def kill(self, name: str) -> float:
        """SIGKILL; returns the time.time() of the kill."""
        proc = self.procs.pop(name)
        proc.proc.send_signal(signal.SIGKILL)
        t = time.time()
        proc.proc.wait(10)
        proc._log_file.close()
        self.retired.append(proc)
        return t

    async def kill_engine(self, name: str) -> int | None:
        """SIGKILL the engine process of a worker started with ``SLOTQ_ENGINE_PROCESS``: the worker hands
        its jobs back and exits by itself, with code 70 (a supervisor restarts it). Returns its exit
        code (None if it did not exit within 60 s). The wait runs off this event loop, which may carry
        the proxies the worker's last writes pass through."""
        proc = self.procs.pop(name)
        os.kill(engine_process_of(proc.proc.pid), signal.SIGKILL)
        try:
            return await asyncio.to_thread(proc.proc.wait, 60)
        except subprocess.TimeoutExpired:
            return None
        finally:
            self.retired.append(proc)

    def pause(self, name: str) -> None:
        """SIGSTOP: the worker holds still (claims nothing) until :meth:`resume`."""
        self.procs[name].proc.send_signal(signal.SIGSTOP)

    def resume(self, name: str) -> None:
        self.procs[name].proc.send_signal(signal.SIGCONT)

    async def kill_redis_quietly(self, server: EmbeddedRedis) -> None:
        """SIGKILL Redis while every worker is held (SIGSTOP) for a moment, so no write is in flight:
        a write whose reply the crash swallows is tested on its own, deterministically, with
        :class:`FaultyProxy` (test_faults_redis.py); here the outage itself is under test."""
        async with self.held():
            server.kill()

    @asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """Every running worker held still (SIGSTOP) for the block, which starts once Redis has had
        0.1 s to answer whatever they had already sent."""
        held = self.alive()
        for name in held:
            self.pause(name)
        try:
            await asyncio.sleep(0.1)
            yield
        finally:
            for name in held:
                self.resume(name)

    def alive(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.proc.poll() is None]

    def stop_all(self) -> dict[str, int | None]:
        codes = {}
        for name, proc in list(self.procs.items()):
            proc.proc.send_signal(signal.SIGCONT)
            codes[name] = proc.stop(timeout=30)
            self.retired.append(proc)
        self.procs.clear()
        return codes

    def logs(self) -> str:
        return "\n".join(f"===== {p.name}\n{p.log_tail(6000)}" for p in [*self.retired, *self.procs.values()])


def engine_process_of(worker_pid: int) -> int:
    """The engine child of a `slotq worker` (multiprocessing's spawn, beside its resource tracker)."""
    children = [pid for task in Path(f"/proc/{worker_pid}/task").iterdir()
                for pid in (task / "children").read_text().split()]      # each thread's children
    for pid in children:
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return int(pid)
    raise AssertionError(f"worker {worker_pid} has no engine process among {children}")


def _process_state(pid: int) -> str:
    """A process's state letter as /proc gives it ("Z": exited, not yet reaped), or "gone"."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


async def wait_exited(pid: int, timeout: float) -> None:
    """Until the process ``pid`` has exited (a zombie counts: its parent was killed, not it)."""
    async with asyncio.timeout(timeout):
        while _process_state(pid) not in ("Z", "gone"):
            await asyncio.sleep(0.05)


def entry_time(entry: StreamEntry) -> float:
    """Redis stream ids start with the server's clock in ms: when the entry was written."""
    return int(entry.id.split("-")[0]) / 1000


@dataclass
class StreamCheck:
    text: str
    token_ids: list[int]
    finals: int
    attempts: list[int] = field(default_factory=list)


def stream_summary(entries: list[StreamEntry]) -> StreamCheck:
    body = [e for e in entries if e.kind == EntryKind.CHUNK and e.choice == 0]
    return StreamCheck(text="".join(e.text for e in body), token_ids=[t for e in body for t in e.token_ids],
                       finals=sum(e.final for e in entries), attempts=sorted({e.attempt for e in entries}))


async def check_job(client: SlotqClient, result: JobResult, max_tokens: int | None = None) -> StreamCheck:
    """The nothing-lost invariants of one finished job: succeeded, exactly one final entry (the last),
    chunk text == result text, one chunk token per completion token."""
    entries = await raw_entries(client, result.id)
    s = stream_summary(entries)
    assert result.status == JobStatus.SUCCEEDED, result
    assert s.finals == 1 and entries[-1].final, [e.model_dump(exclude={"timings", "usage"}) for e in entries[-3:]]
    assert s.text == result.text, (result.id, s.text, result.text)
    assert len(s.token_ids) == result.usage.completion_tokens, (result.id, len(s.token_ids), result.usage)
    if max_tokens is not None:
        assert result.usage.completion_tokens == max_tokens, result.usage
    return s


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def report(line: str) -> None:
    """Print a summary line and keep it in /tmp for the README."""
    print(line, flush=True)
    with open("/tmp/slotq_reliability.txt", "a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")




class RedisProxy:
    """A local front on a free port for the Redis on ``upstream_port``: subclasses decide, in
    ``_handle``, what passes between a client and Redis. ``ssl`` terminates TLS."""

    scheme = "redis"

    def __init__(self, upstream_port: int, ssl: ssl_module.SSLContext | None = None) -> None:
        self.upstream_port = upstream_port
        self.ssl = ssl
        self.port: int | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.ssl)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def _open_upstream(
            self, client_w: asyncio.StreamWriter) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """Register this connection's task (``close`` ends it) and connect to Redis; None, with the
        client's side closed, when Redis is not there. ``_handle`` discards the task when done."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            return await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            client_w.close()
            self._tasks.discard(task)
            return None


class FaultyProxy(RedisProxy):
    """A TCP proxy in front of Redis that injects one fault when armed. The next request that
    contains ``needle`` is forwarded to Redis and executed, and then

    * ``"drop_reply"``: the client's connection is closed before the reply reaches it -- the
      ambiguous failure of a crash or network cut right after a write;
    * ``"freeze"``: that connection passes nothing more either way (the client hangs on the reply),
      as if its process froze right after the request;
    * ``"delay"``: the request reaches Redis ``delay_s`` late (a slow round trip), then all is normal.

    With ``on="reply"`` the needle is looked for in Redis's replies instead (``freeze`` only): the
    request was executed, and its reply and everything after it never reach the client.

    A needle is bytes to find, or a compiled bytes pattern for replies that hold a value the test
    cannot know (the server's clock in a claim reply).
    """

    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port)
        self.needle: bytes | re.Pattern[bytes] | None = None
        self.mode = "drop_reply"
        self.on = "request"
        self.delay_s = 1.0
        self.fired = asyncio.Event()

    def arm(self, needle: bytes | re.Pattern[bytes], mode: str = "drop_reply", delay_s: float = 1.0,
            on: str = "request") -> None:
        assert mode in ("drop_reply", "freeze", "delay") and on in ("request", "reply")
        assert on == "request" or mode == "freeze"
        self.needle, self.mode, self.delay_s, self.on = needle, mode, delay_s, on

    def _armed_for(self, data: bytes) -> bool:
        if self.needle is None:
            return False
        return self.needle in data if isinstance(self.needle, bytes) else self.needle.search(data) is not None

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        upstream = await self._open_upstream(client_w)
        if upstream is None:
            return
        up_r, up_w = upstream
        cut = asyncio.Event()

        async def upstream_to_client() -> None:
            while data := await up_r.read(65536):
                if self.on == "reply" and self._armed_for(data):
                    self.needle = None
                    cut.set()
                    self.fired.set()
                if cut.is_set():
                    continue                        # read from Redis, never passed on
                client_w.write(data)
                await client_w.drain()

        back = asyncio.create_task(upstream_to_client())
        try:
            while data := await client_r.read(65536):
                if cut.is_set():                    # a reply needle froze this connection
                    await asyncio.Event().wait()        # until close() cancels us
                armed = self.on == "request" and self._armed_for(data)
                if armed and self.mode == "delay":
                    self.needle = None
                    self.fired.set()
                    await asyncio.sleep(self.delay_s)
                elif armed:
                    self.needle = None
                    cut.set()
                    up_w.write(data)
                    await up_w.drain()
                    await asyncio.sleep(0.2)        # Redis executes it
                    self.fired.set()
                    if self.mode == "freeze":
                        await asyncio.Event().wait()    # until close() cancels us
                    return
                up_w.write(data)
                await up_w.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            back.cancel()
            for w in (client_w, up_w):
                w.close()
            self._tasks.discard(asyncio.current_task())


class LatencyProxy(RedisProxy):
    """A TCP proxy that delays every byte by ``one_way_s`` in each direction, as a link between a
    client and a distant Redis does. Order is kept and throughput is not limited: each direction
    stamps what it reads and a second task writes it once its time has come.

    :meth:`cut` is a network partition: nothing passes either way for a while, then every open
    connection is dropped (new ones are accepted as before)."""

    def __init__(self, upstream_port: int, one_way_s: float = 0.0) -> None:
        super().__init__(upstream_port)
        self.one_way_s = one_way_s
        self._passing = asyncio.Event()
        self._passing.set()

    async def cut(self, hold_s: float) -> int:
        """Hold every byte for ``hold_s``, then drop the connections open then; returns how many."""
        self._passing.clear()
        try:
            await asyncio.sleep(hold_s)
            dropped = list(self._tasks)
            for task in dropped:
                task.cancel()
            return len(dropped)
        finally:
            self._passing.set()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        upstream = await self._open_upstream(client_w)
        if upstream is None:
            return
        up_r, up_w = upstream
        try:
            await asyncio.gather(self._delayed(client_r, up_w), self._delayed(up_r, client_w))
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            for w in (client_w, up_w):
                w.close()
            self._tasks.discard(asyncio.current_task())

    async def _delayed(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        in_flight: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await in_flight.get()
                if not data:
                    sink.close()
                    return
                await asyncio.sleep(max(0.0, due - loop.time()))
                await self._passing.wait()
                sink.write(data)
                await sink.drain()

        delivering = asyncio.create_task(deliver())
        try:
            while True:
                data = await source.read(65536)
                in_flight.put_nowait((loop.time() + self.one_way_s, data))
                if not data:
                    break
            await delivering
        finally:
            delivering.cancel()
