"""``slotq bench spec``: speculative decoding, slotq beside llama-server, side by side in one run.

Rows (each a process of its own, serving with as many slots as there are clients, ``C``):

- ``slotq spec=off`` and ``slotq spec=ngram`` (n-gram drafts from each sequence's own prompt and
  output): a ``slotq worker`` each, behind one ``slotq gateway``;
- ``llama-server`` without drafting, and with ``--spec-type ngram-simple``, ``ngram-map-k`` and
  ``ngram-mod``, each at this build's defaults (:mod:`bench.llama_server` builds it from the
  llama.cpp that llama-cpp-python vendors; skipped with the reason if it cannot be built);
- with ``--draft-model PATH`` (a small GGUF with the bundled model's vocabulary), ``slotq
  spec=draft`` (``SLOTQ_DRAFT_MODEL``) and ``llama-server --spec-type draft-simple --model-draft``.

Workloads, both greedy and generating exactly ``max_tokens`` (``ignore_eos``), so every row does
the same work: **copy-heavy**, chat requests whose answer copies a 200-800 token text with one
change (:mod:`bench.spec_prompts`), 256 tokens each, so the copy rather than the prefill takes
most of a request's time; and **free-form**, 128 tokens each, the peers benchmark's completion prompts
(:func:`bench.peers_bench.peer_prompt`). ``C`` closed-loop clients send their requests back to back
through the same HTTP client code for every row; every row gets the same prompts in a round and
never one twice. Each round measures every workload and row in a rotated order, so the noise of a
shared machine falls on all rows alike; tokens/s is the mean of the rounds, TTFT percentiles pool
every request.

Draft acceptance comes from each system's Prometheus counters, read before and after each
measurement: llama-server's ``llamacpp:spec_decode_num_draft_tokens_total`` and
``..._accepted_tokens_total`` (``--metrics``), the worker's ``slotq_spec_draft_tokens_total`` and
``slotq_spec_accepted_tokens_total`` (``SLOTQ_METRICS_PORT``). Both update a moment after a request
ends, so a reading waits until the system's generated-token counter covers every token the
benchmark has received from it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench import llama_server
from bench.peers_bench import (
    THREADS,
    OneRequest,
    Sample,
    _wait_http,
    closed_loop,
    gateway_process,
    http_stream,
    peer_prompt,
)
from bench.report import percentile, progress, write_results
from bench.spec_prompts import copy_prompt
from bench.spec_report import LLAMA_PLAIN, LLAMA_SPEC_PREFIX, SLOTQ_DRAFT, SLOTQ_NGRAM, SLOTQ_OFF, acceptance, table
from slotq.engine import bundled_model_path
from slotq.engine.config import CpuRepack
from slotq.engine.cpu_features import decide_repack, this_cpu_flags
from slotq.jobs.cli.watch import ChildProcess, run_watched
from slotq.jobs.redis_server import EmbeddedRedis, free_port

CONCURRENCY = [1, 4, 16]
ROUNDS = 2
MAX_TOKENS = {"copy-heavy": 256, "free-form": 128}
QUICK_MAX_TOKENS = {"copy-heavy": 32, "free-form": 32}
CTX = 1280              # per slot: the longest copy-heavy prompt (800 tokens and the chat template), its output
                        # and a draft fit
LLAMA_NGRAM_TYPES = ["ngram-simple", "ngram-map-k", "ngram-mod"]
WORKLOADS = ["copy-heavy", "free-form"]
ROW_SETTINGS = ("SLOTQ_SPEC", "SLOTQ_DRAFT_MODEL")     # what tells the slotq rows apart: never inherited
COUNTER_WAIT_S = 15.0   # how long a reading waits for a system's counters to cover the tokens it sent

# (generated, drafted, accepted) counters' sample names in each system's /metrics
SLOTQ_COUNTERS = ("slotq_tokens_predicted_total", "slotq_spec_draft_tokens_total", "slotq_spec_accepted_tokens_total")
LLAMA_COUNTERS = ("llamacpp:tokens_predicted_total", "llamacpp:spec_decode_num_draft_tokens_total",
                  "llamacpp:spec_decode_num_accepted_tokens_total")


@dataclass(frozen=True)
class System:
    """One row: a slotq worker with ``worker_env`` (its speculation settings), or a llama-server
    with ``server_args`` (its speculation flags)."""
    name: str
    key: str                                   # the worker's queue and model name; the log file's name
    worker_env: dict[str, str] | None = None
    server_args: tuple[str, ...] = ()

    @property
    def is_slotq(self) -> bool:
        return self.worker_env is not None


def systems(server: bool, draft_model: Path | None) -> list[System]:
    rows = [System(SLOTQ_OFF, "spec-off", {"SLOTQ_SPEC": "off"}),
            System(SLOTQ_NGRAM, "spec-ngram", {"SLOTQ_SPEC": "ngram"})]
    if draft_model is not None:
        rows.append(System(SLOTQ_DRAFT, "spec-draft", {"SLOTQ_SPEC": "draft", "SLOTQ_DRAFT_MODEL": str(draft_model)}))
    if server:
        rows.append(System(LLAMA_PLAIN, "llama-server"))
        rows += [System(LLAMA_SPEC_PREFIX + kind, f"llama-server-{kind}", server_args=("--spec-type", kind))
                 for kind in LLAMA_NGRAM_TYPES]
        if draft_model is not None:
            rows.append(System(LLAMA_SPEC_PREFIX + "draft-simple", "llama-server-draft",
                               server_args=("--spec-type", "draft-simple", "--model-draft", str(draft_model))))
    return rows


@dataclass
class Measured:
    """One row on one workload at one client count, over the rounds."""
    rates: list[float] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    draft_tokens: int | None = None           # None: the system reports no such counter
    accepted_tokens: int | None = None

    def add_counts(self, before: tuple[int | None, int | None], after: tuple[int | None, int | None]) -> None:
        if before[0] is None or after[0] is None or before[1] is None or after[1] is None:
            return
        self.draft_tokens = (self.draft_tokens or 0) + after[0] - before[0]
        self.accepted_tokens = (self.accepted_tokens or 0) + after[1] - before[1]


@dataclass
class SpecCounters:
    """A system's cumulative drafted and accepted tokens, from its Prometheus ``/metrics``."""
    http: httpx.AsyncClient
    url: str
    names: tuple[str, str, str]               # generated, drafted, accepted
    tokens_received: int = 0                  # tokens the benchmark has received from this system

    async def read(self) -> tuple[int | None, int | None]:
        """(drafted, accepted) once the counters cover every token received (or after COUNTER_WAIT_S)."""
        generated, drafted, accepted = self.names
        give_up = time.monotonic() + COUNTER_WAIT_S
        values = scrape(await self._text())
        while values.get(generated, 0) < self.tokens_received:
            if time.monotonic() > give_up:
                progress(f"{self.url}: {generated} stays below the {self.tokens_received} tokens received; "
                         "reading the draft counters anyway")
                break
            await asyncio.sleep(0.2)
            values = scrape(await self._text())
        return _as_int(values.get(drafted)), _as_int(values.get(accepted))

    async def _text(self) -> str:
        response = await self.http.get(self.url)
        response.raise_for_status()
        return response.text


