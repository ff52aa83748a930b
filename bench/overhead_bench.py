"""``slotq bench overhead``: many concurrent streams on a model whose decode costs little, so what
is measured is everything around the matrix multiplications: the KV layout's attention span, the
scheduler, sampling, the queue.

Model: the test suite's tiny random llama (``tests/support/tiny_model.py``: 2 layers, 128 wide), written
to a temporary file. Workload: S streams started together, each one request of a distinct short
prompt generating ``TOKENS`` tokens exactly (greedy, ignore_eos); every system has S slots of
``CTX`` tokens. tokens/s = all generated tokens / wall time from the first request to the last
token, the mean of two rounds run in a rotated order. Systems, side by side in one run, each in processes of its own:

- ``slotq-inprocess``: the engine called in-process, its defaults (``kv_layout=auto``, which
  splits here; prefix cache on);
- ``slotq-inprocess-unified``: the same with ``kv_layout=unified`` (the layout before wave 3);
- ``slotq-redis``: a ``slotq worker`` with its defaults; the client enqueues through Redis and
  reads each job's stream;
- ``slotq-redis-engine-process``: the same with ``SLOTQ_ENGINE_PROCESS=true`` (the engine in a process
  of its own, on a queue of its own); the table gives it over ``slotq-redis`` too, the figure that
  decides that setting's default;
- ``llama-server``: llama.cpp's server, ``--parallel S -c S*CTX`` (a KV stream per slot, its
  default with an explicit ``--parallel``), built from the llama.cpp that llama-cpp-python vendors,
  streaming (SSE) as slotq streams through Redis;
- ``llama-server-kvu``: the same with ``-kvu`` (one unified KV buffer).

A system that cannot start is skipped with one line saying why.
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
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx

from bench import llama_server
from bench.isolated import IsolatedProcess
from bench.peers_bench import _wait_http
from bench.queue_bench import timed_job
from bench.report import distinct_prompt, markdown_table, progress, write_results
from slotq.engine import Engine, EngineConfig, GenerationRequest, KVLayout, SamplingParams
from slotq.jobs.cli.watch import ChildProcess, run_watched
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.schemas import JobRequest
from slotq.jobs.redis_server import EmbeddedRedis, free_port
from slotq.jobs.settings import ClientSettings

STREAMS = [64, 256]
TOKENS = 256
CTX = 1024
THREADS = len(os.sched_getaffinity(0)) or 1
ROUNDS = 2          # each system measured in every round, in a rotated order; tokens/s = the mean
SYSTEMS = ["slotq-inprocess", "slotq-inprocess-unified", "slotq-redis", "slotq-redis-engine-process", "llama-server",
           "llama-server-kvu"]
WORKERS = {"slotq-redis": {}, "slotq-redis-engine-process": {"SLOTQ_ENGINE_PROCESS": "true"}}
"""The ``slotq worker`` systems: what each sets beside the common environment (each on a queue of its own)."""

OneStream = Callable[[int], Awaitable[int]]      # stream index -> generated tokens


def write_tiny_model(path: Path) -> Path:
    """The suite's tiny model (tests/support/tiny_model.py in this checkout)."""
    return Path(_tiny_model_module().write_tiny_llama(path))


def write_draft_model(path: Path) -> Path:
    """A random-weight draft model with the bundled model's vocabulary (SLOTQ_DRAFT_MODEL): it drafts for the
    bundled model, though few of its drafts are accepted."""
    return Path(_tiny_model_module().write_draft_model(path))


