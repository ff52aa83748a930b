"""``slotq bench bulk``: what offline bulk processing gets out of the fleet, and what it costs the
live traffic beside it.

One invocation, the bundled model, a ``slotq worker`` subprocess with ``SLOTS`` slots:

* **throughput**: the same batch of requests (distinct prompts, fixed output length) submitted all
  at once to an in-process engine with the same slots, and run through Redis by ``slotq bulk`` (a
  subprocess). Rounds alternate the two, so a busy neighbour on a shared machine does not favour
  one; medians are reported. Target: bulk >= 0.95 x the engine.
* **interactive TTFT**: one interactive job at a time (enqueue to first streamed token), on the
  idle fleet and while a bulk run (output lengths spread over a quarter to all of ``max_tokens``)
  keeps every slot busy with jobs still waiting in the bulk lane.
* **memory**: a ``slotq bulk`` run of ``RSS_LINES`` one-token lines: the command's peak RSS (it
  reports its own ``ru_maxrss``) and Redis ``used_memory`` sampled throughout, at its peak.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import distinct_prompt, markdown_table, percentile, progress, write_results
from engine import Engine, EngineConfig, GenerationRequest, SamplingParams, bundled_model_path
from jobs.bulk import BulkOptions
from jobs.client import SlotqClient
from jobs.redis_server import EmbeddedRedis
from jobs.schemas import EntryKind, JobRequest
from jobs.settings import ClientSettings, WorkerSettings
from jobs.watch import ChildExited, ChildProcess, run_watched

SLOTS = 8
CTX = 512
RSS_LINES = 100_000


def _request(i: int, max_tokens: int) -> dict[str, Any]:
    return {"prompt": distinct_prompt(i), "max_tokens": max_tokens, "ignore_eos": True, "sampling": {"temperature": 0}}


def _write_input(path: Path, first: int, count: int, max_tokens: int, *, varied: bool = False) -> Path:
    """``varied``: output lengths spread over max_tokens/4 .. max_tokens, as real bulk work ends at EOS
    at different lengths, so slots free one at a time rather than all together."""
    low = max(1, max_tokens // 4)
    with open(path, "w") as f:
        for i in range(first, first + count):
            length = low + (i * 37) % (max_tokens - low + 1) if varied else max_tokens
            f.write(json.dumps(_request(i, length)) + "\n")
    return path


def _write_short_lines(path: Path, count: int) -> Path:
    """One-token lines with a prompt of a token or two, so the model gets through them quickly."""
    with open(path, "w") as f:
        for i in range(count):
            f.write(json.dumps({"prompt": str(i), "max_tokens": 1}) + "\n")
    return path


async def _engine_tokens_per_s(engine: Engine, first: int, count: int, max_tokens: int) -> float:
    """Every request submitted at once: the slots stay full until the queue drains."""
    async def one(i: int) -> int:
        request = GenerationRequest(**_request(i, max_tokens) | {"sampling": SamplingParams(temperature=0)})
        return sum([e.usage.completion_tokens async for e in engine.generate(request) if e.kind == "finished"])

    started = time.perf_counter()
    tokens = await asyncio.gather(*(one(i) for i in range(first, first + count)))
    return sum(tokens) / (time.perf_counter() - started)


class _Bulk:
    """``slotq bulk`` subprocesses on one Redis, watched like the worker."""

    def __init__(self, env: dict[str, str], tmp: Path) -> None:
        self.env = env
        self.tmp = tmp
        self.children: list[ChildProcess] = []

    def start(self, inp: Path) -> ChildProcess:
        n = len(self.children) + 1
        child = ChildProcess(f"slotq bulk ({inp.name})", [sys.executable, "-m", "jobs.cli", "bulk", str(inp), "-o",
                                                          str(self.tmp / f"bulk-{n}.out.jsonl"), "--json"],
                             env=self.env, log_path=self.tmp / f"bulk-{n}.log")
        self.children.append(child)
        return child

    def stop_all(self) -> None:
        for child in self.children:
            child.stop()

    async def finish(self, child: ChildProcess) -> dict[str, Any]:
        """The run's JSON summary (its last line of output)."""
        while child.proc.poll() is None:
            await asyncio.sleep(0.05)
        code = child.stop()
        if code != 0:
            raise ChildExited(child.report())
        text = child.log_path.read_text()
        return json.loads(text[text.rindex("\n{"):] if "\n{" in text else text)


