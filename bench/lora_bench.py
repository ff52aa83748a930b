"""``slotq bench lora``: what serving LoRA adapters per request costs, slotq beside llama-server.

One LoRA adapter for the bundled SmolLM2-135M-Instruct, written for the run (rank 16 on every
layer's ``attn_q`` and ``attn_v``, as a typical fine-tune; random weights: its text is not the point,
its cost is). Both systems load it at start-up and apply it only to the requests that ask for it:

- ``slotq-redis``: a ``slotq worker`` with ``SLOTQ_LORA`` (8 slots); the client enqueues through
  Redis and reads the job's stream; the adapter by llama-server's ``lora`` field;
- ``llama-server``: ``--lora FILE --lora-init-without-apply --parallel 8``, built from the llama.cpp
  that llama-cpp-python vendors (:mod:`bench.llama_server`), ``POST /v1/completions`` with
  ``"lora": [{"id": 0, "scale": 1}]``, and a base request with ``"lora": [{"id": 0, "scale": 0}]``:
  ``--lora-init-without-apply`` leaves the adapter's global scale at 1 (``GET /lora-adapters`` says
  so), and a request without ``lora`` (or with ``"lora": []``) runs at the global scales, so it gets
  the adapter (llama.cpp #28674). Before the run, each of :data:`CLIENTS` prompts goes to llama-server
  alone (a batch of one: the same tokens every time) with and without the adapter, and the benchmark
  says for how many the adapter changed the text: 0 means both bodies got the same model and its
  loads compare nothing.

Loads, each the same 8 closed-loop clients (``bench.peers_bench``'s prompts of three lengths, greedy,
:data:`MAX_TOKENS` generated exactly): ``base`` (no request names the adapter), ``mixed`` (every
other request does: the issue's target, mixed >= 0.8 x base on slotq), ``adapter`` (every request
does). ``adapter / base`` is what computing the adapter costs; ``mixed`` against both is what
running two adapter sets costs: llama.cpp applies adapters per context, so each decode step of
either system runs one set (slotq's sets take turns, engine.scheduler rule 10; llama-server's
``server_slot::can_batch_with`` batches only slots whose sets are equal, and the set of its
lowest-numbered generating slot goes first). Each system runs every load in every round, in a
rotated order (the machine is shared); tokens/s is the mean of the rounds.

Where the time goes, from each system's Prometheus counters read before and after every load (summed
over the rounds): decode steps and tokens per step (both systems), wall time per step, and for slotq
the switches between adapter sets (``slotq_lora_switches_total``), steps per turn, and the decode time
of a step right after a switch against the other steps' (llama.cpp reserves its graph again after a
switch): that difference times the switches is what switching cost. ``mixed / base`` then splits
exactly into (base steps / mixed steps) x (base time per step / mixed time per step): the load ran
more, smaller steps, and each step cost less or more.
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

from bench import llama_server
from bench.overhead_bench import _rotated, _tiny_model_module
from bench.peers_bench import OneRequest, Sample, _wait_http, closed_loop, peer_prompt
from bench.queue_bench import timed_job
from bench.report import markdown_table, progress, write_results
from bench.spec_bench import scrape
from slotq.engine import bundled_model_path
from slotq.engine.config import CpuRepack
from slotq.engine.cpu_features import decide_repack, this_cpu_flags
from slotq.jobs.cli.watch import ChildProcess, run_watched
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.schemas import JobRequest
from slotq.jobs.protocol.wire import LoraRef
from slotq.jobs.redis_server import EmbeddedRedis, free_port
from slotq.jobs.settings import ClientSettings

CLIENTS = 8
MAX_TOKENS = 64
CTX = 1024
ROUNDS = 2
RANK = 16
THREADS = len(os.sched_getaffinity(0)) or 1
SYSTEMS = ["slotq-redis", "llama-server"]
LOADS = {"base": 0, "mixed": 2, "adapter": 1}     # load -> every how manyth request names the adapter (0: none)
TARGET = 0.8                                      # the issue's: mixed >= 0.8 x base
COUNTERS = {                                      # what each system's /metrics says of a load (summed over labels)
    "slotq-redis": {"tokens": "slotq_tokens_predicted_total", "steps": "slotq_n_decode_total",
                    "decode_s": "slotq_decode_seconds_total", "switches": "slotq_lora_switches_total",
                    "switch_s": "slotq_lora_switch_decode_seconds_total"},
    "llama-server": {"tokens": "llamacpp:tokens_predicted_total", "steps": "llamacpp:n_decode_total"},
}
COUNTER_WAIT_S = 10.0    # a worker samples its engine once a second: how long a reading waits to cover a load


def _uses_adapter(load: str, i: int) -> bool:
    every = LOADS[load]
    return every > 0 and i % every == 0


def _slotq(client: SlotqClient, load: str) -> OneRequest:
    async def one(i: int) -> Sample:
        started = time.perf_counter()
        lora = [LoraRef(id=0)] if _uses_adapter(load, i) else []
        timed = await timed_job(client, JobRequest(prompt=peer_prompt(i), max_tokens=MAX_TOKENS, ignore_eos=True,
                                                   sampling={"temperature": 0}, lora=lora), started)
        return Sample(timed.first_s if timed.first_s is not None else float("nan"), time.perf_counter() - started,
                      timed.tokens)
    return one


def _llama_server(http: httpx.AsyncClient, load: str) -> OneRequest:
    async def one(i: int) -> Sample:
        started = time.perf_counter()
        reply = await _llama_server_completion(http, i, _uses_adapter(load, i))
        return Sample(float("nan"), time.perf_counter() - started, reply["usage"]["completion_tokens"])
    return one


async def _llama_server_completion(http: httpx.AsyncClient, i: int, adapter: bool, cache_prompt: bool = True
                                   ) -> dict[str, Any]:
    """Prompt ``i`` greedy, with the adapter at scale 1 or explicitly at 0 (the module docstring says why
    omitting ``lora`` is not the base model); llama-server's reply."""
    body = {"model": "model", "prompt": peer_prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "lora": [{"id": 0, "scale": 1.0 if adapter else 0.0}], "cache_prompt": cache_prompt}
    response = await http.post("/v1/completions", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"llama-server: HTTP {response.status_code}: {response.text[:300]}")
    reply: dict[str, Any] = json.loads(response.text)
    return reply


