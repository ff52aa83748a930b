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
* **long bulk jobs** (issue 20): ``SLOTS`` bulk jobs of ``LONG_TOKENS`` tokens (ignore_eos), alone
  and with occasional interactive jobs, in back-to-back pairs of runs: interactive TTFT p50/p95
  against the idle fleet's, and bulk tokens/s against bulk alone (the median of the pairs'
  mixed/alone ratios: this machine's speed drifts by 20 % within minutes, so each ratio compares
  two runs half a minute apart). A decode step of the full batch is ``SLOTS`` tokens at bulk
  alone's rate (the pair's for the gap below, the median for the target). "Occasional" is one interactive job every
  ``PROBE_GAP_STEPS`` such steps (start to start, sent only while bulk jobs hold every slot) for
  the whole mixed run: counted in steps, the interactive jobs take the same share of the worker on
  a fast machine and a slow one, where a gap in seconds made them 2.5 x as frequent on a machine
  2.5 x slower. Each interactive job runs in the worker's reserve (a spare KV stream) or, if that
  is taken, preempts a bulk job; the row says how many did which. Targets: saturated p95 <= idle
  p95 + 3 full-batch steps, bulk with interactive >= 0.95 x bulk alone.
* **a flooding tenant** (issue 20): tenant ``a`` queues ``FLOOD_JOBS`` interactive jobs (short,
  of spread lengths) and tenant ``b`` sends one job at a time while they wait, each once the one
  before has ended: b's single job, as the issue puts it (until 2026-12-02 the next was sent at the
  first token of the last, so b nearly always had a job running). Target: b's TTFT p50 <= 2 x the
  idle fleet's (its jobs sent the same way), measured around the flood (half the idle jobs just
  before it, half just after it is cancelled), again because the machine drifts. The row counts
  b's jobs that ran in the reserve lent for their tenant. The flood is cancelled afterwards.
* **bulk under saturating interactive load** (issue 32): ``CHAT_CLIENTS`` closed-loop interactive
  clients (twice the slots, so interactive jobs always wait) keep the worker full; bulk jobs of the
  throughput rows' shape are then enqueued into the bulk lane (as ``slotq bulk`` enqueues its lines)
  and timed to their end, against the same jobs on the idle worker just before. With strict lanes
  none would start while the interactive load lasts; with ``SLOTQ_LANE_MIN_SHARE`` (1/8: one of
  the ``SLOTS`` slots) bulk keeps its share. Reported: bulk's share of the slots (the running
  bulk jobs, sampled, over ``SLOTS``; target >= the configured share), its share of the tokens the
  worker generated meanwhile, and the worker's tokens/s then against bulk alone's (a new
  interactive prompt to prefill nearly every step slows the whole worker, which no share can
  change). The run stops at a bound (strict lanes would never end it) and reports what finished.
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
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench.report import distinct_prompt, markdown_table, percentile, progress, write_results
from slotq.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, bundled_model_path
from slotq.jobs.bulk import BulkOptions
from slotq.jobs.cli.watch import ChildExited, ChildProcess, run_watched
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.preemption import guaranteed_slots
from slotq.jobs.protocol.redis_queue import LaneCounts
from slotq.jobs.protocol.schemas import EntryKind, JobRequest
from slotq.jobs.redis_server import EmbeddedRedis, free_port
from slotq.jobs.settings import ClientSettings
from slotq.jobs.worker.settings import WorkerSettings

SLOTS = 8
CTX = 512
RSS_LINES = 5_000           # a minute or two on 2 cores; 100,000 lines (40 min) showed the same flat RSS
LONG_TOKENS = 300
PROBE_TOKENS = 8
PROBE_GAP_STEPS = 48        # "occasional" interactive traffic: one job per this many full-batch steps
                            # (1.5 s on the quiet machine of the first runs, 32 ms steps)
FLOOD_JOBS = 2_000
FLOOD_TOKENS = (8, 32)      # the flooding tenant's output lengths spread over this range
CHAT_CLIENTS = 2 * SLOTS    # closed-loop interactive clients that saturate the worker
CHAT_TOKENS = 16


def _request(i: int, max_tokens: int) -> dict[str, Any]:
    return {"prompt": distinct_prompt(i), "max_tokens": max_tokens, "ignore_eos": True, "sampling": {"temperature": 0}}


