"""``slotq bench queue``: what the Redis path costs over calling the engine in-process.

The same closed-loop workload runs twice in one invocation: against an in-process engine, and
through Redis to a ``slotq worker`` subprocess with the same settings (the client reads the
job's stream). Reported: aggregate tokens/s and its ratio, time to first token p50/p95 of both
paths and the difference, and Redis round trips per generated token as the server counts them
(requests received from every client: the worker, the producers and the stream readers).

Added TTFT is also given in decode steps (a step at concurrency C lasts C / engine tokens/s). A
request that arrives mid-step waits for that step to end before it joins the batch -- half a step
on average -- on both paths alike, so that wait is inside both TTFTs and not in their difference:
the added TTFT is the queue's own cost (enqueue, the worker's wake-up and claim, the first stream
write and the reader's wake-up), and a difference below one step means a queued job usually joins
the same step the in-process request would have.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from bench.report import distinct_prompt, markdown_table, percentile, progress, write_results
from slotq.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, bundled_model_path
from slotq.jobs.cli.redis_server import EmbeddedRedis
from slotq.jobs.cli.watch import ChildProcess, run_watched
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.schemas import EntryKind, JobRequest
from slotq.jobs.settings import ClientSettings

SLOTS = 8
CTX = 512
CONCURRENCY = [1, 4, 8]


OneRequest = Callable[[int, float], Awaitable[tuple[float, int]]]   # (index, start) -> (ttft s, tokens)


async def _closed_loop(one: OneRequest, clients: int, per_client: int) -> tuple[float, list[float]]:
    """C clients each send ``per_client`` requests back to back: (tokens/s, TTFTs)."""
    ttfts: list[float] = []
    generated = 0

    async def client(c: int) -> None:
        nonlocal generated
        for r in range(per_client):
            ttft, tokens = await one(c * per_client + r, time.perf_counter())
            ttfts.append(ttft)
            generated += tokens

    started = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    return generated / (time.perf_counter() - started), ttfts


def _engine_request(engine: Engine, max_tokens: int) -> OneRequest:
    async def one(i: int, started: float) -> tuple[float, int]:
        first, tokens = None, 0
        request = GenerationRequest(prompt=distinct_prompt(i), max_tokens=max_tokens, ignore_eos=True,
                                    sampling=SamplingParams(temperature=0))
        async for event in engine.generate(request):
            if event.kind == "delta" and first is None:
                first = time.perf_counter() - started
            elif event.kind == "finished":
                tokens = event.usage.completion_tokens
        return first or 0.0, tokens
    return one


async def timed_job(client: SlotqClient, request: JobRequest, started: float) -> tuple[float | None, int]:
    """Enqueue ``request`` and read its stream to the end: (seconds from ``started`` to the first
    chunk, None if none came; completion tokens)."""
    first, tokens = None, 0
    job = await client.enqueue(request)
    async for entry in job.stream():
        if entry.kind == EntryKind.CHUNK and first is None:
            first = time.perf_counter() - started
        elif entry.kind == EntryKind.DONE and entry.usage:
            tokens = entry.usage.completion_tokens
    return first, tokens


def _queue_request(client: SlotqClient, max_tokens: int) -> OneRequest:
    async def one(i: int, started: float) -> tuple[float, int]:
        first, tokens = await timed_job(client, JobRequest(prompt=distinct_prompt(i), max_tokens=max_tokens,
                                                           ignore_eos=True, sampling={"temperature": 0}), started)
        return first or 0.0, tokens
    return one


async def _server_counters(redis: Redis) -> tuple[int, int]:
    """(commands, read events): commands include those run inside Lua scripts; a read event is one
    request arriving from a client, so pipelined or scripted batches count once (round trips)."""
    stats = await redis.info("stats")
    return int(stats["total_commands_processed"]), int(stats["total_reads_processed"])


async def run(quick: bool) -> tuple[dict[str, Any], str]:
    concurrency = [1, 4] if quick else CONCURRENCY
    per_client = 2 if quick else 4
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
        for c in concurrency:
            progress(f"engine path at concurrency {c}")
            tps, ttft = await _closed_loop(_engine_request(engine, max_tokens), c, per_client)
            results.append(_row("engine", c, tps, ttft))
            progress(f"queue path at concurrency {c}")
            commands_before, reads_before = await _server_counters(client.redis)
            tps, ttft = await _closed_loop(_queue_request(client, max_tokens), c, per_client)
            commands_after, reads_after = await _server_counters(client.redis)
            commands += commands_after - commands_before
            reads += reads_after - reads_before
            tokens += c * per_client * max_tokens
            results.append(_row("queue", c, tps, ttft))
        return results, reads, commands, tokens
    finally:
        await engine.close()
        await client.close()


def _row(path: str, c: int, tps: float, ttfts: list[float]) -> dict[str, Any]:
    return {"path": path, "concurrency": c, "tokens_per_s": round(tps, 1),
            "ttft_p50_ms": round(percentile(ttfts, 50) * 1000, 1),
            "ttft_p95_ms": round(percentile(ttfts, 95) * 1000, 1)}


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
                     f"{added / step_ms:+.2f}"])
    table = markdown_table(["concurrency", "engine tok/s", "queue tok/s", "queue / engine",
                            "engine TTFT p50/p95 ms", "queue TTFT p50/p95 ms", "added TTFT p50/p95 ms",
                            "decode step ms", "added TTFT p50 in steps"], rows)
    return table + (f"\n\nRedis round trips per generated token (requests received by the server, all clients: "
                    f"worker, producers and stream readers): {reads_per_token:.2f}; commands per token, counting "
                    f"those inside Lua scripts: {commands_per_token:.2f}")