def _tiny_model_module() -> ModuleType:
    """tests/support/tiny_model.py, loaded by file path: tests/ is not an installed package."""
    source = Path(__file__).resolve().parent.parent / "tests" / "support" / "tiny_model.py"
    if not source.exists():
        raise FileNotFoundError(f"{source} is missing: slotq bench runs from a slotq checkout")
    spec = importlib.util.spec_from_file_location("slotq_tiny_model", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def all_streams(one: OneStream, streams: int) -> float:
    started = time.perf_counter()
    generated = await asyncio.gather(*(one(i) for i in range(streams)))
    return sum(generated) / (time.perf_counter() - started)


# ----------------------------------------------------------------------------- in-process engine
_loop: asyncio.AbstractEventLoop | None = None
_engine: Engine | None = None


def _start_engine(config: EngineConfig) -> None:
    global _loop, _engine
    _loop = asyncio.new_event_loop()
    _engine = _loop.run_until_complete(Engine.start(config))


def _engine_streams(streams: int, tokens: int, first: int) -> float:
    assert _loop is not None and _engine is not None
    engine = _engine

    async def one(i: int) -> int:
        request = GenerationRequest(prompt=distinct_prompt(first + i), max_tokens=tokens, ignore_eos=True,
                                    sampling=SamplingParams(temperature=0))
        async for event in engine.generate(request):
            if event.kind == "finished":
                return event.usage.completion_tokens
        return 0

    return _loop.run_until_complete(all_streams(one, streams))


# ----------------------------------------------------------------------------- HTTP and Redis paths
def _http_stream(http: httpx.AsyncClient, tokens: int, first: int) -> OneStream:
    """``POST /v1/completions`` with ``stream: true``: tokens are delivered as they are generated,
    as slotq delivers them through Redis."""
    async def one(i: int) -> int:
        body = {"prompt": distinct_prompt(first + i), "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        chunks, usage = 0, 0
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"{http.base_url}: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    chunks += bool(chunk.get("choices") and chunk["choices"][0].get("text"))
                    usage = (chunk.get("usage") or {}).get("completion_tokens", usage)
        return usage or chunks
    return one


def _redis_stream(client: SlotqClient, tokens: int, first: int) -> OneStream:
    async def one(i: int) -> int:
        request = JobRequest(prompt=distinct_prompt(first + i), max_tokens=tokens, ignore_eos=True,
                             sampling={"temperature": 0})
        return (await timed_job(client, request, time.perf_counter())).tokens
    return one


# ----------------------------------------------------------------------------- the run
async def run(quick: bool) -> tuple[dict[str, Any], str]:
    logging.getLogger("httpx").setLevel(logging.WARNING)      # one INFO line per request otherwise
    streams_list = [16, 64] if quick else STREAMS
    tokens = 32 if quick else TOKENS
    skipped: dict[str, str] = {}
    try:
        server_binary: Path | None = llama_server.find_or_build()
    except llama_server.Unavailable as exc:
        server_binary = None
        for system in ("llama-server", "llama-server-kvu"):
            skipped[system] = str(exc)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="slotq-bench-overhead-") as tmp_name:
        tmp = Path(tmp_name)
        model = write_tiny_model(tmp / "tiny.gguf")
        redis = EmbeddedRedis(tmp / "redis")
        url = redis.start()
        try:
            for streams in streams_list:
                results += await _at(streams, tokens, tmp, model, url, server_binary, skipped)
        finally:
            redis.stop()
    for system, reason in skipped.items():
        progress(f"skipped {system}: {reason}")
    data = {"model": "tests/support/tiny_model.py", "tokens_per_stream": tokens, "ctx_per_slot": CTX,
            "threads": THREADS, "results": results, "skipped": skipped}
    text = _table(results, streams_list, skipped)
    if not quick:
        write_results("overhead", data, text, "slotq bench overhead")
    return data, text


async def _at(streams: int, tokens: int, tmp: Path, model: Path, url: str, server_binary: Path | None,
              skipped: dict[str, str]) -> list[dict[str, Any]]:
    """Every system at ``streams`` slots: started, warmed up with one request, measured once."""
    rows: list[dict[str, Any]] = []
    base = dict(model_path=model, slots=streams, ctx=CTX, threads=THREADS)
    first = streams * 10_000            # no prompt is sent twice (llama-server keeps a prompt cache)
    processes = {system: IsolatedProcess(_start_engine, EngineConfig(kv_layout=layout, **base))
                 for system, layout in (("slotq-inprocess", KVLayout.AUTO),
                                        ("slotq-inprocess-unified", KVLayout.UNIFIED))}
    try:
        rates: dict[str, list[float]] = {system: [] for system in processes}
        for process in processes.values():
            process.call(_engine_streams, 1, 4, first - 1)
        for r in range(ROUNDS):
            for system in _rotated(list(processes), r):
                progress(f"{streams} streams, round {r + 1}/{ROUNDS}: {system}")
                rates[system].append(processes[system].call(_engine_streams, streams, tokens, first + r * streams))
        rows += [_row(system, streams, values) for system, values in rates.items()]
    finally:
        for process in processes.values():
            process.close()
    children: dict[str, ChildProcess] = {}
    env = {**os.environ, "SLOTQ_REDIS_URL": url, "SLOTQ_MODEL": str(model), "SLOTQ_SLOTS": str(streams),
           "SLOTQ_CTX": str(CTX), "SLOTQ_THREADS": str(THREADS), "SLOTQ_LOG_LEVEL": "WARNING", "SLOTQ_ELASTIC": "false"}
    for system, extra in WORKERS.items():
        children[system] = ChildProcess(f"{system} at {streams} slots",
                                        [sys.executable, "-m", "slotq.jobs.cli", "worker"],
                                        env={**env, **extra, "SLOTQ_QUEUE_NAME": _queue(system, streams)},
                                        log_path=tmp / f"{system}-{streams}.log")
    ports: dict[str, int] = {}
    if server_binary is not None:
        for system, extra in (("llama-server", []), ("llama-server-kvu", ["-kvu"])):
            port = ports[system] = free_port()
            children[system] = ChildProcess(f"{system} at {streams} slots", [
                str(server_binary), "-m", str(model), "--parallel", str(streams), "-c", str(CTX * streams),
                "-t", str(THREADS), "--host", "127.0.0.1", "--port", str(port),
                *extra], log_path=tmp / f"{system}-{streams}.log")
    try:
        rows += await run_watched(_measure_children(streams, tokens, first, url, ports), *children.values())
    finally:
        for child in children.values():
            child.stop()
    return rows


async def _measure_children(streams: int, tokens: int, first: int, url: str,
                            ports: dict[str, int]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    clients = {system: await SlotqClient.connect(url, ClientSettings(redis_url=url, queue_name=_queue(system, streams)))
               for system in WORKERS}
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=0)
    https = {system: httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=1800, limits=limits)
             for system, port in ports.items()}
    try:
        paths: dict[str, Callable[[int], OneStream]] = {}
        for system, client in clients.items():
            paths[system] = lambda f, client=client: _redis_stream(client, tokens, f)   # type: ignore[misc]
            while not (await client.queue_info()).workers:
                await asyncio.sleep(0.2)
        for system, http in https.items():
            await _wait_http(http, "/health", lambda r: r.status_code == 200)
            paths[system] = lambda f, http=http: _http_stream(http, tokens, f)   # type: ignore[misc]
        rates: dict[str, list[float]] = {system: [] for system in paths}
        for make in paths.values():
            await make(first - 2)(0)                                     # warm-up, not measured
        for r in range(ROUNDS):
            for system in _rotated(list(paths), r):
                progress(f"{streams} streams, round {r + 1}/{ROUNDS}: {system}")
                rates[system].append(await all_streams(paths[system](first + r * streams), streams))
        rows += [_row(system, streams, values) for system, values in rates.items()]
    finally:
        for http in https.values():
            await http.aclose()
        for client in clients.values():
            await client.close()
    return rows