async def _ttft_ms(client: SlotqClient, i: int) -> float:
    started = time.perf_counter()
    job = await client.enqueue(JobRequest(**_request(10_000_000 + i, 8)))
    async for entry in job.stream():
        if entry.kind == EntryKind.CHUNK:
            return (time.perf_counter() - started) * 1000
    raise RuntimeError(f"interactive job {job.id} ended without a token")


async def _bulk_lane(client: SlotqClient) -> tuple[int, int]:
    lane = {c.lane: c for c in await client.queue.counts()}["bulk"]
    return lane.running, lane.waiting


async def run(quick: bool) -> tuple[dict[str, Any], str]:
    rounds, batch, max_tokens = (1, 16, 16) if quick else (3, 32, 64)
    rss_lines = 500 if quick else RSS_LINES
    probes = 3 if quick else 8
    model = bundled_model_path()
    # The worker's settings, read as the worker reads them (SLOTQ_THREADS etc. from the environment),
    # so the in-process engine runs with exactly the worker's engine configuration.
    config = WorkerSettings(model=str(model), slots=SLOTS, ctx=CTX, prefix_cache=False).engine_config()
    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as tmp_name:
        tmp = Path(tmp_name)
        server = EmbeddedRedis(tmp / "redis")
        url = server.start()
        env = {**os.environ, "SLOTQ_REDIS_URL": url, "SLOTQ_MODEL": str(model), "SLOTQ_SLOTS": str(SLOTS),
               "SLOTQ_CTX": str(CTX), "SLOTQ_PREFIX_CACHE": "false", "COLUMNS": "200"}
        worker = ChildProcess("the benchmark's worker (slotq worker)", [sys.executable, "-m", "jobs.cli", "worker"],
                              env=env, log_path=tmp / "worker.log")
        try:
            data = await run_watched(_measure(url, config, tmp, _Bulk(env, tmp), rounds, batch, max_tokens,
                                              rss_lines, probes), worker)
        finally:
            worker.stop()
            server.stop()
    table = _table(data)
    if not quick:
        write_results("bulk", data, table, "slotq bench bulk")
    return {k: data[k] for k in ("bulk_tokens_per_s", "engine_tokens_per_s", "interactive_ttft_p50_ms_idle",
                                 "interactive_ttft_p50_ms_saturated", "peak_rss_mb", "redis_peak_mb", "lines")}, table


async def _measure(url: str, config: EngineConfig, tmp: Path, bulk: _Bulk, rounds: int, batch: int, max_tokens: int,
                   rss_lines: int, probes: int) -> dict[str, Any]:
    client = await SlotqClient.connect(url, ClientSettings(redis_url=url))
    engine = await Engine.start(config)
    try:
        progress("waiting for the worker to load the model")
        while not (await client.queue_info()).workers:
            await asyncio.sleep(0.2)
        engine_tps, bulk_tps = [], []
        for r in range(rounds):
            first = r * batch
            progress(f"round {r + 1}/{rounds}: {batch} requests x {max_tokens} tokens, engine in-process")
            engine_tps.append(await _engine_tokens_per_s(engine, first, batch, max_tokens))
            progress(f"round {r + 1}/{rounds}: the same through slotq bulk")
            summary = await bulk.finish(bulk.start(_write_input(tmp / f"tput-{r}.jsonl", first, batch, max_tokens)))
            bulk_tps.append(summary["completion_tokens"] / summary["wall_s"])

        progress(f"interactive TTFT on the idle fleet ({probes} jobs, one at a time)")
        idle = [await _ttft_ms(client, i) for i in range(probes)]

        progress("interactive TTFT while a bulk run saturates the fleet")
        child = bulk.start(_write_input(tmp / "saturate.jsonl", 100_000, 12 * SLOTS, max_tokens, varied=True))
        while (await _bulk_lane(client))[0] < SLOTS:
            await asyncio.sleep(0.02)
        saturated = []
        while len(saturated) < probes and (await _bulk_lane(client))[1] > 0:
            saturated.append(await _ttft_ms(client, probes + len(saturated)))
        await bulk.finish(child)
        if len(saturated) < probes:
            progress(f"only {len(saturated)} probes ran while bulk jobs were waiting")

        progress(f"memory: slotq bulk on {rss_lines:,} one-token lines")
        rss_run = await _memory_run(client, bulk, _write_short_lines(tmp / "rss.jsonl", rss_lines))
    finally:
        bulk.stop_all()
        await engine.close()
        await client.close()
    return {
        "bulk_tokens_per_s": round(statistics.median(bulk_tps), 1),
        "engine_tokens_per_s": round(statistics.median(engine_tps), 1),
        "interactive_ttft_p50_ms_idle": round(percentile(idle, 50), 1),
        "interactive_ttft_p50_ms_saturated": round(percentile(saturated, 50), 1),
        "peak_rss_mb": rss_run["peak_rss_mb"], "redis_peak_mb": rss_run["redis_peak_mb"], "lines": rss_lines,
        "rounds": {"engine_tokens_per_s": [round(x, 1) for x in engine_tps],
                   "bulk_tokens_per_s": [round(x, 1) for x in bulk_tps]},
        "ttft_ms": {"idle": [round(x, 1) for x in idle], "saturated": [round(x, 1) for x in saturated]},
        "memory_run": rss_run, "slots": SLOTS, "window": BulkOptions().window, "max_tokens": max_tokens, "batch": batch,
    }