async def _adapter_changes(http: httpx.AsyncClient) -> int:
    """Of :data:`CLIENTS` prompts, each sent to llama-server alone with and without the adapter, how many
    came back with other text: 0 means the base and the adapter bodies got the same model. Without llama-server's
    prompt cache: the second request would decode only the prompt's last token, which alone changes the text at
    near ties even under the same model."""
    changed = 0
    for k in range(CLIENTS):
        texts = [(await _llama_server_completion(http, 800_000 + k, adapter, cache_prompt=False))["choices"][0]["text"]
                 for adapter in (False, True)]
        changed += texts[0] != texts[1]
    return changed


async def run(quick: bool) -> tuple[dict[str, Any], str]:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    rounds = 1 if quick else ROUNDS
    per_client = 1 if quick else 3
    model = bundled_model_path()
    repack = decide_repack(CpuRepack.AUTO, this_cpu_flags()).repack
    skipped: dict[str, str] = {}
    try:
        server_binary: Path | None = llama_server.find_or_build()
    except llama_server.Unavailable as exc:
        server_binary = None
        skipped["llama-server"] = str(exc)
    with tempfile.TemporaryDirectory(prefix="slotq-bench-lora-") as tmp_name:
        tmp = Path(tmp_name)
        adapter = _tiny_model_module().write_lora(tmp / "adapter.gguf", model, rank=RANK, alpha=float(RANK),
                                                  scale=0.02, targets=("attn_q", "attn_v"))
        metrics_port = free_port()
        redis = EmbeddedRedis(tmp / "redis")
        url = redis.start()
        env = {**os.environ, "SLOTQ_REDIS_URL": url, "SLOTQ_MODEL": str(model), "SLOTQ_SLOTS": str(CLIENTS),
               "SLOTQ_CTX": str(CTX), "SLOTQ_THREADS": str(THREADS), "SLOTQ_LOG_LEVEL": "WARNING",
               "SLOTQ_ELASTIC": "false", "SLOTQ_CPU_REPACK": "on" if repack else "off",
               "SLOTQ_QUEUE_NAME": "lora", "SLOTQ_MODEL_NAME": "lora", "SLOTQ_LORA": f"style={adapter}",
               "SLOTQ_METRICS_PORT": str(metrics_port)}
        children = [ChildProcess("slotq worker (SLOTQ_LORA)", [sys.executable, "-m", "slotq.jobs.cli", "worker"],
                                 env=env, log_path=tmp / "worker.log")]
        port = free_port()
        if server_binary is not None:
            children.append(ChildProcess("llama-server --lora", [
                str(server_binary), "-m", str(model), "--lora", str(adapter), "--lora-init-without-apply",
                "--parallel", str(CLIENTS), "-c", str(CTX * CLIENTS), "-t", str(THREADS), "--host", "127.0.0.1",
                "--port", str(port), "--metrics", *([] if repack else ["--no-repack"])],
                log_path=tmp / "llama-server.log"))
        try:
            rates, counts, changed = await run_watched(
                _measure(url, metrics_port, port if server_binary else None, rounds, per_client), *children)
        finally:
            for child in children:
                child.stop()
            redis.stop()
    results = [{"system": system, "load": load, "tokens_per_s": round(sum(values) / len(values), 1),
                "rounds": [round(v, 1) for v in values]} for (system, load), values in rates.items()]
    costs = [{"system": system, "load": load, **_costs(values)} for (system, load), values in counts.items()]
    data = {"model": model.name, "clients": CLIENTS, "max_tokens": MAX_TOKENS, "threads": THREADS, "rank": RANK,
            "results": results, "where_the_time_goes": costs, "skipped": skipped,
            "llama_server_adapter_changes": changed}
    text = _table(results, skipped) + "\n\n" + _costs_table(costs)
    if changed is not None:
        text += (f"\n\nllama-server alone, with and without the adapter: {changed} of {CLIENTS} prompts' text "
                 f"changed{' (0: both got the same model, its loads compare nothing)' if not changed else ''}")
    if not quick:
        write_results("lora", data, text, "slotq bench lora")
    return data, text


