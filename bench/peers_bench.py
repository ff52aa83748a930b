"""``slotq bench peers``: slotq beside llama.cpp's own servers, one workload, side by side in one run.

Systems (each serves with as many slots as there are concurrent clients, ``C``):

- ``slotq-redis``: a ``slotq worker`` (continuous batching); the Python client enqueues and reads
  the job's stream from Redis;
- ``slotq-gateway``: the same worker behind ``slotq gateway`` (OpenAI's ``/v1/completions``, SSE);
- ``llama-server``: llama.cpp's C++ server, ``--parallel C``, built from the llama.cpp that
  llama-cpp-python vendors (:mod:`bench.llama_server`; skipped with the reason if it cannot be built);
- ``llama-cpp-python-server``: llama-cpp-python's bundled server (one request at a time: it
  has no parallel slots);
- ``slotq-static``: a worker in static-batching mode, through Redis;
- ``raw``: the bare ``llama_decode`` loop over C sequences, no sampling, no scheduling: the ceiling.

Workload: C closed-loop clients, each sending its requests back to back; prompts of three lengths
(about 30, 100 and 300 tokens) that share no prefix and are never sent twice, greedy,
``max_tokens`` generated exactly (``ignore_eos``); every system runs with its own defaults (prompt
caches on), which unique prompts leave nothing to reuse. Every HTTP system gets the same client
code. Each system runs in its own processes and is measured in every round, in a rotated order (the
machine is shared and noisy); tokens/s is the mean of the rounds, TTFT and latency percentiles pool
every request. Peak RSS is each system's processes' high-water mark (Redis, shared by the slotq
systems, not counted).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import llama_server
from bench.engine_bench import raw_ceiling, raw_process
from bench.isolated import IsolatedProcess
from bench.peers_report import plot, table
from bench.queue_bench import timed_job
from bench.report import TOPICS, percentile, progress, write_results
from slotq.engine import EngineConfig, bundled_model_path
from slotq.engine.config import CpuRepack
from slotq.engine.cpu_features import decide_repack, this_cpu_flags
from slotq.jobs.cli.watch import ChildProcess, run_watched
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.schemas import JobRequest
from slotq.jobs.redis_server import EmbeddedRedis, free_port
from slotq.jobs.settings import ClientSettings

CONCURRENCY = [1, 4, 8, 16]
MAX_TOKENS = 64
CTX = 1024              # per slot: the longest prompt and its output fit
ROUNDS = 2
THREADS = len(os.sched_getaffinity(0)) or 1     # every system decodes on the same cores
SYSTEMS = ["slotq-redis", "slotq-gateway", "llama-server", "llama-cpp-python-server", "slotq-static", "raw"]
GATEWAY_MODEL = "peers"


# What ``python -m llama_cpp.server`` imports beyond slotq's own dependencies (its ``server`` extra,
# which slotq's ``bench`` extra lists without rebuilding llama-cpp-python).
LLAMA_CPP_SERVER_MODULES = ["sse_starlette", "starlette_context"]


def _missing_modules(names: list[str]) -> list[str]:
    return [name for name in names if importlib.util.find_spec(name) is None]


def peer_prompt(i: int) -> str:
    """Prompt ``i``: short, medium or long in turn, no shared prefix beyond the first word."""
    topic = TOPICS[i % len(TOPICS)]
    context = " ".join(f"Note {k} on {topic} #{i}: people study {topic} for their history, their use and their "
                       f"beauty, and each place tells it differently." for k in range((0, 3, 12)[i % 3]))
    return f"{topic.capitalize()} #{i}. {context} Write a short paragraph about {topic}."


@dataclass
class Sample:
    ttft_s: float
    latency_s: float
    tokens: int


OneRequest = Callable[[int], Awaitable[Sample]]


@dataclass
class Measured:
    """One system at one concurrency, over the rounds."""
    rates: list[float] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    peak_rss_mb: float = 0.0


async def closed_loop(one: OneRequest, clients: int, per_client: int, first: int) -> tuple[float, list[Sample]]:
    """Prompts ``first``, ``first + 1``, ...: every system gets the same ones in a round, and no prompt
    is ever sent twice (llama-server keeps finished prompts in a RAM cache and would skip their prefill)."""
    samples: list[Sample] = []

    async def client(c: int) -> None:
        for r in range(per_client):
            samples.append(await one(first + c * per_client + r))

    started = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    return sum(s.tokens for s in samples) / (time.perf_counter() - started), samples


def gateway_process(tmp: Path, redis_url: str) -> tuple[ChildProcess, int]:
    """A ``slotq gateway`` on a free port in front of ``redis_url`` (not started yet), and its port."""
    port = free_port()
    return ChildProcess("slotq gateway", [sys.executable, "-m", "slotq.jobs.cli", "gateway", "--port", str(port)],
                        env={**os.environ, "SLOTQ_REDIS_URL": redis_url, "SLOTQ_LOG_LEVEL": "WARNING"},
                        log_path=tmp / "gateway.log"), port


def http_completion(http: httpx.AsyncClient, model: str, extra: dict[str, Any] | None = None) -> OneRequest:
    """``POST /v1/completions`` of :func:`peer_prompt` ``i``, ``MAX_TOKENS`` generated."""
    body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **(extra or {})}
    return http_stream(http, "/v1/completions", body, lambda i: {"prompt": peer_prompt(i)})


def http_stream(http: httpx.AsyncClient, path: str, body: dict[str, Any],
                prompt: Callable[[int], dict[str, Any]]) -> OneRequest:
    """``POST path`` (``/v1/completions`` or ``/v1/chat/completions``) of ``body`` and ``prompt(i)`` with
    ``stream: true``; the first chunk with text (``text`` or ``delta.content``) is the first token."""
    body = body | {"stream": True, "stream_options": {"include_usage": True}}

    async def one(i: int) -> Sample:
        started = time.perf_counter()
        first, chunks, usage = None, 0, 0
        async with http.stream("POST", path, json=body | prompt(i)) as response:
            if response.status_code != 200:
                raise RuntimeError(f"{http.base_url}: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                choice = chunk["choices"][0] if chunk.get("choices") else {}
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    first = first if first is not None else time.perf_counter() - started
                usage = (chunk.get("usage") or {}).get("completion_tokens", usage)
        return Sample(first if first is not None else float("nan"), time.perf_counter() - started, usage or chunks)
    return one


def slotq_completion(client: SlotqClient) -> OneRequest:
    async def one(i: int) -> Sample:
        started = time.perf_counter()
        timed = await timed_job(client, JobRequest(prompt=peer_prompt(i), max_tokens=MAX_TOKENS,
                                                   ignore_eos=True, sampling={"temperature": 0}), started)
        first = timed.first_s if timed.first_s is not None else float("nan")
        return Sample(first, time.perf_counter() - started, timed.tokens)
    return one


def process_peak_rss_mb(pid: int) -> float:
    """The process's resident-set high-water mark (VmHWM), 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class Fleet:
    """Every system's processes at one concurrency (``slots``), started together, stopped together."""

    def __init__(self, tmp: Path, redis_url: str, model: Path, slots: int, server_binary: Path | None,
                 gateway_port: int, repack: bool, skipped: dict[str, str]) -> None:
        self.tmp, self.redis_url, self.model, self.slots = tmp, redis_url, model, slots
        self.gateway_port = gateway_port
        self.children: dict[str, list[ChildProcess]] = {}
        self.ports: dict[str, int] = {}
        base = {**os.environ, "SLOTQ_REDIS_URL": redis_url, "SLOTQ_MODEL": str(model), "SLOTQ_SLOTS": str(slots),
                "SLOTQ_CTX": str(CTX), "SLOTQ_THREADS": str(THREADS),
                "SLOTQ_CPU_REPACK": "on" if repack else "off", "SLOTQ_LOG_LEVEL": "WARNING",
                "SLOTQ_ELASTIC": "false"}     # fixed slots, as llama-server's --parallel
        worker = self._child("slotq-redis", "slotq worker", [sys.executable, "-m", "slotq.jobs.cli", "worker"],
                             env=base | {"SLOTQ_QUEUE_NAME": "peers", "SLOTQ_MODEL_NAME": GATEWAY_MODEL})
        self.children["slotq-gateway"] = [worker]      # + the gateway, which outlives one concurrency
        self._child("slotq-static", "slotq worker (static)", [sys.executable, "-m", "slotq.jobs.cli", "worker"],
                    env=base | {"SLOTQ_QUEUE_NAME": "peers-static", "SLOTQ_MODEL_NAME": "peers-static",
                                "SLOTQ_BATCHING": "static"})
        if server_binary is not None:
            port = self.ports["llama-server"] = free_port()
            self._child("llama-server", "llama-server", [
                str(server_binary), "-m", str(model), "--parallel", str(slots), "-c", str(CTX * slots),
                "-t", str(THREADS), "--host", "127.0.0.1", "--port", str(port), *([] if repack else ["--no-repack"])])
        if "llama-cpp-python-server" not in skipped:
            port = self.ports["llama-cpp-python-server"] = free_port()
            self._child("llama-cpp-python-server", "llama-cpp-python server", [
                sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--n_ctx", str(CTX),
                "--n_threads", str(THREADS), "--host", "127.0.0.1", "--port", str(port),
                "--interrupt_requests", "false"])   # else a new request cuts off the one streaming

    def _child(self, system: str, name: str, argv: list[str], env: dict[str, str] | None = None) -> ChildProcess:
        child = ChildProcess(f"{name} at {self.slots} slots", argv, env=env,
                             log_path=self.tmp / f"{system}-{self.slots}.log")
        self.children.setdefault(system, []).append(child)
        return child

    def all(self) -> list[ChildProcess]:
        return list({id(c): c for group in self.children.values() for c in group}.values())

    def peak_rss_mb(self, system: str, extra_pids: list[int]) -> float:
        return sum(process_peak_rss_mb(c.proc.pid) for c in self.children.get(system, [])) + \
            sum(process_peak_rss_mb(pid) for pid in extra_pids)

    def stop(self) -> None:
        for child in self.all():
            child.stop()


