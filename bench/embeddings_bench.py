"""``slotq bench embeddings``: embedding throughput, slotq through Redis beside llama-server.

Workload: C clients (1, 8, 32), each sending one-input embedding requests back to back until the
level's requests are done; inputs are distinct texts of 16 to 512 tokens (lengths cycle through
:data:`LENGTHS`). tokens/s = input tokens embedded (each system's own ``usage.prompt_tokens``) / wall
time, the mean of :data:`ROUNDS` rounds run in a rotated order. Both systems get the same cores,
32 sequences per decode and a decode of :data:`BATCH` tokens, L2-normalised vectors:

- ``slotq-redis``: ``slotq worker --embeddings`` (``SLOTQ_POOLING=mean``); the client enqueues each
  request through Redis (``client.embed``) and waits for its result;
- ``llama-server -kvu``: ``--embeddings --pooling mean --parallel 32 -kvu``, built from the llama.cpp that
  llama-cpp-python vendors (:mod:`bench.llama_server`), ``POST /v1/embeddings``: one KV pool, as slotq's
  embedding engine has; the ratios are against it;
- ``llama-server``: the same without ``-kvu`` (a KV stream per slot, its default with an explicit
  ``--parallel``). Faster, but not always right: llama.cpp then cuts a batch into micro-batches of
  equal tokens per sequence and pools a longer input over a part of it (three concurrent requests
  of different lengths: cosine 0.996 to the same input embedded alone; 1.0 with ``-kvu``).

Models: the bundled SmolLM2-135M-Instruct (mean pooling, as llama-server serves a text generator
with ``--pooling mean``) and the suite's tiny random model, whose decode costs little, so its row
shows what surrounds the decode (tokenizing, the queue, HTTP). A system that cannot start is skipped
with one line saying why.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from bench import llama_server
from bench.overhead_bench import _rotated, write_tiny_model
from bench.peers_bench import _wait_http
from bench.report import markdown_table, progress, write_results
from slotq.engine import bundled_model_path
from slotq.jobs.cli.watch import ChildProcess, run_watched
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.redis_server import EmbeddedRedis, free_port
from slotq.jobs.settings import ClientSettings

CONCURRENCY = [1, 8, 32]
LENGTHS = [16, 48, 128, 256, 512]        # approximate tokens of the inputs, in turn
SEQUENCES = 32                           # per decode, both systems
BATCH = 512                              # tokens per decode, both systems (slotq's default SLOTQ_BATCH): on
                                         # CPU a decode's attention grows with the square of its tokens in one
                                         # KV pool, so 512 embedded 1.4x faster than 4096 (32 x 128 tokens)
INPUT_LIMIT = 520                        # per input: every text below fits
THREADS = len(os.sched_getaffinity(0)) or 1
ROUNDS = 2
SYSTEMS = ["slotq-redis", "llama-server -kvu", "llama-server"]
PEER = "llama-server -kvu"                 # the ratios' reference: the mode whose vectors are right
WORDS = ("queue", "slot", "batch", "token", "worker", "stream", "lease", "tenant", "lane", "model", "vector",
         "decode", "prompt", "cache", "shard", "retry")

LETTERS = "abcdefghijklmnopqrstuvwxyz"

OneRequest = Callable[[str], Awaitable[int]]        # text -> input tokens embedded
TextOf = Callable[[int, int], str]                  # (index, tokens) -> a distinct text of about that many tokens


def text_of(i: int, tokens: int) -> str:
    """A distinct text of about ``tokens`` tokens to SmolLM2's tokenizer (these words are 1.07 tokens each
    on average, the prefix about 6)."""
    words = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(max(1, int((tokens - 6) / 1.07)))]
    return f"Note {i}: " + " ".join(words)


def letters_of(i: int, tokens: int) -> str:
    """The same for the tiny model, whose vocabulary is single letters and bytes: one letter, one token.
    It starts with the index spelt in letters, so no two texts share a prefix."""
    prefix = "".join(LETTERS[int(d)] for d in str(i)) + "z"
    return (prefix + LETTERS * (tokens // len(LETTERS) + 1))[:max(1, tokens - 2)]


def requests_at(clients: int, quick: bool) -> int:
    return clients * (2 if quick else 4) if clients > 1 else (5 if quick else 10)


async def closed_loop(one: OneRequest, texts: TextOf, clients: int, total: int, first: int) -> float:
    """``clients`` tasks sending requests back to back until ``total`` are done; tokens/s."""
    queue = list(range(first, first + total))
    embedded = 0

    async def client() -> None:
        nonlocal embedded
        while queue:
            i = queue.pop()
            tokens = await one(texts(i, LENGTHS[i % len(LENGTHS)]))
            embedded += tokens        # after the await: `embedded += await ...` would add to a stale total

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return embedded / (time.perf_counter() - started)


def _http_embed(http: httpx.AsyncClient) -> OneRequest:
    async def one(text: str) -> int:
        response = await http.post("/v1/embeddings", json={"input": text, "model": "bench"})
        if response.status_code != 200:
            raise RuntimeError(f"{http.base_url}: HTTP {response.status_code}: {response.text[:300]}")
        return int(response.json()["usage"]["prompt_tokens"])
    return one


def _slotq_embed(client: SlotqClient) -> OneRequest:
    async def one(text: str) -> int:
        return (await client.embed(text, timeout=600)).usage.prompt_tokens
    return one


# ----------------------------------------------------------------------------- the run
async def run(quick: bool) -> tuple[dict[str, Any], str]:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    levels = [1, 8] if quick else CONCURRENCY
    skipped: dict[str, str] = {}
    try:
        server_binary: Path | None = llama_server.find_or_build()
    except llama_server.Unavailable as exc:
        server_binary = None
        skipped |= {system: str(exc) for system in SYSTEMS[1:]}
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="slotq-bench-embeddings-") as tmp_name:
        tmp = Path(tmp_name)
        models: dict[str, tuple[Path, TextOf]] = {
            "SmolLM2-135M (mean)": (bundled_model_path(), text_of),
            "tiny (overhead)": (write_tiny_model(tmp / "tiny.gguf"), letters_of)}
        redis = EmbeddedRedis(tmp / "redis")
        url = redis.start()
        try:
            for index, (name, (path, texts)) in enumerate(models.items()):
                results += await _model(name, path, texts, f"embeddings-{index}", levels, quick, tmp, url,
                                        server_binary)
        finally:
            redis.stop()
    for system, reason in skipped.items():
        progress(f"skipped {system}: {reason}")
    data = {"lengths": LENGTHS, "sequences_per_decode": SEQUENCES, "batch": BATCH, "threads": THREADS,
            "results": results, "skipped": skipped}
    text = _table(results, list(models), levels, skipped)
    if not quick:
        write_results("embeddings", data, text, "slotq bench embeddings")
    return data, text


async def _model(name: str, model: Path, texts: TextOf, queue: str, levels: list[int], quick: bool, tmp: Path,
                 url: str, server_binary: Path | None) -> list[dict[str, Any]]:
    env = {**os.environ, "SLOTQ_REDIS_URL": url, "SLOTQ_MODEL": str(model), "SLOTQ_EMBEDDINGS": "true",
           "SLOTQ_POOLING": "mean", "SLOTQ_SLOTS": str(SEQUENCES), "SLOTQ_BATCH": str(BATCH),
           "SLOTQ_CTX": str(INPUT_LIMIT), "SLOTQ_THREADS": str(THREADS), "SLOTQ_LOG_LEVEL": "WARNING",
           "SLOTQ_QUEUE_NAME": queue}
    children = {"slotq-redis": ChildProcess(f"slotq worker --embeddings ({name})",
                                            [sys.executable, "-m", "slotq.jobs.cli", "worker"], env=env,
                                            log_path=tmp / f"worker-{queue}.log")}
    ports: dict[str, int] = {}
    if server_binary is not None:
        for system, extra in (("llama-server -kvu", ["-kvu"]), ("llama-server", [])):
            port = ports[system] = free_port()
            children[system] = ChildProcess(f"{system} --embeddings ({name})", [
                str(server_binary), "-m", str(model), "--embeddings", "--pooling", "mean", "--parallel",
                str(SEQUENCES), "-c", str(SEQUENCES * INPUT_LIMIT), "-b", str(BATCH), "-ub", str(BATCH), "-t",
                str(THREADS), "--host", "127.0.0.1", "--port", str(port), *extra],
                log_path=tmp / f"{system.replace(' ', '')}-{queue}.log")
    try:
        return await run_watched(_measure(name, texts, levels, quick, url, queue, ports),
                                 *children.values())
    finally:
        for child in children.values():
            child.stop()


async def _measure(name: str, texts: TextOf, levels: list[int], quick: bool, url: str, queue: str,
                   ports: dict[str, int]) -> list[dict[str, Any]]:
    client = await SlotqClient.connect(url, ClientSettings(redis_url=url, queue_name=queue))
    limits = httpx.Limits(max_connections=SEQUENCES + 8, max_keepalive_connections=SEQUENCES + 8)
    https = {system: httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits)
             for system, port in ports.items()}
    try:
        paths: dict[str, OneRequest] = {"slotq-redis": _slotq_embed(client)}
        while not any(w.ready for w in (await client.queue_info()).workers):
            await asyncio.sleep(0.2)
        for system, http in https.items():
            await _wait_http(http, "/health", lambda r: r.status_code == 200)
            paths[system] = _http_embed(http)
        for one in paths.values():
            await one(texts(0, 64))                           # warm-up, not measured
        rows = []
        for clients in levels:
            total = requests_at(clients, quick)
            rates: dict[str, list[float]] = {system: [] for system in paths}
            for r in range(ROUNDS):
                for system in _rotated(list(paths), r):
                    progress(f"{name}, {clients} clients, round {r + 1}/{ROUNDS}: {system}")
                    first = 1 + (clients * 1000 + r) * 100      # distinct texts: no cache helps either system
                    rates[system].append(await closed_loop(paths[system], texts, clients, total, first))
            rows += [{"model": name, "system": system, "clients": clients, "requests": total,
                      "tokens_per_s": round(sum(values) / len(values), 1), "rounds": [round(v, 1) for v in values]}
                     for system, values in rates.items()]
        return rows
    finally:
        for http in https.values():
            await http.aclose()
        await client.close()


def _table(results: list[dict[str, Any]], models: list[str], levels: list[int], skipped: dict[str, str]) -> str:
    tps = {(r["model"], r["system"], r["clients"]): r["tokens_per_s"] for r in results}
    rows = []
    for model in models:
        for system in SYSTEMS:
            if system in skipped:
                continue
            cells = [model, system]
            for c in levels:
                value, peer = tps.get((model, system, c)), tps.get((model, PEER, c))
                ratio = f" ({value / peer:.2f} x)" if value and peer else ""
                cells.append(f"{value:,.0f}{ratio}" if value is not None else "-")
            rows.append(cells)
    table = markdown_table(["model", "system", *(f"{c} clients tok/s (/ {PEER})" for c in levels)], rows)
    return table + "".join(f"\n\nskipped {system}: {reason}" for system, reason in skipped.items())


# ----------------------------------------------------------------------------- one worker for both kinds?
async def sharing_cost(threads: int = THREADS) -> dict[str, float]:
    """What a generation worker's streams would pay if its engine thread also ran embedding batches:
    the mean decode step of 8 generating streams, beside the mean embedding decode of 32 inputs of 128
    tokens (:data:`BATCH` tokens a decode), both on the bundled model in this process. Every embedding decode would
    hold every stream's next token for its whole length. ``python -m bench.embeddings_bench``."""
    from slotq.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
    from slotq.engine.embedding import EmbeddingEngine
    from slotq.engine.request import EmbeddingRequest

    model = bundled_model_path()
    generator = await Engine.start(EngineConfig(model_path=model, slots=8, ctx=1024, threads=threads))
    try:
        await generator.warm_up()
        before = generator.stats()
        requests = [GenerationRequest(prompt=text_of(i, 16), max_tokens=64, ignore_eos=True,
                                      sampling=SamplingParams(temperature=0)) for i in range(8)]

        async def drain(request: GenerationRequest) -> None:
            async for _event in generator.generate(request):
                pass

        await asyncio.gather(*(drain(r) for r in requests))
        after = generator.stats()
        step_ms = (after.generating_seconds - before.generating_seconds) / (
            after.generating_steps - before.generating_steps) * 1000
    finally:
        await generator.close()
    embedder = await EmbeddingEngine.start(EngineConfig(model_path=model, slots=32, ctx=512, batch=BATCH,
                                                        threads=threads))
    try:
        await embedder.warm_up()
        before = embedder.stats()
        await embedder.embed(EmbeddingRequest(inputs=[text_of(i, 128) for i in range(32)]))
        after = embedder.stats()
        batch_ms = (after.decode_seconds - before.decode_seconds) / (after.decode_steps - before.decode_steps) * 1000
    finally:
        await embedder.close()
    return {"generation_step_ms": round(step_ms, 1), "embedding_batch_ms": round(batch_ms, 1),
            "stall_in_steps": round(batch_ms / step_ms, 1)}


if __name__ == "__main__":
    print(asyncio.run(sharing_cost()))