def _as_int(value: float | None) -> int | None:
    return None if value is None else int(value)


def scrape(text: str) -> dict[str, float]:
    """Prometheus text: every sample's name (``_total`` included) -> its value summed over labels."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def worker_environment(environ: Mapping[str, str], row: System, common: dict[str, str]) -> dict[str, str]:
    """A slotq row's worker: this process' environment without the settings that tell the rows apart
    (``ROW_SETTINGS``: a ``SLOTQ_DRAFT_MODEL`` set here must not turn the n-gram row into a draft-model
    row), then ``common``, the row's queue and model name, and its own speculation settings.
    ``SLOTQ_SPEC_K_MIN``/``K_MAX`` pass through to every slotq row."""
    inherited = {k: v for k, v in environ.items() if k not in ROW_SETTINGS}
    return inherited | common | {"SLOTQ_QUEUE_NAME": row.key, "SLOTQ_MODEL_NAME": row.key} | (row.worker_env or {})


class Fleet:
    """Every row's process at one client count (``slots``), started together, stopped together."""

    def __init__(self, tmp: Path, redis_url: str, model: Path, slots: int, rows: list[System],
                 server_binary: Path | None, repack: bool) -> None:
        self.slots = slots
        self.children: list[ChildProcess] = []
        self.metrics_urls: dict[str, str] = {}
        self.server_ports: dict[str, int] = {}
        base = {"SLOTQ_REDIS_URL": redis_url, "SLOTQ_MODEL": str(model), "SLOTQ_SLOTS": str(slots),
                "SLOTQ_CTX": str(CTX), "SLOTQ_THREADS": str(THREADS), "SLOTQ_CPU_REPACK": "on" if repack else "off",
                "SLOTQ_LOG_LEVEL": "WARNING", "SLOTQ_ELASTIC": "false"}     # fixed slots, as llama-server's --parallel
        for row in rows:
            log = tmp / f"{row.key}-{slots}.log"
            if row.worker_env is not None:
                port = free_port()
                self.metrics_urls[row.name] = f"http://127.0.0.1:{port}/metrics"
                env = worker_environment(os.environ, row, base | {"SLOTQ_METRICS_PORT": str(port)})
                argv = [sys.executable, "-m", "slotq.jobs.cli", "worker"]
                self.children.append(ChildProcess(f"slotq worker ({row.name}) at {slots} slots", argv, env=env,
                                                  log_path=log))
            elif server_binary is not None:
                port = self.server_ports[row.name] = free_port()
                self.metrics_urls[row.name] = f"http://127.0.0.1:{port}/metrics"
                argv = [str(server_binary), "-m", str(model), "--parallel", str(slots), "-c", str(CTX * slots),
                        "-t", str(THREADS), "--host", "127.0.0.1", "--port", str(port), "--metrics",
                        *([] if repack else ["--no-repack"]), *row.server_args]
                self.children.append(ChildProcess(f"{row.name} at {slots} slots", argv, log_path=log))

    def stop(self) -> None:
        for child in self.children:
            child.stop()