def _spread(i: int, low: int, high: int) -> int:
    """Output lengths spread over low..high, as real work ends at EOS at different lengths, so
    slots free one at a time rather than all together."""
    return low + (i * 37) % (high - low + 1)


def _write_input(path: Path, first: int, count: int, max_tokens: int, *, varied: bool = False) -> Path:
    """``varied``: output lengths spread over max_tokens/4 .. max_tokens (:func:`_spread`)."""
    with open(path, "w") as f:
        for i in range(first, first + count):
            length = _spread(i, max(1, max_tokens // 4), max_tokens) if varied else max_tokens
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
        argv = [sys.executable, "-m", "slotq.jobs.cli", "bulk", str(inp), "-o", str(self.tmp / f"bulk-{n}.out.jsonl"),
                "--json"]
        child = ChildProcess(f"slotq bulk ({inp.name})", argv, env=self.env, log_path=self.tmp / f"bulk-{n}.log")
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


async def _ttft_ms(client: SlotqClient, i: int, tenant: str = "default", *, whole: bool = False) -> float:
    """Enqueue to first streamed token of one interactive job of ``PROBE_TOKENS`` tokens."""
    return (await _probe(client, i, tenant, whole=whole))[0]


async def _probe(client: SlotqClient, i: int, tenant: str = "default", *, whole: bool = False) -> tuple[float, str]:
    """:func:`_ttft_ms` and the job's id (its result, once it ends, has the engine's own timings).
    ``whole``: return once the job has ended, so the next one is its tenant's only job."""
    started = time.perf_counter()
    job = await client.enqueue(JobRequest(**_request(10_000_000 + i, PROBE_TOKENS), tenant=tenant))
    async for entry in job.stream():
        if entry.kind == EntryKind.CHUNK:
            ms = (time.perf_counter() - started) * 1000
            if whole:
                await job.result(timeout=60)
            return ms, job.id
    raise RuntimeError(f"interactive job {job.id} ended without a token")


async def _saturated(client: SlotqClient) -> None:
    """Until a bulk run just started holds every slot."""
    while (await _lane(client, "bulk")).running < SLOTS:
        await asyncio.sleep(0.02)


async def _lane(client: SlotqClient, name: str) -> LaneCounts:
    return {c.lane: c for c in await client.queue.counts()}[name]


@dataclass(frozen=True)
class Sizes:
    """How much of each workload one run measures (``--quick``: a smoke run, not for the README)."""

    rounds: int                 # alternating rounds of the throughput comparison
    long_rounds: int            # alternating rounds of long bulk alone / with interactive jobs
    batch: int                  # requests per throughput round
    max_tokens: int             # their output length
    probes: int                 # interactive jobs per TTFT measurement
    long_tokens: int            # output length of a long bulk job
    flood_jobs: int             # the flooding tenant's waiting jobs
    starved_lines: int          # bulk jobs timed under saturating interactive load
    rss_lines: int              # lines of the memory run

    @classmethod
    def of(cls, quick: bool) -> Sizes:
        if quick:
            return cls(rounds=1, long_rounds=1, batch=16, max_tokens=16, probes=3, long_tokens=48, flood_jobs=200,
                       starved_lines=8, rss_lines=500)
        return cls(rounds=3, long_rounds=6, batch=32, max_tokens=64, probes=16, long_tokens=LONG_TOKENS,
                   flood_jobs=FLOOD_JOBS, starved_lines=16, rss_lines=RSS_LINES)


async def run(quick: bool) -> tuple[dict[str, Any], str]:
    sizes = Sizes.of(quick)
    model = bundled_model_path()
    # The worker's settings, read as the worker reads them (SLOTQ_THREADS etc. from the environment),
    # so the in-process engine runs with exactly the worker's engine configuration.
    # The prefix cache stays on, as a worker has it by default: a job handed back for an interactive one
    # resumes from its cells in a cache slot only with it (the prompts share no prefix worth reusing).
    worker_settings = WorkerSettings(model=str(model), slots=SLOTS, ctx=CTX)
    config = worker_settings.engine_config()
    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as tmp_name:
        tmp = Path(tmp_name)
        server = EmbeddedRedis(tmp / "redis")
        url = server.start()
        # Fixed slots (SLOTQ_ELASTIC off): the rows compare a worker whose every slot is busy with
        # the engine's SLOTS; on a busy shared machine the elastic controller would shrink them.
        env = {**os.environ, "SLOTQ_REDIS_URL": url, "SLOTQ_MODEL": str(model), "SLOTQ_SLOTS": str(SLOTS),
               "SLOTQ_CTX": str(CTX), "SLOTQ_ELASTIC": "false", "SLOTQ_METRICS_PORT": str(free_port()),
               "COLUMNS": "200"}
        worker = ChildProcess("the benchmark's worker (slotq worker)",
                              [sys.executable, "-m", "slotq.jobs.cli", "worker"],
                              env=env, log_path=tmp / "worker.log")
        try:
            metrics_url = f"http://127.0.0.1:{env['SLOTQ_METRICS_PORT']}/metrics"
            data = await run_watched(_measure(url, metrics_url, config, tmp, _Bulk(env, tmp), sizes,
                                              worker_settings.lane_min_share), worker)
        finally:
            worker.stop()
            server.stop()
    table = _table(data)
    if not quick:
        write_results("bulk", data, table, "slotq bench bulk")
    return {k: data[k] for k in ("bulk_tokens_per_s", "engine_tokens_per_s", "interactive_ttft_p50_ms_idle",
                                 "interactive_ttft_p50_ms_saturated", "long_bulk", "flood", "starved", "peak_rss_mb",
                                 "redis_peak_mb", "lines")}, table


async def _measure(url: str, metrics_url: str, config: EngineConfig, tmp: Path, bulk: _Bulk,
                   sizes: Sizes, lane_min_share: float) -> dict[str, Any]:
    client = await SlotqClient.connect(url, ClientSettings(redis_url=url))
    engine = await Engine.start(config)
    batch, max_tokens, probes = sizes.batch, sizes.max_tokens, sizes.probes
    try:
        progress("waiting for the worker to load the model")
        while not (await client.queue_info()).workers:
            await asyncio.sleep(0.2)
        engine_tps, bulk_tps = [], []
        for r in range(sizes.rounds):
            first = r * batch
            progress(f"round {r + 1}/{sizes.rounds}: {batch} requests x {max_tokens} tokens, engine in-process")
            engine_tps.append(await _engine_tokens_per_s(engine, first, batch, max_tokens))
            progress(f"round {r + 1}/{sizes.rounds}: the same through slotq bulk")
            summary = await bulk.finish(bulk.start(_write_input(tmp / f"tput-{r}.jsonl", first, batch, max_tokens)))
            bulk_tps.append(summary["completion_tokens"] / summary["wall_s"])

        progress(f"interactive TTFT on the idle fleet ({probes} jobs, one at a time)")
        idle = [await _ttft_ms(client, i) for i in range(probes)]

        progress("interactive TTFT while a bulk run saturates the fleet")
        child = bulk.start(_write_input(tmp / "saturate.jsonl", 100_000, 12 * SLOTS, max_tokens, varied=True))
        await _saturated(client)
        saturated = []
        while len(saturated) < probes and (await _lane(client, "bulk")).waiting > 0:
            saturated.append(await _ttft_ms(client, probes + len(saturated)))
        await bulk.finish(child)
        if len(saturated) < probes:
            progress(f"only {len(saturated)} probes ran while bulk jobs were waiting")

        long_bulk = await _long_bulk(client, metrics_url, bulk, tmp, sizes, idle)
        flood = await _flood(client, metrics_url, sizes)
        starved = await _starved(client, sizes, lane_min_share)

        progress(f"memory: slotq bulk on {sizes.rss_lines:,} one-token lines")
        rss_run = await _memory_run(client, bulk, _write_short_lines(tmp / "rss.jsonl", sizes.rss_lines))
    finally:
        bulk.stop_all()
        await engine.close()
        await client.close()
    return {
        "bulk_tokens_per_s": round(statistics.median(bulk_tps), 1),
        "engine_tokens_per_s": round(statistics.median(engine_tps), 1),
        "interactive_ttft_p50_ms_idle": round(percentile(idle, 50), 1),
        "interactive_ttft_p95_ms_idle": round(percentile(idle, 95), 1),
        "interactive_ttft_p50_ms_saturated": round(percentile(saturated, 50), 1),
        "long_bulk": long_bulk, "flood": flood, "starved": starved,
        "peak_rss_mb": rss_run["peak_rss_mb"], "redis_peak_mb": rss_run["redis_peak_mb"], "lines": sizes.rss_lines,
        "rounds": {"engine_tokens_per_s": [round(x, 1) for x in engine_tps],
                   "bulk_tokens_per_s": [round(x, 1) for x in bulk_tps]},
        "ttft_ms": {"idle": [round(x, 1) for x in idle], "saturated": [round(x, 1) for x in saturated]},
        "memory_run": rss_run, "slots": SLOTS, "window": BulkOptions().window, "max_tokens": max_tokens, "batch": batch,
    }


async def _long_bulk(client: SlotqClient, metrics_url: str, bulk: _Bulk, tmp: Path, sizes: Sizes,
                     idle: list[float]) -> dict[str, Any]:
    """Long bulk jobs alone and with occasional interactive jobs, rounds alternating: what the
    interactive jobs wait (preemption's job) and what it costs the bulk run."""
    jobs = SLOTS
    alone_tps, mixed_tps, ttft, preempted_before = [], [], [], await _preempted(client)
    reserve_before = await _reserve_runs(metrics_url)
    for r in range(sizes.long_rounds):
        first = 200_000 + 2 * r * jobs
        progress(f"long bulk round {r + 1}/{sizes.long_rounds}: {jobs} jobs x {sizes.long_tokens} tokens, alone")
        summary = await bulk.finish(bulk.start(_write_input(tmp / f"long-{r}.jsonl", first, jobs, sizes.long_tokens)))
        alone_tps.append(summary["completion_tokens"] / summary["wall_s"])
        gap_s = PROBE_GAP_STEPS * SLOTS / alone_tps[-1]
        progress(f"long bulk round {r + 1}/{sizes.long_rounds}: the same, an interactive job every "
                 f"{PROBE_GAP_STEPS} steps ({gap_s:.1f} s)")
        child = bulk.start(_write_input(tmp / f"long-mixed-{r}.jsonl", first + jobs, jobs, sizes.long_tokens))
        await _saturated(client)
        while await _bulk_holds_every_slot(client, child):
            sent = time.perf_counter()
            ttft.append(await _ttft_ms(client, 1_000 + len(ttft)))
            await asyncio.sleep(max(0.0, gap_s - (time.perf_counter() - sent)))
        summary = await bulk.finish(child)
        mixed_tps.append(summary["completion_tokens"] / summary["wall_s"])
    alone = statistics.median(alone_tps)
    step_ms = SLOTS / alone * 1000          # one decode step of the full batch, at bulk alone's rate
    return {
        "jobs": jobs, "max_tokens": sizes.long_tokens, "probes": len(ttft), "probe_gap_steps": PROBE_GAP_STEPS,
        "ttft_p50_ms": round(percentile(ttft, 50), 1), "ttft_p95_ms": round(percentile(ttft, 95), 1),
        "ttft_ms": [round(x, 1) for x in ttft], "full_batch_step_ms": round(step_ms, 1),
        "ttft_p95_target_ms": round(percentile(idle, 95) + 3 * step_ms, 1),
        "bulk_alone_tokens_per_s": round(alone, 1), "bulk_mixed_tokens_per_s": round(statistics.median(mixed_tps), 1),
        "mixed_over_alone": round(statistics.median(m / a for m, a in zip(mixed_tps, alone_tps)), 3),
        "rounds": {"alone": [round(x, 1) for x in alone_tps], "mixed": [round(x, 1) for x in mixed_tps]},
        "preemptions": await _preempted(client) - preempted_before,
        "reserve_runs": await _reserve_runs(metrics_url) - reserve_before,
    }


async def _bulk_holds_every_slot(client: SlotqClient, child: ChildProcess) -> bool:
    """Wait until bulk jobs hold every slot again (the last probe's slot went back to its victim);
    False once the run has too few jobs left to fill them."""
    while child.proc.poll() is None:
        lane = await _lane(client, "bulk")
        if lane.running >= SLOTS:
            return True
        if lane.running + lane.waiting < SLOTS:
            return False
        await asyncio.sleep(0.02)
    return False


async def _preempted(client: SlotqClient) -> int:
    return sum(lane.preempted for lane in await client.queue.counts())


async def _reserve_runs(metrics_url: str, family_name: str = "slotq_lane_reserve_runs") -> int:
    """Jobs the worker ran in its reserve beside a full batch, every lane, from its counter
    ``family_name``: for a higher lane ``slotq_lane_reserve_runs``, lent for their tenant
    ``slotq_tenant_reserve_runs`` (a reserve run is not a preemption, so the queue does not count it)."""
    def scrape() -> str:
        with urllib.request.urlopen(metrics_url, timeout=10) as response:
            body: bytes = response.read()
        return body.decode()

    families = text_string_to_metric_families(await asyncio.to_thread(scrape))
    return round(sum(sample.value for family in families if family.name == family_name
                     for sample in family.samples if sample.name == f"{family_name}_total"))


async def _flood(client: SlotqClient, metrics_url: str, sizes: Sizes) -> dict[str, Any]:
    """Tenant b's TTFT, one job at a time, while tenant a has ``flood_jobs`` jobs waiting in the
    same lane, against the idle worker's just before and just after; the flood is cancelled
    afterwards."""
    progress(f"interactive TTFT on the idle fleet before the flood ({sizes.probes // 2} jobs)")
    idle = [await _ttft_ms(client, 3_000 + i, whole=True) for i in range(sizes.probes // 2)]
    progress(f"tenant a queues {sizes.flood_jobs:,} interactive jobs; tenant b sends {sizes.probes}, one at a time")
    flood = [await client.enqueue(JobRequest(**_request(300_000 + i, _spread(i, *FLOOD_TOKENS)), tenant="a"))
             for i in range(sizes.flood_jobs)]
    ttft, ids, least_waiting = [], [], sizes.flood_jobs
    lent_before = await _reserve_runs(metrics_url, "slotq_tenant_reserve_runs")
    for i in range(sizes.probes):
        least_waiting = min(least_waiting, (await _lane(client, "interactive")).waiting)
        ms, job_id = await _probe(client, 2_000 + i, tenant="b", whole=True)
        ttft.append(ms)
        ids.append(job_id)
    lent = await _reserve_runs(metrics_url, "slotq_tenant_reserve_runs") - lent_before
    progress(f"cancelling tenant a's {sizes.flood_jobs:,} jobs")
    await asyncio.gather(*(job.cancel() for job in flood))
    while (await _lane(client, "interactive")).running:
        await asyncio.sleep(0.05)
    progress(f"interactive TTFT on the idle fleet after the flood ({sizes.probes - sizes.probes // 2} jobs)")
    idle += [await _ttft_ms(client, 4_000 + i, whole=True) for i in range(sizes.probes - sizes.probes // 2)]
    # Where b's TTFT went, from the engine's own timings: submit -> admitted into a slot (the step
    # in progress) and submit -> first token (that wait and b's prefill in a batch busy with a's
    # jobs); the rest of the TTFT is outside the engine (waiting for a slot to turn over, the claim,
    # the first stream write and its read).
    timings = [t for t in [(await client.result(job_id, timeout=60)).timings for job_id in ids] if t and t.ttft_ms]
    engine_ttft = [t.ttft_ms or 0.0 for t in timings]
    return {"tenant_a_jobs": sizes.flood_jobs, "tenant_a_least_waiting": least_waiting,
            "tenant_a_tokens": list(FLOOD_TOKENS), "probes": len(ttft), "lent_reserve": lent,
            "ttft_p50_ms": round(percentile(ttft, 50), 1), "ttft_p95_ms": round(percentile(ttft, 95), 1),
            "ttft_ms": [round(x, 1) for x in ttft],
            "engine_wait_p50_ms": round(percentile([t.queue_ms for t in timings], 50), 1),
            "engine_ttft_p50_ms": round(percentile(engine_ttft, 50), 1),
            "outside_engine_p50_ms": round(percentile([a - b for a, b in zip(ttft, engine_ttft)], 50), 1),
            "idle_ttft_p50_ms": round(percentile(idle, 50), 1), "idle_ttft_p95_ms": round(percentile(idle, 95), 1),
            "idle_ttft_ms": [round(x, 1) for x in idle], "ttft_p50_target_ms": round(2 * percentile(idle, 50), 1)}


async def _starved(client: SlotqClient, sizes: Sizes, share: float) -> dict[str, Any]:
    """Bulk jobs alone, then the same number under ``CHAT_CLIENTS`` closed-loop interactive clients:
    how much of the worker the bulk lane keeps (its guaranteed share, ``SLOTQ_LANE_MIN_SHARE``)."""
    lines, tokens = sizes.starved_lines, sizes.max_tokens
    progress(f"bulk alone: {lines} jobs x {tokens} tokens")
    alone = await _bulk_lines(client, 500_000, lines, tokens, timeout_s=600)
    alone_tps = alone["tokens"] / alone["wall_s"]
    guaranteed = guaranteed_slots(SLOTS, share)
    # One slot at bulk alone's per-slot rate needs lines x tokens / (alone / SLOTS) s; allow 20 x that:
    # the interactive jobs' prefills slow every slot (5 x in the first runs).
    bound_s = 20 * lines * tokens / (alone_tps / SLOTS) + 10
    progress(f"bulk under {CHAT_CLIENTS} closed-loop interactive clients (share {share}: {guaranteed} of {SLOTS} "
             f"slots; stops after {bound_s:.0f} s)")
    stop = asyncio.Event()
    chat_tokens: list[int] = []

    async def chat_client(c: int) -> None:
        i = 0
        while not stop.is_set():
            job = await client.enqueue(JobRequest(**_request(20_000_000 + 1000 * c + i, CHAT_TOKENS)))
            chat_tokens.append((await job.result(timeout=120)).usage.completion_tokens)
            i += 1

    chats = [asyncio.create_task(chat_client(c)) for c in range(CHAT_CLIENTS)]
    try:
        while (await _lane(client, "interactive")).waiting == 0:       # saturated: interactive jobs wait
            await asyncio.sleep(0.02)
        chat_before = sum(chat_tokens)
        loaded = await _bulk_lines(client, 600_000, lines, tokens, timeout_s=bound_s)
        chat_during = sum(chat_tokens) - chat_before
    finally:
        stop.set()
        await asyncio.gather(*chats, return_exceptions=True)
    loaded_tps = loaded["tokens"] / loaded["wall_s"]
    worker_tps = (loaded["tokens"] + chat_during) / loaded["wall_s"]
    return {"share": share, "guaranteed_slots": guaranteed, "slots": SLOTS, "lines": lines, "tokens": tokens,
            "chat_clients": CHAT_CLIENTS, "chat_tokens": CHAT_TOKENS,
            "alone_tokens_per_s": round(alone_tps, 1), "alone_wall_s": round(alone["wall_s"], 1),
            "loaded_lines_done": loaded["done"], "loaded_wall_s": round(loaded["wall_s"], 1),
            "loaded_tokens_per_s": round(loaded_tps, 1), "worker_tokens_per_s": round(worker_tps, 1),
            "slot_share": round(loaded["slot_share"], 3),
            "token_share": round(loaded_tps / worker_tps, 3) if worker_tps else 0.0,
            "interactive_waiting_share": round(loaded["interactive_waiting_share"], 3)}


async def _bulk_lines(client: SlotqClient, first: int, lines: int, tokens: int, *, timeout_s: float) -> dict[str, Any]:
    """Enqueue ``lines`` bulk jobs of ``tokens`` tokens and wait (at most ``timeout_s``) for them to
    end: the jobs done, their tokens, the wall time, and from ``counts()`` sampled meanwhile the mean
    share of the slots that bulk jobs held and how often interactive jobs were waiting. Jobs not
    done at the bound are cancelled."""
    started = time.perf_counter()
    jobs = {(job := await client.enqueue(JobRequest(**_request(first + i, tokens), lane="bulk"))).id: job
            for i in range(lines)}
    pending, bulk_running, chat_waiting = list(jobs), [], []
    while pending and time.perf_counter() - started < timeout_s:
        lanes = {c.lane: c for c in await client.queue.counts()}
        bulk_running.append(lanes["bulk"].running)
        chat_waiting.append(lanes["interactive"].waiting > 0)
        pending = [job_id for job_id, queued in zip(pending, await client.queue.in_queue(pending)) if queued]
        await asyncio.sleep(0.05)
    wall_s = time.perf_counter() - started
    for job_id in pending:
        await jobs[job_id].cancel()
    done = [await job.result(timeout=60) for job_id, job in jobs.items() if job_id not in pending]
    return {"done": len(done), "tokens": sum(r.usage.completion_tokens for r in done), "wall_s": wall_s,
            "slot_share": statistics.mean(bulk_running) / SLOTS if bulk_running else 0.0,
            "interactive_waiting_share": statistics.mean(chat_waiting) if chat_waiting else 0.0}


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
    m, long, flood, starved = d["memory_run"], d["long_bulk"], d["flood"], d["starved"]
    idle_p50, idle_p95 = d["interactive_ttft_p50_ms_idle"], d["interactive_ttft_p95_ms_idle"]
    rows = [
        ["bulk throughput", f"{d['bulk_tokens_per_s']:.1f} tok/s",
         (f"{d['bulk_tokens_per_s'] / d['engine_tokens_per_s']:.3f} x the engine in-process "
          f"({d['engine_tokens_per_s']:.1f} tok/s, {d['slots']} slots full)")],
        ["interactive TTFT p50 / p95, idle fleet", f"{idle_p50:.0f} / {idle_p95:.0f} ms", ""],
        ["interactive TTFT p50, bulk saturating", f"{d['interactive_ttft_p50_ms_saturated']:.0f} ms",
         f"{d['interactive_ttft_p50_ms_saturated'] / d['interactive_ttft_p50_ms_idle']:.2f} x idle"],
        [f"interactive TTFT p50 / p95, {long['max_tokens']}-token bulk jobs in every slot",
         f"{long['ttft_p50_ms']:.0f} / {long['ttft_p95_ms']:.0f} ms",
         (f"idle {idle_p50:.0f} / {idle_p95:.0f} ms; p95 target <= idle p95 + 3 steps of the full batch "
          f"({long['full_batch_step_ms']:.0f} ms each) = {long['ttft_p95_target_ms']:.0f} ms: "
          f"{long['ttft_p95_ms'] / long['ttft_p95_target_ms']:.2f} x the target; {long['probes']} jobs: "
          f"{long['reserve_runs']} ran in the worker's reserve, {long['preemptions']} took a bulk job's slot")],
        [f"bulk throughput, an interactive job every {long['probe_gap_steps']} steps",
         f"{long['bulk_mixed_tokens_per_s']:.1f} tok/s",
         (f"{long['mixed_over_alone']:.3f} x bulk alone (median of {len(long['rounds']['alone'])} back-to-back "
          f"rounds; {long['bulk_alone_tokens_per_s']:.1f} tok/s; target >= 0.95)")],
        [f"tenant b's TTFT p50 / p95, tenant a with {flood['tenant_a_least_waiting']:,}+ jobs waiting",
         f"{flood['ttft_p50_ms']:.0f} / {flood['ttft_p95_ms']:.0f} ms",
         (f"{flood['ttft_p50_ms'] / flood['idle_ttft_p50_ms']:.2f} x idle p50 (target <= 2; idle "
          f"{flood['idle_ttft_p50_ms']:.0f} / {flood['idle_ttft_p95_ms']:.0f} ms around the flood); "
          f"p95 {flood['ttft_p95_ms'] / flood['idle_ttft_p95_ms']:.2f} x idle p95; "
          f"p50s: {flood['outside_engine_p50_ms']:.0f} ms "
          f"outside the engine (slot turnover, claim, stream), {flood['engine_ttft_p50_ms']:.0f} ms in it "
          f"({flood['engine_wait_p50_ms']:.0f} waiting for the step in progress); {flood['probes']} jobs, one at a "
          f"time: {flood['lent_reserve']} ran in the reserve lent for their tenant")],
        [f"bulk's share of the slots, {starved['chat_clients']} interactive clients saturating",
         f"{starved['slot_share']:.3f}",
         (f"target >= the share {starved['share']:g} ({starved['guaranteed_slots']} of {starved['slots']} slots, "
          f"SLOTQ_LANE_MIN_SHARE); {starved['token_share']:.3f} of the tokens generated; "
          f"{starved['loaded_lines_done']}/{starved['lines']} bulk jobs of {starved['tokens']} tokens in "
          f"{starved['loaded_wall_s']:.1f} s, {starved['loaded_tokens_per_s']:.1f} tok/s of the worker's "
          f"{starved['worker_tokens_per_s']:.1f} (bulk alone: {starved['alone_tokens_per_s']:.1f}); interactive "
          f"jobs waiting in {100 * starved['interactive_waiting_share']:.0f} % of samples")],
        [f"slotq bulk peak RSS, {d['lines']:,} lines", f"{d['peak_rss_mb']:.0f} MB",
         "RSS over time (s, MB): " + ", ".join(f"{t:g}: {v:.0f}" for t, v in m["rss_mb_over_time"])],
        ["Redis used_memory peak", f"{d['redis_peak_mb']:.1f} MB",
         f"baseline {m['redis_baseline_mb']:.1f} MB; window {d['window']} lines; {m['lines_per_s']:.0f} lines/s"],
    ]
    return markdown_table(["what", "figure", "detail"], rows).replace("|---:|---:|---:|", "|:---|---:|:---|")