async def _wait_http(http: httpx.AsyncClient, path: str, ok: Callable[[httpx.Response], bool]) -> None:
    while True:
        try:
            if ok(await http.get(path)):
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.3)


async def run(quick: bool) -> tuple[dict[str, Any], str]:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    concurrency = [1, 4] if quick else CONCURRENCY
    rounds = 1 if quick else ROUNDS
    model = bundled_model_path()
    decision = decide_repack(CpuRepack.AUTO, this_cpu_flags())
    progress(decision.describe() + " (the same for every system)")
    skipped: dict[str, str] = {}
    try:
        server_binary: Path | None = llama_server.find_or_build()
    except llama_server.Unavailable as exc:
        server_binary = None
        skipped["llama-server"] = str(exc)
    if not decision.repack:
        skipped["llama-cpp-python-server"] = "its model loader cannot switch weight repacking off, which crashes here"
    elif missing := _missing_modules(LLAMA_CPP_SERVER_MODULES):
        skipped["llama-cpp-python-server"] = (f"its server needs {', '.join(missing)}, not installed: "
                                              "pip install -e '.[bench]' (make bench does)")
    for system, reason in skipped.items():
        progress(f"skipping {system}: {reason}")
    measured: dict[tuple[str, int], Measured] = {}
    with tempfile.TemporaryDirectory(prefix="slotq-bench-peers-") as tmp:
        redis = EmbeddedRedis(Path(tmp) / "redis")
        url = redis.start()
        gateway, gateway_port = gateway_process(Path(tmp), url)
        raw = raw_process(EngineConfig(model_path=model, slots=max(concurrency), ctx=CTX, prefix_cache=False,
                                       threads=THREADS, cpu_repack=CpuRepack.ON if decision.repack else CpuRepack.OFF))
        try:
            for c in concurrency:
                fleet = Fleet(Path(tmp), url, model, c, server_binary, gateway_port, decision.repack, skipped)
                try:
                    await run_watched(_at_concurrency(fleet, url, c, rounds, quick, raw, measured),
                                      *fleet.all(), gateway)
                    for system in SYSTEMS:
                        if (system, c) in measured:
                            extra = [gateway.proc.pid] if system == "slotq-gateway" else []
                            measured[(system, c)].peak_rss_mb = fleet.peak_rss_mb(system, extra)
                finally:
                    fleet.stop()
            measured_raw_rss = await asyncio.to_thread(raw.call, _own_peak_rss_mb)
        finally:
            raw.close()
            gateway.stop()
            redis.stop()
    for (system, _), m in measured.items():
        if system == "raw":
            m.peak_rss_mb = measured_raw_rss
    results = [_row(system, c, measured[(system, c)]) for c in concurrency for system in SYSTEMS
               if (system, c) in measured]
    data = {"model": model.name, "max_tokens": MAX_TOKENS, "threads": THREADS, "repack": decision.repack,
            "results": results, "skipped": skipped}
    text = table(results, concurrency, skipped)
    if not quick:
        write_results("peers", data, text, "slotq bench peers")
        plot(results, Path(__file__).parent / "results" / "peers.png")
    return data, text


