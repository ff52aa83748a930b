"""Real processes for the gateway tests: a Valkey server, ``slotq worker`` processes on the tiny
model (each serving a model name on a queue), ``slotq gateway`` processes, and helpers that read
SSE the way a client on the wire sees it."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from slotq.jobs.redis_cluster import LocalValkeyCluster
from slotq.jobs.redis_server import EmbeddedRedis
from tests.support import free_port
from tests.support.jobs import SLOTQ_BIN, WorkerProcess, clean_env

LOCK_TTL_S = 3      # heartbeat every second: routing and slot counts follow the fleet quickly



class GatewayProcess:
    """``slotq gateway --port P`` as a child process."""

    def __init__(self, name: str, env: dict[str, str], cwd: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        metrics_port = env.get("SLOTQ_GATEWAY_METRICS_PORT")
        self.private_url = f"http://127.0.0.1:{metrics_port}" if metrics_port else None
        admin = next((entry for entry in env.get("SLOTQ_ADMIN_KEYS", "").split(",") if entry), None)
        # the first admin key, for the fleet view (/health's models, /metrics' tenants); none without one
        self.admin = {"Authorization": f"Bearer {admin.partition('=')[2] or admin}"} if admin else {}
        self.log = cwd / f"{name}.log"
        self._log_file = open(self.log, "wb")  # noqa: SIM115  (the child writes it until stop() closes it)
        self.proc = subprocess.Popen([str(SLOTQ_BIN), "gateway", "--port", str(self.port), *args], env=env, cwd=cwd,
                                     stdout=self._log_file, stderr=subprocess.STDOUT)

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"gateway not ready within {timeout} s:\n{self.log_tail()}")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log_file.close()
        return self.proc.returncode


@dataclass
class Stack:
    """One Redis (or one Valkey Cluster), workers by served model name, and gateways, all real processes."""

    redis: EmbeddedRedis | LocalValkeyCluster
    cwd: Path
    model_path: Path
    workers: dict[str, WorkerProcess] = field(default_factory=dict)
    gateways: list[GatewayProcess] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.gateways[0].url

    def env(self, **slotq: Any) -> dict[str, str]:
        return clean_env(redis_url=self.redis.url, lock_ttl_s=LOCK_TTL_S, **slotq)

    def start_worker(self, name: str, model_name: str, queue: str = "slotq:queue", **settings: Any) -> WorkerProcess:
        base: dict[str, Any] = {"model": self.model_path, "model_name": model_name, "queue_name": queue, "slots": 4,
                                "ctx": 512, "threads": 1}
        worker = WorkerProcess(name, self.env(**(base | settings)), self.cwd)
        self.workers[name] = worker
        return worker

    def start_gateway(self, name: str, *args: str, **settings: Any) -> GatewayProcess:
        gateway = GatewayProcess(name, self.env(**settings), self.cwd, *args)
        self.gateways.append(gateway)
        return gateway

    def wait_for_models(self, models: set[str], url: str | None = None, timeout: float = 90) -> None:
        """Until the gateway's /health lists every model (i.e. their workers' heartbeats are seen):
        the fleet view, so a gateway with keys needs an admin key (GatewayProcess.admin)."""
        gateway = next(g for g in self.gateways if g.url == (url or self.url))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for worker in self.workers.values():
                if worker.proc.poll() is not None:
                    raise RuntimeError(f"worker {worker.name} exited with {worker.proc.returncode}:\n"
                                       f"{worker.log_tail()}")
            seen = set(httpx.get(f"{gateway.url}/health", headers=gateway.admin, timeout=5).json()["models"])
            if models <= seen:
                return
            time.sleep(0.1)
        raise TimeoutError(f"models {models} not served within {timeout} s")

    def stop(self) -> None:
        for gateway in self.gateways:
            gateway.stop()
        for worker in self.workers.values():
            worker.stop()
        self.redis.stop()

    @classmethod
    @contextlib.contextmanager
    def started(cls, cwd: Path, model_path: Path, *, cluster: bool = False) -> Iterator[Stack]:
        """A stack on a Valkey of its own in ``cwd`` (a 3-primary Valkey Cluster with ``cluster``); every
        process it started is stopped on exit."""
        redis: EmbeddedRedis | LocalValkeyCluster = (LocalValkeyCluster(cwd / "cluster", primaries=3) if cluster
                                                     else EmbeddedRedis(cwd / "redis", port=0, fsync="no"))
        redis.start()
        stack = cls(redis, cwd, model_path)
        try:
            yield stack
        finally:
            stack.stop()


@dataclass
class Event:
    """One SSE event as it came over the wire."""

    id: str | None
    data: str
    event: str | None = None

    def json(self) -> Any:
        return json.loads(self.data)


def sse_events(lines: Iterator[str]) -> Iterator[Event | str]:
    """Parse SSE lines into events; comments come out as plain strings (``": keep-alive"``)."""
    fields: dict[str, list[str]] = {}
    for line in lines:
        if line == "":
            if fields:
                yield Event(id=(fields.get("id") or [None])[0], data="\n".join(fields.get("data", [])),
                            event=(fields.get("event") or [None])[0])
            fields = {}
        elif line.startswith(":"):
            yield line
        else:
            name, _, value = line.partition(":")
            fields.setdefault(name, []).append(value.removeprefix(" "))


def chunk_text(events: list[Event]) -> str:
    """The content of an OpenAI chat or completion stream, choice 0."""
    out = []
    for e in events:
        if e.data == "[DONE]":
            continue
        for choice in e.json().get("choices", []):
            if choice["index"] == 0:
                out.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(out)