async def _measure(url: str, metrics_port: int, server_port: int | None, rounds: int, per_client: int
                   ) -> tuple[dict[tuple[str, str], list[float]], dict[tuple[str, str], dict[str, float]], int | None]:
    """Each load's tokens/s per round, each load's counters (:data:`COUNTERS`) summed over the rounds,
    with its wall time (``wall_s``), and :func:`_adapter_changes` (None without llama-server)."""
    client = await SlotqClient.connect(url, ClientSettings(redis_url=url, queue_name="lora"))
    # a new connection per request: llama-server closes a kept-alive one after a few (bench.peers_bench)
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{server_port}", timeout=600,
                             limits=httpx.Limits(max_connections=64, max_keepalive_connections=0))
    metrics = httpx.AsyncClient(timeout=30)
    urls = {"slotq-redis": f"http://127.0.0.1:{metrics_port}/metrics",
            "llama-server": f"http://127.0.0.1:{server_port}/metrics"}

    async def read(system: str, tokens_at_least: float = 0.0) -> dict[str, float]:
        """The system's counters, once its token counter reaches ``tokens_at_least`` (or after COUNTER_WAIT_S)."""
        give_up = time.monotonic() + COUNTER_WAIT_S
        while True:
            values = scrape((await metrics.get(urls[system])).text)
            counted = {key: values.get(name, 0.0) for key, name in COUNTERS[system].items()}
            if counted["tokens"] >= tokens_at_least or time.monotonic() > give_up:
                return counted
            await asyncio.sleep(0.2)

    try:
        while not any(w.ready for w in (await client.queue_info()).workers):
            await asyncio.sleep(0.3)
        paths = {("slotq-redis", load): _slotq(client, load) for load in LOADS}
        changed = None
        if server_port is not None:
            await _wait_http(http, "/health", lambda r: r.status_code == 200)
            paths |= {("llama-server", load): _llama_server(http, load) for load in LOADS}
            changed = await _adapter_changes(http)
        for n, one in enumerate(paths.values()):         # warm-up: one request each, not measured
            await one(900_000 + n)
        rates: dict[tuple[str, str], list[float]] = {key: [] for key in paths}
        counts: dict[tuple[str, str], dict[str, float]] = {}
        for r in range(rounds):
            for key in _rotated(list(paths), r):
                progress(f"round {r + 1}/{rounds}: {key[0]}, {key[1]} load")
                first = (r * len(LOADS) + list(LOADS).index(key[1])) * 1000     # both systems alike; never twice
                before = await read(key[0])
                started = time.perf_counter()
                rate, samples = await closed_loop(paths[key], CLIENTS, per_client, first=first)
                wall = time.perf_counter() - started
                after = await read(key[0], before["tokens"] + sum(s.tokens for s in samples))
                rates[key].append(rate)
                total = counts.setdefault(key, {"wall_s": 0.0})
                total["wall_s"] += wall
                for name in after:
                    total[name] = total.get(name, 0.0) + after[name] - before[name]
        return rates, counts, changed
    finally:
        await metrics.aclose()
        await http.aclose()
        await client.close()