@dataclass(frozen=True)
class Plan:
    concurrency: list[int]
    rounds: int
    max_tokens: dict[str, int]              # per workload
    quick: bool

    def per_client(self, clients: int) -> int:
        return 1 if self.quick else max(2, 4 // clients)


def workload_request(http: httpx.AsyncClient, workload: str, model: str, max_tokens: int) -> OneRequest:
    """Copy-heavy: a chat request (the model's template applies); free-form: the peers benchmark's completion."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if workload == "copy-heavy":
        return http_stream(http, "/v1/chat/completions", body,
                           lambda i: {"messages": [{"role": "user", "content": copy_prompt(i)}]})
    return http_stream(http, "/v1/completions", body, lambda i: {"prompt": peer_prompt(i)})


def _rotated(items: list[str], r: int) -> list[str]:
    return items[r % len(items):] + items[:r % len(items)]


async def run(quick: bool, *, concurrency: list[int] | None = None, rounds: int | None = None,
              draft_model: Path | None = None) -> tuple[dict[str, Any], str]:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    plan = Plan(concurrency or ([1] if quick else CONCURRENCY), rounds or (1 if quick else ROUNDS),
                QUICK_MAX_TOKENS if quick else MAX_TOKENS, quick)
    model = bundled_model_path()
    decision = decide_repack(CpuRepack.AUTO, this_cpu_flags())
    progress(decision.describe() + " (the same for every system)")
    notes: list[str] = []
    try:
        server_binary: Path | None = llama_server.find_or_build()
    except llama_server.Unavailable as exc:
        server_binary = None
        notes.append(f"llama-server was not measured: {exc}")
    if draft_model is None:
        notes.append("The draft-model rows were skipped: no --draft-model PATH (a small GGUF with the bundled model's "
                     "vocabulary) was given.")
    rows = systems(server_binary is not None, draft_model)
    for note in notes:
        progress(note)
    measured: dict[tuple[str, str, int], Measured] = {}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="slotq-bench-spec-") as tmp:
        redis = EmbeddedRedis(Path(tmp) / "redis")
        url = redis.start()
        gateway, gateway_port = gateway_process(Path(tmp), url)
        try:
            for c in plan.concurrency:
                fleet = Fleet(Path(tmp), url, model, c, rows, server_binary, decision.repack)
                try:
                    await run_watched(_at_concurrency(fleet, rows, gateway_port, c, plan, measured),
                                      *fleet.children, gateway)
                finally:
                    fleet.stop()
        finally:
            gateway.stop()
            redis.stop()
    results = [result_row(workload, row.name, c, measured[(workload, row.name, c)])
               for workload in WORKLOADS for c in plan.concurrency for row in rows
               if (workload, row.name, c) in measured]
    notes += _counter_notes(results)
    notes.append(f"Load average (1 min) {load_before:.1f} before the run, {os.getloadavg()[0]:.1f} after; "
                 f"{THREADS} threads per system; tokens per request: "
                 + ", ".join(f"{workload} {n}" for workload, n in plan.max_tokens.items()) + ".")
    data = {"model": model.name, "max_tokens": plan.max_tokens, "threads": THREADS, "repack": decision.repack,
            "rounds": plan.rounds, "draft_model": str(draft_model) if draft_model else None,
            "results": results, "notes": notes}
    text = table(results, notes)
    if not quick:
        write_results("spec", data, text, _command(plan, draft_model))
    return data, text


def _command(plan: Plan, draft_model: Path | None) -> str:
    """The command line that measured the results, for bench/results/spec.md."""
    return ("slotq bench spec" + (f" --concurrency {','.join(map(str, plan.concurrency))}"
                                  if plan.concurrency != CONCURRENCY else "")
            + (f" --rounds {plan.rounds}" if plan.rounds != ROUNDS else "")
            + (f" --draft-model {draft_model.name}" if draft_model else ""))


def _counter_notes(results: list[dict[str, Any]]) -> list[str]:
    unreported = sorted({r["system"] for r in results if r["draft_tokens"] is None and r["system"] != SLOTQ_OFF
                         and r["system"] != LLAMA_PLAIN})
    if not unreported:
        return []
    counters = f"{SLOTQ_COUNTERS[1]} or {LLAMA_COUNTERS[1]}"
    return [f"No draft acceptance from {', '.join(unreported)}: no draft counters in its /metrics ({counters})."]


async def _at_concurrency(fleet: Fleet, rows: list[System], gateway_port: int, c: int, plan: Plan,
                          measured: dict[tuple[str, str, int], Measured]) -> None:
    # A new connection per request for every system alike, as in the peers benchmark (llama-server's
    # HTTP library closes a kept-alive connection after a few requests).
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    gateway = httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway_port}", timeout=600, limits=limits)
    https = {name: httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits)
             for name, port in fleet.server_ports.items()}
    scraper = httpx.AsyncClient(timeout=30)
    try:
        progress(f"concurrency {c}: starting {len(fleet.children)} systems with {c} slots each")
        keys = [row.key for row in rows if row.is_slotq]
        await _wait_http(gateway, "/health",
                         lambda r: r.status_code == 200 and all(k in r.json().get("models", {}) for k in keys))
        for http in https.values():
            await _wait_http(http, "/health", lambda r: r.status_code == 200)
        present = [row for row in rows if row.is_slotq or row.name in https]
        requests = {(workload, row.name): workload_request(gateway if row.is_slotq else https[row.name], workload,
                                                           row.key if row.is_slotq else "model",
                                                           plan.max_tokens[workload])
                    for workload in WORKLOADS for row in present}
        counters = {row.name: SpecCounters(scraper, fleet.metrics_urls[row.name],
                                           SLOTQ_COUNTERS if row.is_slotq else LLAMA_COUNTERS) for row in present}
        for n, ((_, name), one) in enumerate(requests.items()):     # warm-up: one request each, not measured
            counters[name].tokens_received += (await one(900_000 + c * 100 + n)).tokens
        names = [row.name for row in present]
        for r in range(plan.rounds):
            for workload in _rotated(WORKLOADS, r):
                for name in _rotated(names, r):
                    progress(f"concurrency {c}, round {r + 1}/{plan.rounds}, {workload}: {name}")
                    m = measured.setdefault((workload, name, c), Measured())
                    before = await counters[name].read()
                    rate, samples = await closed_loop(requests[(workload, name)], c, plan.per_client(c),
                                                      first=(c * 100 + r) * 1000)
                    counters[name].tokens_received += sum(s.tokens for s in samples)
                    m.add_counts(before, await counters[name].read())
                    m.rates.append(rate)
                    m.samples.extend(samples)
    finally:
        for http in (gateway, scraper, *https.values()):
            await http.aclose()


def result_row(workload: str, system: str, c: int, m: Measured) -> dict[str, Any]:
    ms = lambda values, q: round(percentile(values, q) * 1000, 1) if values else None   # noqa: E731
    ttfts = [s.ttft_s for s in m.samples]
    # each stream's speed after its first token: what drafting changes, without the prefill
    decode_rates = [(s.tokens - 1) / (s.latency_s - s.ttft_s) for s in m.samples
                    if s.tokens > 1 and s.latency_s > s.ttft_s]
    rate = acceptance(m.draft_tokens, m.accepted_tokens)
    return {"workload": workload, "system": system, "concurrency": c,
            "tokens_per_s": round(sum(m.rates) / len(m.rates), 1),
            "ttft_p50_ms": ms(ttfts, 50), "ttft_p95_ms": ms(ttfts, 95),
            "stream_decode_tokens_per_s_p50": round(percentile(decode_rates, 50), 1) if decode_rates else None,
            "tokens_per_request": round(sum(s.tokens for s in m.samples) / len(m.samples), 1) if m.samples else None,
            "draft_tokens": m.draft_tokens, "accepted_tokens": m.accepted_tokens,
            "acceptance": round(rate, 3) if rate is not None else None}