async def _memory_run(client: SlotqClient, bulk: _Bulk, inp: Path) -> dict[str, Any]:
    """Run ``inp`` through ``slotq bulk`` while sampling Redis's used_memory and the command's RSS."""
    baseline = int((await client.redis.info("memory"))["used_memory"])
    child = bulk.start(inp)
    redis_peak, rss_samples = baseline, []
    started = time.monotonic()
    while child.proc.poll() is None:
        redis_peak = max(redis_peak, int((await client.redis.info("memory"))["used_memory"]))
        rss = _rss_mb(child.proc.pid)
        if rss is not None:
            rss_samples.append((round(time.monotonic() - started, 1), rss))
        await asyncio.sleep(0.25)
    summary = await bulk.finish(child)
    if not summary["all_succeeded"]:
        raise RuntimeError(f"the memory run did not finish every line: {summary}")
    return {"peak_rss_mb": summary["peak_rss_mb"], "redis_peak_mb": round(redis_peak / 2**20, 2),
            "redis_baseline_mb": round(baseline / 2**20, 2), "wall_s": summary["wall_s"],
            "lines_per_s": round(summary["total"] / summary["wall_s"], 1),
            "rss_mb_over_time": rss_samples[:: max(1, len(rss_samples) // 10)]}


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def _table(d: dict[str, Any]) -> str:
    m = d["memory_run"]
    rows = [
        ["bulk throughput", f"{d['bulk_tokens_per_s']:.1f} tok/s",
         f"{d['bulk_tokens_per_s'] / d['engine_tokens_per_s']:.3f} x the engine in-process "
         f"({d['engine_tokens_per_s']:.1f} tok/s, {d['slots']} slots full)"],
        ["interactive TTFT p50, idle fleet", f"{d['interactive_ttft_p50_ms_idle']:.0f} ms", ""],
        ["interactive TTFT p50, bulk saturating", f"{d['interactive_ttft_p50_ms_saturated']:.0f} ms",
         f"{d['interactive_ttft_p50_ms_saturated'] / d['interactive_ttft_p50_ms_idle']:.2f} x idle"],
        [f"slotq bulk peak RSS, {d['lines']:,} lines", f"{d['peak_rss_mb']:.0f} MB",
         "RSS over time (s, MB): " + ", ".join(f"{t:g}: {v:.0f}" for t, v in m["rss_mb_over_time"])],
        ["Redis used_memory peak", f"{d['redis_peak_mb']:.1f} MB",
         f"baseline {m['redis_baseline_mb']:.1f} MB; window {d['window']} lines; {m['lines_per_s']:.0f} lines/s"],
    ]
    return markdown_table(["what", "figure", "detail"], rows).replace("|---:|---:|---:|", "|:---|---:|:---|")