def _costs(c: dict[str, float]) -> dict[str, float | None]:
    """One load's counters as figures: steps, tokens a step, wall ms a step; for slotq the decode share of
    the wall time, switches, steps per turn, a switch step's decode ms against the others', and the extra
    time the switches cost as a share of the wall time."""
    steps = c["steps"]
    out: dict[str, float | None] = {
        "steps": steps, "tokens": c["tokens"], "wall_s": round(c["wall_s"], 3),
        "tokens_per_step": round(c["tokens"] / steps, 2) if steps else None,
        "wall_ms_per_step": round(c["wall_s"] * 1000 / steps, 2) if steps else None}
    if "switches" in c and steps:
        switches = c["switches"]
        other_ms = (c["decode_s"] - c["switch_s"]) * 1000 / (steps - switches) if steps > switches else None
        switch_ms = c["switch_s"] * 1000 / switches if switches else None
        extra_s = switches * (switch_ms - other_ms) / 1000 if switch_ms is not None and other_ms is not None else 0.0
        out |= {"decode_share": round(c["decode_s"] / c["wall_s"], 3), "switches": switches,
                "steps_per_turn": round(steps / switches, 1) if switches else None,
                "switch_step_decode_ms": round(switch_ms, 2) if switch_ms is not None else None,
                "other_step_decode_ms": round(other_ms, 2) if other_ms is not None else None,
                "switch_extra_share": round(extra_s / c["wall_s"], 4)}
    return out


def _costs_table(costs: list[dict[str, Any]]) -> str:
    """Where the time goes, per system and load, and ``mixed / base`` split into fewer tokens a step and
    the cost of a step."""
    def cell(value: Any, form: str = "{:,.2f}") -> str:
        return "-" if value is None else form.format(value)

    by = {(c["system"], c["load"]): c for c in costs}
    rows = [[c["system"], c["load"], cell(c["steps"], "{:,.0f}"), cell(c["tokens_per_step"]),
             cell(c["wall_ms_per_step"]), cell(c.get("decode_share"), "{:.0%}"), cell(c.get("switches"), "{:,.0f}"),
             cell(c.get("steps_per_turn"), "{:.1f}"), cell(c.get("switch_step_decode_ms")),
             cell(c.get("other_step_decode_ms")), cell(c.get("switch_extra_share"), "{:.1%}")] for c in costs]
    table = markdown_table(["system", "load", "decode steps", "tokens / step", "wall ms / step", "decode share",
                            "adapter switches", "steps / turn", "switch step decode ms", "other steps decode ms",
                            "switches' extra time"], rows)
    notes = []
    for system in SYSTEMS:
        base, mixed = by.get((system, "base")), by.get((system, "mixed"))
        if not base or not mixed or not base["steps"] or not mixed["steps"]:
            continue
        fewer = base["steps"] / mixed["steps"] * mixed["tokens"] / base["tokens"]     # same tokens: base / mixed steps
        cheaper = base["wall_ms_per_step"] / mixed["wall_ms_per_step"]
        notes.append(f"{system}: mixed / base tokens/s {fewer * cheaper:.2f} = {fewer:.2f} (tokens per step: "
                     f"{mixed['tokens_per_step']:.2f} against {base['tokens_per_step']:.2f}) x {cheaper:.2f} (wall "
                     f"time per step: {mixed['wall_ms_per_step']:.2f} ms against {base['wall_ms_per_step']:.2f})")
    return table + "".join(f"\n\n{note}" for note in notes)


def _table(results: list[dict[str, Any]], skipped: dict[str, str]) -> str:
    tps = {(r["system"], r["load"]): r["tokens_per_s"] for r in results}
    rows = []
    for system in SYSTEMS:
        if system in skipped:
            continue
        base = tps.get((system, "base"))
        cells = [system]
        for load in LOADS:
            value = tps.get((system, load))
            ratio = f" ({value / base:.2f} x)" if value and base else ""
            cells.append(f"{value:,.0f}{ratio}" if value is not None else "-")
        peer = tps.get(("llama-server", "mixed"))
        mixed = tps.get((system, "mixed"))
        cells.append(f"{mixed / peer:.2f} x" if mixed and peer else "-")
        rows.append(cells)
    header = ["system", *(f"{load} tok/s (/ base)" for load in LOADS), "mixed / llama-server's mixed"]
    table = markdown_table(header, rows)
    note = (f"\n\n{CLIENTS} clients, {MAX_TOKENS} tokens each, one rank-{RANK} adapter on attn_q and attn_v; "
            f"target: mixed >= {TARGET} x base.")
    return table + note + "".join(f"\n\nskipped {system}: {reason}" for system, reason in skipped.items())
