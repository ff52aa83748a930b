"""``slotq bench gateway``: what the HTTP gateway adds over the Python client.

One worker subprocess (bundled model, 16 slots) and one ``slotq gateway`` subprocess on the same
Redis. The same closed-loop workload as ``slotq bench queue`` runs through the Python client
(enqueue, read the job's stream) and through the gateway (``POST /v1/completions`` with
``stream: true`` over HTTP, SSE parsed as it arrives), at 8 and 16 concurrent streams, in two
rounds with the order of the paths swapped (each client sends 2 requests of 64 tokens back to
back). Reported: aggregate tokens/s and TTFT p50 of both paths, their ratio and the difference.
The run stops at once, with the child's exit code and log tail, if the worker or the gateway dies.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.queue_bench import OneRequest, Timed, _closed_loop, _queue_request
from bench.report import distinct_prompt, markdown_table, percentile, progress, write_results
from slotq.engine import bundled_model_path
from slotq.jobs.cli.watch import ChildProcess, run_watched
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.redis_server import EmbeddedRedis, free_port
from slotq.jobs.settings import ClientSettings

SLOTS = 16
CTX = 512
CONCURRENCY = [8, 16]
ROUNDS = 2              # the order of the paths is swapped in every other round
PER_CLIENT = 2          # requests each closed-loop client sends back to back
MODEL_NAME = "bench"


def _gateway_request(http: httpx.AsyncClient, max_tokens: int) -> OneRequest:
    body = {"model": MODEL_NAME, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}

    async def one(i: int, started: float) -> Timed:
        first, tokens = None, 0
        async with http.stream("POST", "/v1/completions", json=body | {"prompt": distinct_prompt(i)}) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                    first = time.perf_counter() - started
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        return Timed(first, tokens, None)
    return one


async def _measure(paths: dict[str, OneRequest], concurrency: list[int], per_client: int) -> list[dict[str, Any]]:
    """Both paths at each concurrency, ``ROUNDS`` rounds with the order swapped: mean tokens/s, pooled TTFTs."""
    samples: dict[tuple[str, int], tuple[list[float], list[float]]] = {}
    for round_ in range(ROUNDS):
        for c in concurrency:
            order = list(paths) if round_ % 2 == 0 else list(reversed(paths))
            for path in order:
                progress(f"round {round_ + 1}: {path} path at concurrency {c}")
                tps, timed = await _closed_loop(paths[path], c, per_client)
                rates, all_ttfts = samples.setdefault((path, c), ([], []))
                rates.append(tps)
                all_ttfts.extend(t.first_s or 0.0 for t in timed)
    return [{"path": path, "concurrency": c, "tokens_per_s": round(sum(rates) / len(rates), 1),
             "ttft_p50_ms": round(percentile(ttfts, 50) * 1000, 1)}
            for (path, c), (rates, ttfts) in samples.items()]


async def run(quick: bool) -> tuple[dict[str, Any], str]:
    logging.getLogger("httpx").setLevel(logging.WARNING)      # one INFO line per request otherwise
    concurrency = [4] if quick else CONCURRENCY
    per_client = 1 if quick else PER_CLIENT
    max_tokens = 16 if quick else 64
    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as tmp:
        server = EmbeddedRedis(Path(tmp) / "redis")
        url = server.start()
        port = free_port()
        env = {**os.environ, "SLOTQ_REDIS_URL": url, "SLOTQ_MODEL": str(bundled_model_path()),
               "SLOTQ_MODEL_NAME": MODEL_NAME, "SLOTQ_SLOTS": str(SLOTS), "SLOTQ_CTX": str(CTX),
               "SLOTQ_PREFIX_CACHE": "false", "SLOTQ_LOG_LEVEL": "WARNING"}
        children = [ChildProcess(f"the benchmark's {name} (slotq {name})",
                                 [sys.executable, "-m", "slotq.jobs.cli", *argv],
                                 env=env, log_path=Path(tmp) / f"{name}.log")
                    for name, argv in (("worker", ["worker"]), ("gateway", ["gateway", "--port", str(port)]))]
        try:
            results = await run_watched(_both_paths(url, port, concurrency, per_client, max_tokens), *children)
        finally:
            for child in children:
                child.stop()
            server.stop()
    data = {"results": results}
    table = _table(results, concurrency)
    if not quick:
        write_results("gateway", data, table, "slotq bench gateway")
    return data, table


async def _both_paths(url: str, port: int, concurrency: list[int], per_client: int,
                      max_tokens: int) -> list[dict[str, Any]]:
    client = await SlotqClient.connect(url, ClientSettings(redis_url=url))
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120,
                             limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))
    try:
        progress("waiting for the worker and the gateway")
        await _ready(client, http)
        paths = {"client": _queue_request(client, max_tokens), "gateway": _gateway_request(http, max_tokens)}
        await asyncio.gather(*(paths[p](i, time.perf_counter()) for p in paths for i in range(4)))   # warm-up
        return await _measure(paths, concurrency, per_client)
    finally:
        await http.aclose()
        await client.close()


async def _ready(client: SlotqClient, http: httpx.AsyncClient) -> None:
    while not (await client.queue_info()).workers:
        await asyncio.sleep(0.2)
    while True:
        try:
            if MODEL_NAME in (await http.get("/health")).json()["models"]:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.2)


def _table(results: list[dict[str, Any]], concurrency: list[int]) -> str:
    by = {(r["path"], r["concurrency"]): r for r in results}
    rows = []
    for c in concurrency:
        cl, gw = by[("client", c)], by[("gateway", c)]
        rows.append([str(c), f"{cl['tokens_per_s']:.1f}", f"{gw['tokens_per_s']:.1f}",
                     f"{gw['tokens_per_s'] / cl['tokens_per_s']:.3f}", f"{cl['ttft_p50_ms']:.1f}",
                     f"{gw['ttft_p50_ms']:.1f}", f"{gw['ttft_p50_ms'] - cl['ttft_p50_ms']:+.1f}"])
    return markdown_table(["concurrent streams", "client tok/s", "gateway tok/s", "gateway / client",
                           "client TTFT p50 ms", "gateway TTFT p50 ms", "added TTFT p50 ms"], rows)
