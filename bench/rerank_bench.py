"""``slotq bench rerank``: rerank through Redis beside llama-server ``--rerank``: the same scores, and pairs/s.

Two rerankers written by the suite's writer (tests/support/tiny_model.py's ``write_tiny_reranker``: a random
BERT cross-encoder with rank pooling; no reranker ships with slotq and nothing is downloaded): the tiny one
(64 wide, 2 layers), whose decode costs little, so its row shows what surrounds the decode (tokenizing, the
queue, HTTP), and one of MiniLM-L6's shape (384 wide, 6 layers), whose decode is the cost.

- ``slotq-redis``: ``slotq worker`` on the reranker (its kind detected from the GGUF); the client enqueues
  each request through Redis (``client.rerank``) and waits for its scores;
- ``llama-server``: ``--rerank`` (built from the llama.cpp that llama-cpp-python vendors,
  :mod:`bench.llama_server`), ``POST /v1/rerank``.

Both get the same cores, :data:`SEQUENCES` pairs per decode, a decode of :data:`BATCH` tokens and flash
attention off: with it on, llama.cpp's CPU kernel rounds through F16 over the decode's whole KV, so in either
system a pair's score moves by about 0.5% with the pairs beside it, and the agreement would measure the
batching, not the scoring.

Agreement: each system scores :data:`AGREE_QUERIES` queries against the same :data:`AGREE_DOCUMENTS`
documents (one request per query); the largest absolute difference between their scores, and whether
every query's order agrees. Then the same pairs with one document per request: one pair per decode in
both systems, so the same shapes of computation, and what is left of a difference is not the batching.
Last, each system's batched scores against its own scores of the same pairs alone: what the batch shape
(the order of a sum) moves on its own, in slotq and in llama-server alike.

Throughput: C clients (1, 8), each sending requests of
:data:`DOCUMENTS_PER_REQUEST` documents of 16 to 128 tokens back to back; pairs/s = documents scored / wall
time, the mean of :data:`ROUNDS` rounds run in a rotated order (one request per client at 8 clients, 4 at 1:
the larger model scores a few pairs a second on a shared 2-core machine). Beside it, the serving processes'
CPU time per pair (user + system: the worker and its Valkey; llama-server), which a machine shared with
other work disturbs far less than wall time. A system that cannot start is skipped with
one line saying why.
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
from bench.fleet_counters import _process_cpu_s
from bench.overhead_bench import _rotated, _tiny_model_module
from bench.peers_bench import _wait_http
from bench.report import markdown_table, progress, write_results
from slotq.jobs.cli.watch import ChildProcess, run_watched
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.redis_server import EmbeddedRedis, free_port
from slotq.jobs.settings import ClientSettings

CONCURRENCY = [1, 8]
SEQUENCES = 16                           # pairs per decode, both systems (slots / --parallel)
BATCH = 512                              # tokens per decode, both systems
PAIR_LIMIT = 512                         # per pair: the writers' training context
THREADS = 1                              # each system: on a machine shared with other work, llama.cpp's threads
                                         # spin at every barrier while one of them waits for a core, which burns
                                         # CPU time and wall time alike (34 ms of CPU a pair on the tiny model
                                         # with 2 threads at load average 13)
ROUNDS = 3
DOCUMENTS_PER_REQUEST = 8
LENGTHS = [16, 32, 64, 128]              # tokens of the documents, in turn (one letter, one token)
AGREE_QUERIES = 4
AGREE_DOCUMENTS = 12
SYSTEMS = ["slotq-redis", "llama-server"]
PEER = "llama-server"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
MODELS = {"tiny (64 x 2, overhead)": {}, "MiniLM-L6 shape (384 x 6)": {"n_embd": 384, "n_layer": 6}}

Rank = Callable[[str, list[str]], Awaitable[list[float]]]      # (query, documents) -> scores in document order


def document(i: int, tokens: int) -> str:
    """A distinct text of ``tokens`` tokens for the writers' vocabulary (single letters and bytes): it starts with
    its index spelt in letters, so no two share a prefix."""
    prefix = "".join(LETTERS[int(d)] for d in str(i)) + "z"
    return (prefix + LETTERS[i % 26:] + LETTERS * (tokens // len(LETTERS) + 1))[:tokens]


def query(i: int) -> str:
    return f"what is {LETTERS[i % 26]}{LETTERS[(i * 7) % 26]} about"


def _slotq_rank(client: SlotqClient) -> Rank:
    async def rank(q: str, documents: list[str]) -> list[float]:
        return (await client.rerank(q, documents, timeout=600)).scores
    return rank


def _http_rank(http: httpx.AsyncClient) -> Rank:
    async def rank(q: str, documents: list[str]) -> list[float]:
        response = await http.post("/v1/rerank", json={"query": q, "documents": documents})
        if response.status_code != 200:
            raise RuntimeError(f"{http.base_url}: HTTP {response.status_code}: {response.text[:300]}")
        scores = [0.0] * len(documents)
        for result in response.json()["results"]:
            scores[result["index"]] = float(result["relevance_score"])
        return scores
    return rank


async def closed_loop(rank: Rank, clients: int, total: int, first: int) -> float:
    """``clients`` tasks sending requests back to back until ``total`` are done; pairs/s."""
    queue = list(range(first, first + total))
    scored = 0

    async def client() -> None:
        nonlocal scored
        while queue:
            i = queue.pop()
            docs = [document(i * 100 + k, LENGTHS[k % len(LENGTHS)]) for k in range(DOCUMENTS_PER_REQUEST)]
            scores = await rank(query(i), docs)
            scored += len(scores)       # after the await: `scored += len(await ...)` would add to a stale total

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return scored / (time.perf_counter() - started)


# ----------------------------------------------------------------------------- the run
async def run(quick: bool) -> tuple[dict[str, Any], str]:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    skipped: dict[str, str] = {}
    try:
        server_binary: Path | None = llama_server.find_or_build()
    except llama_server.Unavailable as exc:
        server_binary = None
        skipped[PEER] = str(exc)
    results: list[dict[str, Any]] = []
    agreement: list[dict[str, Any]] = []
    writer = _tiny_model_module().write_tiny_reranker
    with tempfile.TemporaryDirectory(prefix="slotq-bench-rerank-") as tmp_name:
        tmp = Path(tmp_name)
        redis = EmbeddedRedis(tmp / "redis")
        url = redis.start()
        try:
            for index, (name, shape) in enumerate(MODELS.items()):
                model = Path(writer(tmp / f"reranker-{index}.gguf", n_ctx_train=PAIR_LIMIT, **shape))
                assert redis.pid is not None
                rows, agreed = await _model(name, model, f"rerank-{index}", quick, tmp, url, redis.pid, server_binary)
                results += rows
                agreement += agreed
        finally:
            redis.stop()
    for system, reason in skipped.items():
        progress(f"skipped {system}: {reason}")
    data = {"sequences_per_decode": SEQUENCES, "batch": BATCH, "threads": THREADS, "lengths": LENGTHS,
            "documents_per_request": DOCUMENTS_PER_REQUEST, "flash_attention": "off", "results": results,
            "agreement": agreement, "skipped": skipped}
    text = _table(results, agreement, list(MODELS), skipped)
    if not quick:
        write_results("rerank", data, text, "slotq bench rerank")
    return data, text


async def _model(name: str, model: Path, queue: str, quick: bool, tmp: Path, url: str, redis_pid: int,
                 server_binary: Path | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    env = {**os.environ, "SLOTQ_REDIS_URL": url, "SLOTQ_MODEL": str(model), "SLOTQ_SLOTS": str(SEQUENCES),
           "SLOTQ_BATCH": str(BATCH), "SLOTQ_CTX": str(PAIR_LIMIT), "SLOTQ_THREADS": str(THREADS),
           "SLOTQ_FLASH_ATTENTION": "off", "SLOTQ_LOG_LEVEL": "WARNING", "SLOTQ_QUEUE_NAME": queue}
    worker = [sys.executable, "-m", "slotq.jobs.cli", "worker"]
    children = {"slotq-redis": ChildProcess(f"slotq worker ({name})", worker, env=env,
                                            log_path=tmp / f"worker-{queue}.log")}
    port = free_port()
    if server_binary is not None:
        children[PEER] = ChildProcess(f"llama-server --rerank ({name})", [
            str(server_binary), "-m", str(model), "--rerank", "--parallel", str(SEQUENCES), "-c",
            str(SEQUENCES * PAIR_LIMIT), "-b", str(BATCH), "-ub", str(BATCH), "-t", str(THREADS), "-fa", "off",
            "--host", "127.0.0.1", "--port", str(port)], log_path=tmp / f"llama-server-{queue}.log")
    try:
        pids = {"slotq-redis": [children["slotq-redis"].proc.pid, redis_pid]}
        if server_binary is not None:
            pids[PEER] = [children[PEER].proc.pid]
        return await run_watched(_measure(name, quick, url, queue, port if server_binary else None, pids),
                                 *children.values())
    finally:
        for child in children.values():
            child.stop()


async def _measure(name: str, quick: bool, url: str, queue: str, port: int | None,
                   pids: dict[str, list[int]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    client = await SlotqClient.connect(url, ClientSettings(redis_url=url, queue_name=queue))
    limits = httpx.Limits(max_connections=SEQUENCES + 8, max_keepalive_connections=SEQUENCES + 8)
    http = (httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits)
            if port is not None else None)
    try:
        paths: dict[str, Rank] = {"slotq-redis": _slotq_rank(client)}
        while not any(w.ready for w in (await client.queue_info()).workers):
            await asyncio.sleep(0.2)
        if http is not None:
            await _wait_http(http, "/health", lambda r: r.status_code == 200)
            paths[PEER] = _http_rank(http)
        for rank in paths.values():
            await rank(query(0), [document(0, 16)])                   # warm-up, not measured
        agreement = await _agreement(name, paths)
        rows = []
        for clients in [1] if quick else CONCURRENCY:
            total = clients if clients > 1 else (2 if quick else 4)
            rates: dict[str, list[float]] = {system: [] for system in paths}
            cpu: dict[str, list[float]] = {system: [] for system in paths}
            for r in range(1 if quick else ROUNDS):
                for system in _rotated(list(paths), r):
                    progress(f"{name}, {clients} clients, round {r + 1}: {system}")
                    before = sum(_process_cpu_s(pid) for pid in pids[system])
                    rates[system].append(await closed_loop(paths[system], clients, total, 1 + (clients * 10 + r) * 100))
                    spent = sum(_process_cpu_s(pid) for pid in pids[system]) - before
                    cpu[system].append(spent * 1000 / (total * DOCUMENTS_PER_REQUEST))
            rows += [{"model": name, "system": system, "clients": clients, "requests": total,
                      "pairs_per_s": round(sum(values) / len(values), 1), "rounds": [round(v, 1) for v in values],
                      "cpu_ms_per_pair": round(sum(cpu[system]) / len(cpu[system]), 2)}
                     for system, values in rates.items()]
        return rows, agreement
    finally:
        if http is not None:
            await http.aclose()
        await client.close()


async def _agreement(name: str, paths: dict[str, Rank]) -> list[dict[str, Any]]:
    """The largest score difference between slotq and llama-server over the same requests, and whether every
    request's order agrees (nothing when llama-server was skipped): each query with all the documents in one
    request, then with each document in a request of its own (one pair per decode in both systems, so the
    same batch shape). And each system's own batched scores against its own scores of the same pairs alone:
    how far the batch shape alone (the summation order) moves a score in either system."""
    if PEER not in paths:
        return []
    docs = [document(5000 + k, LENGTHS[k % len(LENGTHS)]) for k in range(AGREE_DOCUMENTS)]
    scores: dict[tuple[str, str], list[list[float]]] = {}        # (system, batched|alone) -> per query
    for system in ("slotq-redis", PEER):
        for i in range(AGREE_QUERIES):
            scores.setdefault((system, "batched"), []).append(await paths[system](query(i), docs))
            scores.setdefault((system, "alone"), []).append([(await paths[system](query(i), [d]))[0] for d in docs])

    def worst(a: list[list[float]], b: list[list[float]]) -> float:
        return max(abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True))

    rows = []
    for shape, per_request in (("batched", AGREE_DOCUMENTS), ("alone", 1)):
        ours, theirs = scores[("slotq-redis", shape)], scores[(PEER, shape)]
        difference = worst(ours, theirs)
        largest = max(abs(x) for xs in theirs for x in xs)
        same_order = all(_order(a) == _order(b) for a, b in zip(ours, theirs, strict=True))
        progress(f"{name}, {AGREE_QUERIES} x {AGREE_DOCUMENTS} pairs, {per_request} a request: largest score "
                 f"difference {difference:.2e} (scores up to {largest:.3g}), same order: {same_order}")
        rows.append({"model": name, "requests": AGREE_QUERIES * AGREE_DOCUMENTS // per_request,
                     "documents": per_request, "max_abs_difference": difference, "max_abs_score": largest,
                     "same_order": same_order})
    own = {system: worst(scores[(system, "batched")], scores[(system, "alone")]) for system in ("slotq-redis", PEER)}
    progress(f"{name}: batched against alone, the same system: slotq {own['slotq-redis']:.2e}, "
             f"llama-server {own[PEER]:.2e}")
    rows[0]["own_batched_vs_alone"] = own
    return rows


def _order(scores: list[float]) -> list[int]:
    return sorted(range(len(scores)), key=lambda k: -scores[k])


def _table(results: list[dict[str, Any]], agreement: list[dict[str, Any]], models: list[str],
           skipped: dict[str, str]) -> str:
    levels = sorted({r["clients"] for r in results})
    rate = {(r["model"], r["system"], r["clients"]): r["pairs_per_s"] for r in results}
    cpu = {(r["model"], r["system"], r["clients"]): r["cpu_ms_per_pair"] for r in results}
    rows = []
    for model in models:
        for system in SYSTEMS:
            if system in skipped:
                continue
            cells = [model, system]
            for c in levels:
                value, peer = rate.get((model, system, c)), rate.get((model, PEER, c))
                ratio = f" ({value / peer:.2f} x)" if value and peer else ""
                cells.append(f"{value:,.1f}{ratio}" if value is not None else "-")
            for c in levels:
                value, peer = cpu.get((model, system, c)), cpu.get((model, PEER, c))
                ratio = f" ({value / peer:.2f} x)" if value and peer else ""
                cells.append(f"{value:.2f}{ratio}" if value is not None else "-")
            rows.append(cells)
    table = markdown_table(["model", "system", *(f"{c} clients pairs/s (/ {PEER})" for c in levels),
                            *(f"{c} clients CPU ms/pair (/ {PEER})" for c in levels)], rows)
    if agreement:
        own = {a["model"]: a["own_batched_vs_alone"] for a in agreement if "own_batched_vs_alone" in a}
        table += "\n\n" + markdown_table(
            ["model", "requests x documents", "largest |score difference| vs llama-server", "largest |score|",
             "same order", "slotq's own batched vs alone", "llama-server's own batched vs alone"],
            [[a["model"], f"{a['requests']} x {a['documents']}", f"{a['max_abs_difference']:.2e}",
              f"{a['max_abs_score']:.3g}", "yes" if a["same_order"] else "no",
              *((f"{own[a['model']]['slotq-redis']:.2e}", f"{own[a['model']][PEER]:.2e}")
                if "own_batched_vs_alone" in a else ("", ""))] for a in agreement])
    return table + "".join(f"\n\nskipped {system}: {reason}" for system, reason in skipped.items())