def _own_peak_rss_mb() -> float:
    return process_peak_rss_mb(os.getpid())


async def _at_concurrency(fleet: Fleet, url: str, c: int, rounds: int, quick: bool, raw: IsolatedProcess,
                          measured: dict[tuple[str, int], Measured]) -> None:
    per_client = max(2, 8 // c) if not quick else 1
    # A new connection per request, for every HTTP system alike (a local connect costs well under a
    # millisecond): llama-server's HTTP library closes a kept-alive connection after a few requests,
    # and a request sent on it just then gets "Server disconnected without sending a response".
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    clients = [await SlotqClient.connect(url, ClientSettings(redis_url=url, queue_name=q))
               for q in ("peers", "peers-static")]
    https = {system: httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits)
             for system, port in [("slotq-gateway", fleet.gateway_port), *fleet.ports.items()]}
    try:
        progress(f"concurrency {c}: starting every system with {c} slots")
        paths: dict[str, OneRequest] = {"slotq-redis": slotq_completion(clients[0]),
                                        "slotq-static": slotq_completion(clients[1])}
        await _wait_http(https["slotq-gateway"], "/health",
                         lambda r: r.status_code == 200 and GATEWAY_MODEL in r.json().get("models", {}))
        paths["slotq-gateway"] = http_completion(https["slotq-gateway"], GATEWAY_MODEL)
        while not (await clients[1].queue_info()).workers:
            await asyncio.sleep(0.3)
        if "llama-server" in https:
            await _wait_http(https["llama-server"], "/health", lambda r: r.status_code == 200)
            paths["llama-server"] = http_completion(https["llama-server"], "model")
        if "llama-cpp-python-server" in https:
            await _wait_http(https["llama-cpp-python-server"], "/v1/models", lambda r: r.status_code == 200)
            # it has no ignore_eos: the end-of-text token's logit is pushed down instead
            paths["llama-cpp-python-server"] = http_completion(https["llama-cpp-python-server"], "model",
                                                               {"logit_bias": {str(_eos_id(fleet.model)): -100}})
        for n, one in enumerate(paths.values()):           # warm-up: one request each, not measured
            await one(900_000 + c * 100 + n)
        systems = [s for s in SYSTEMS if s in paths or s == "raw"]
        for r in range(rounds):
            for system in systems[r % len(systems):] + systems[:r % len(systems)]:
                progress(f"concurrency {c}, round {r + 1}/{rounds}: {system}")
                m = measured.setdefault((system, c), Measured())
                if system == "raw":
                    m.rates.append(await asyncio.to_thread(raw.call, raw_ceiling, c, MAX_TOKENS if not quick else 16))
                    continue
                rate, samples = await closed_loop(paths[system], c, per_client, first=(c * ROUNDS + r) * 1000)
                m.rates.append(rate)
                m.samples.extend(samples)
    finally:
        for http in https.values():
            await http.aclose()
        for client in clients:
            await client.close()


def _eos_id(model: Path) -> int:
    from gguf import GGUFReader

    eos = GGUFReader(model).fields["tokenizer.ggml.eos_token_id"]
    return int(eos.parts[eos.data[0]][0])


def _row(system: str, c: int, m: Measured) -> dict[str, Any]:
    ms = lambda values, q: round(percentile(values, q) * 1000, 1) if values else None   # noqa: E731
    ttfts = [s.ttft_s for s in m.samples]
    latencies = [s.latency_s for s in m.samples]
    return {"system": system, "concurrency": c, "tokens_per_s": round(sum(m.rates) / len(m.rates), 1),
            "ttft_p50_ms": ms(ttfts, 50), "ttft_p95_ms": ms(ttfts, 95),
            "latency_p50_ms": ms(latencies, 50), "latency_p95_ms": ms(latencies, 95),
            "tokens_per_request": round(sum(s.tokens for s in m.samples) / len(m.samples), 1) if m.samples else None,
            "peak_rss_mb": round(m.peak_rss_mb, 1)}
