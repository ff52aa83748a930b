"""``slotq bench queue``: what the Redis path costs over calling the engine in-process.

The same closed-loop workload runs twice in one invocation: against an in-process engine, and
through Redis to a ``slotq worker`` subprocess with the same settings (the client reads the
job's stream). Reported: aggregate tokens/s and its ratio, time to first token p50/p95 of both
paths and the difference, and Redis round trips per generated token as the server counts them
(requests received from every client: the worker, the producers and the stream readers).

Added TTFT is also given in decode steps (a step at concurrency C lasts C / engine tokens/s), with
the engine's own wait of each path (``Timings.queue_ms``: submit to admission into a slot, as the
engine reports it). A request that reaches the engine mid-step waits for that step to end before
it joins the batch. In-process closed-loop clients resubmit within microseconds of their last
token, at a step boundary, so they hardly wait; through the queue the next job reaches the engine
after the client read its final entry, enqueued, and the worker claimed it, which is mid-step:
about half a step of the added TTFT is that wait, the rest is the queue's own path (enqueue, the
worker's wake-up and claim, the first stream write and the reader's wake-up).

Each concurrency starts with one unmeasured request per client on both paths, so the first wave
(every client arriving at once on an idle engine) does not weigh on the percentiles.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from bench.report import distinct_prompt, markdown_table, percentile, progress, write_results
from slotq.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, bundled_model_path
from slotq.jobs.cli.watch import ChildProcess, run_watched
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.schemas import EntryKind, JobRequest
from slotq.jobs.redis_server import EmbeddedRedis
from slotq.jobs.settings import ClientSettings

SLOTS = 8
CTX = 512
CONCURRENCY = [1, 4, 8]




@dataclass(frozen=True)
class Timed:
    """One request as a client saw it: seconds from its start to the first chunk (None if none
    came), completion tokens, and the engine's own wait, submit to admission (``Timings.queue_ms``
    of the engine's event or of the job's final stream entry; None if it reported none)."""

    first_s: float | None
    tokens: int
    queue_ms: float | None


OneRequest = Callable[[int, float], Awaitable[Timed]]      # (index, start) -> what the client saw


async def _closed_loop(one: OneRequest, clients: int, per_client: int, first: int = 0) -> tuple[float, list[Timed]]:
    """C clients each send ``per_client`` requests back to back (prompts ``first`` on): (tokens/s,
    every request as timed)."""
    timed: list[Timed] = []

    async def client(c: int) -> None:
        for r in range(per_client):
            timed.append(await one(first + c * per_client + r, time.perf_counter()))

    started = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    return sum(t.tokens for t in timed) / (time.perf_counter() - started), timed


def _engine_request(engine: Engine, max_tokens: int) -> OneRequest:
    async def one(i: int, started: float) -> Timed:
        first, tokens, queue_ms = None, 0, None
        request = GenerationRequest(prompt=distinct_prompt(i), max_tokens=max_tokens, ignore_eos=True,
                                    sampling=SamplingParams(temperature=0))
        async for event in engine.generate(request):
            if event.kind == "delta" and first is None:
                first = time.perf_counter() - started
            elif event.kind == "finished":
                tokens, queue_ms = event.usage.completion_tokens, event.timings.queue_ms
        return Timed(first, tokens, queue_ms)
    return one


async def timed_job(client: SlotqClient, request: JobRequest, started: float) -> Timed:
    """Enqueue ``request`` and read its stream to the end, timed from ``started``."""
    first, tokens, queue_ms = None, 0, None
    job = await client.enqueue(request)
    async for entry in job.stream():
        if entry.kind == EntryKind.CHUNK and first is None:
            first = time.perf_counter() - started
        elif entry.kind == EntryKind.DONE:
            tokens = entry.usage.completion_tokens if entry.usage else tokens
            queue_ms = entry.timings.queue_ms if entry.timings else queue_ms
    return Timed(first, tokens, queue_ms)


def _queue_request(client: SlotqClient, max_tokens: int) -> OneRequest:
    async def one(i: int, started: float) -> Timed:
        return await timed_job(client, JobRequest(prompt=distinct_prompt(i), max_tokens=max_tokens,
                                                  ignore_eos=True, sampling={"temperature": 0}), started)
    return one


async def _server_counters(redis: Redis) -> tuple[int, int]:
    """(commands, read events): commands include those run inside Lua scripts; a read event is one
    request arriving from a client, so pipelined or scripted batches count once (round trips)."""
    stats = await redis.info("stats")
    return int(stats["total_commands_processed"]), int(stats["total_reads_processed"])


async def run(quick: bool) -> tuple[dict[str, Any], str]:
    concurrency = [1, 4] if quick else CONCURRENCY
    per_client = 2 if quick else 8
    max_tokens = 16 if quick else 64
    model = bundled_model_path()
    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as tmp:
        server = EmbeddedRedis(Path(tmp) / "redis")
        url = server.start()
        env = {**os.environ, "SLOTQ_REDIS_URL": url, "SLOTQ_MODEL": str(model), "SLOTQ_SLOTS": str(SLOTS),
               "SLOTQ_CTX": str(CTX), "SLOTQ_PREFIX_CACHE": "false"}
        worker = ChildProcess("the benchmark's worker (slotq worker)",
                              [sys.executable, "-m", "slotq.jobs.cli", "worker"],
                              env=env, log_path=Path(tmp) / "worker.log")
        try:
            results, reads, commands, tokens = await run_watched(
                _measure(url, model, concurrency, per_client, max_tokens), worker)
        finally:
            worker.stop()
            server.stop()
    data = {"results": results, "redis_roundtrips_per_token": round(reads / tokens, 3),
            "redis_commands_per_token": round(commands / tokens, 3)}
    table = _table(results, concurrency, reads / tokens, commands / tokens)
    if not quick:
        write_results("queue", data, table, "slotq bench queue")
    return data, table


async def _measure(url: str, model: Path, concurrency: list[int], per_client: int,
                   max_tokens: int) -> tuple[list[dict[str, Any]], int, int, int]:
    """Both paths at each concurrency: (rows, Redis reads, Redis commands, generated tokens)."""
    client = await SlotqClient.connect(url, ClientSettings(redis_url=url))
    engine = await Engine.start(EngineConfig(model_path=model, slots=SLOTS, ctx=CTX, prefix_cache=False))
    try:
        progress("waiting for the worker to load the model")
        while not (await client.queue_info()).workers:
            await asyncio.sleep(0.2)
        results: list[dict[str, Any]] = []
        commands = reads = tokens = 0
        first = 0
        for c in concurrency:
            paths = {"engine": _engine_request(engine, max_tokens), "queue": _queue_request(client, max_tokens)}
            for path, one in paths.items():
                progress(f"{path} path at concurrency {c}")
                await _closed_loop(one, c, 1, first)                  # the first wave, not measured
                commands_before, reads_before = await _server_counters(client.redis)
                tps, timed = await _closed_loop(one, c, per_client, first + c)
                first += c * (per_client + 1)
                results.append(_row(path, c, tps, timed))
                if path == "queue":
                    commands_after, reads_after = await _server_counters(client.redis)
                    commands += commands_after - commands_before
                    reads += reads_after - reads_before
                    tokens += sum(t.tokens for t in timed)
        return results, reads, commands, tokens
    finally:
        await engine.close()
        await client.close()


def _row(path: str, c: int, tps: float, timed: list[Timed]) -> dict[str, Any]:
    ttfts = [t.first_s or 0.0 for t in timed]
    waits = [t.queue_ms for t in timed if t.queue_ms is not None]
    return {"path": path, "concurrency": c, "tokens_per_s": round(tps, 1),
            "ttft_p50_ms": round(percentile(ttfts, 50) * 1000, 1),
            "ttft_p95_ms": round(percentile(ttfts, 95) * 1000, 1),
            "engine_wait_p50_ms": round(percentile(waits, 50), 1) if waits else None}


def decode_step_ms(concurrency: int, engine_tokens_per_s: float) -> float:
    """One decode step of the in-process engine at this concurrency: each step gives every one of
    the ``concurrency`` busy slots one token (prefills aside), so a step lasts C / tokens-per-s."""
    return 1000 * concurrency / engine_tokens_per_s


def _table(results: list[dict[str, Any]], concurrency: list[int], reads_per_token: float,
           commands_per_token: float) -> str:
    by = {(r["path"], r["concurrency"]): r for r in results}
    rows = []
    for c in concurrency:
        e, q = by[("engine", c)], by[("queue", c)]
        step_ms = decode_step_ms(c, e["tokens_per_s"])
        added = q['ttft_p50_ms'] - e['ttft_p50_ms']
        rows.append([str(c), f"{e['tokens_per_s']:.1f}", f"{q['tokens_per_s']:.1f}",
                     f"{q['tokens_per_s'] / e['tokens_per_s']:.3f}",
                     f"{e['ttft_p50_ms']:.1f} / {e['ttft_p95_ms']:.1f}",
                     f"{q['ttft_p50_ms']:.1f} / {q['ttft_p95_ms']:.1f}",
                     f"{added:+.1f} / {q['ttft_p95_ms'] - e['ttft_p95_ms']:+.1f}", f"{step_ms:.1f}",
                     f"{added / step_ms:+.2f}",
                     f"{e['engine_wait_p50_ms']} / {q['engine_wait_p50_ms']}"])
    table = markdown_table(["concurrency", "engine tok/s", "queue tok/s", "queue / engine",
                            "engine TTFT p50/p95 ms", "queue TTFT p50/p95 ms", "added TTFT p50/p95 ms",
                            "decode step ms", "added TTFT p50 in steps",
                            "engine wait p50 ms: in-process / queue"], rows)
    return table + (f"\n\nRedis round trips per generated token (requests received by the server, all clients: "
                    f"worker, producers and stream readers): {reads_per_token:.2f}; commands per token, counting "
                    f"those inside Lua scripts: {commands_per_token:.2f}")