def _queue(system: str, streams: int) -> str:
    return f"overhead-{streams}" + ("-process" if system == "slotq-redis-engine-process" else "")


def _rotated(systems: list[str], r: int) -> list[str]:
    """Round r starts at another system, so drift on a shared machine hits every one alike."""
    return systems[r % len(systems):] + systems[:r % len(systems)]


def _row(system: str, streams: int, rates: list[float]) -> dict[str, Any]:
    """tokens/s is the mean of the rounds; the rounds themselves are kept."""
    return {"system": system, "streams": streams, "tokens_per_s": round(sum(rates) / len(rates), 1),
            "rounds": [round(rate, 1) for rate in rates]}


def _table(results: list[dict[str, Any]], streams_list: list[int], skipped: dict[str, str]) -> str:
    """tok/s per system and stream count, and each figure over llama-server's best mode there."""
    tps = {(r["system"], r["streams"]): r["tokens_per_s"] for r in results}
    best = {s: max((tps.get((p, s), 0.0) for p in ("llama-server", "llama-server-kvu")), default=0.0)
            for s in streams_list}
    rows = []
    for system in SYSTEMS:
        if system in skipped:
            continue
        cells = [system]
        for s in streams_list:
            value = tps.get((system, s))
            ratio = f" ({value / best[s]:.2f} x)" if value and best[s] else ""
            cells.append(f"{value:,.0f}{ratio}" if value is not None else "-")
        rows.append(cells)
    table = markdown_table(["system", *(f"{s} streams tok/s (/ llama-server's best)" for s in streams_list)], rows)
    on_off = [f"{tps[('slotq-redis-engine-process', s)] / tps[('slotq-redis', s)]:.2f}x at {s} streams"
              for s in streams_list if tps.get(("slotq-redis", s)) and tps.get(("slotq-redis-engine-process", s))]
    notes = f"\n\nengine process / engine thread (SLOTQ_ENGINE_PROCESS on / off): {', '.join(on_off)}" if on_off else ""
    notes += "".join(f"\n\nskipped {system}: {reason}" for system, reason in skipped.items())
    return table + notes
