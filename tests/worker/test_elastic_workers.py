"""Elastic workers, end to end: real ``slotq worker`` processes on the tiny model, a real Valkey,
real memory pressure (the worker holds real, touched ballast memory that the test sizes through
``SLOTQ_FAULT_MEMORY_BALLAST_FILE``), and what the worker says about itself on /metrics and /ready.

* With a lowered memory threshold crossed, the worker sheds active slots while the queue keeps
  draining and no job fails; with the pressure gone and jobs waiting, it grows back. Both changes
  are in /metrics.
* Sustained pressure takes the degradation steps one by one (smaller batch, max_tokens cap,
  refusing new jobs) and they are undone when it is gone.
* The warm-up gate: nothing is claimed before the worker is ready.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slotq.engine import Engine, EngineConfig
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.arq_adapter import RetryJob
from slotq.jobs.protocol.payload import encode_payload
from slotq.jobs.protocol.schemas import EntryKind, JobStatus
from slotq.jobs.protocol.streams import StreamOpening
from slotq.jobs.protocol.wire import ErrorInfo
from slotq.jobs.worker.elastic.admission import WORKER_OVERLOADED, Verdict
from slotq.jobs.worker.job_run import JobRun
from slotq.jobs.worker.settings import WorkerSettings
from slotq.jobs.worker.stream_writer import StreamWriter
from tests.support import free_port
from tests.support.jobs import WorkerProcess, clean_env, job_request, raw_entries

MIB = 1 << 20
LIMIT_MB = 1024
LONG = 1500          # tokens per job: about a second on one slot of the tiny model


class Worker:
    """A ``slotq worker`` subprocess with its metrics port and its ballast file."""

    def __init__(self, name: str, redis_url: str, model: Path, tmp: Path, **settings: Any) -> None:
        self.port = free_port()
        self.ballast = tmp / f"{name}.ballast"
        self.ballast.write_text("0")
        settings.setdefault("ctx", 4096)       # long jobs: the tiny model decodes thousands of tokens/s
        env = clean_env(redis_url=redis_url, model=model, threads=1, metrics_port=self.port,
                        fault_memory_ballast_file=self.ballast, **settings)
        self.proc = WorkerProcess(name, env, tmp)

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def ready_state(self) -> str:
        try:
            return str(json.loads(self.get("/ready")[1])["state"])
        except (urllib.error.URLError, ConnectionError):
            return "not_listening"

    def metrics(self) -> dict[str, float]:
        """``name{label="v",...}`` -> value, as the exposition writes it."""
        out = {}
        for family in text_string_to_metric_families(self.get("/metrics")[1]):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def metric(self, name: str) -> float:
        return self.metrics().get(name, 0.0)

    def hold(self, ratio: float) -> None:
        """Make the worker's resident memory about ``ratio`` of its limit (0: release the ballast)."""
        if ratio == 0:
            self.ballast.write_text("0")
            return
        used = self.metric("slotq_memory_used_bytes") - int(self.ballast.read_text()) * MIB
        self.ballast.write_text(str(max(0, math.ceil((ratio * LIMIT_MB * MIB - used) / MIB))))

    async def ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.get("/ready")[0] == 200:
                    return
            except (urllib.error.URLError, ConnectionError):
                pass
            assert self.proc.proc.poll() is None, self.proc.log_tail()
            assert time.monotonic() < deadline, self.proc.log_tail()
            await asyncio.sleep(0.1)


@pytest.fixture
def spawn(redis_url: str, tiny_model_path: Path, tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    started: list[Worker] = []

    def start(name: str, **settings: Any) -> Worker:
        w = Worker(name, redis_url, tiny_model_path, tmp_path, memory_limit_mb=LIMIT_MB, **settings)
        started.append(w)
        return w

    yield start
    for w in started:
        w.proc.stop()


async def until(check: Callable[[], Any], what: str, worker: Worker, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert worker.proc.proc.poll() is None, worker.proc.log_tail()
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{worker.proc.log_tail()}"
        await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_memory_pressure_sheds_slots_queue_drains_then_slots_grow_back(
        spawn: Callable[..., Worker], client: SlotqClient) -> None:
    w = spawn("el1", slots=4, min_slots=1, memory_high=0.8, memory_low=0.7, memory_refuse=0.99,
              adapt_interval_s=0.2, adapt_cooldown_s=0.3, degrade_after_s=600, min_stream_tokens_per_s=0)
    await w.ready()
    assert w.metric("slotq_memory_used_bytes") < 0.6 * LIMIT_MB * MIB, "the worker's baseline is too big for this test"
    assert w.metric("slotq_slots_active") == 4

    first = [await client.enqueue(job_request(f"first {i}", max_tokens=LONG)) for i in range(10)]
    w.hold(0.88)                                          # over memory_high (0.8), under memory_refuse
    await until(lambda: w.metric("slotq_slots_active") == 1, "slots to shrink to 1", w)
    assert w.metric('slotq_slot_changes_total{cause="memory",direction="down"}') == 3
    # Running jobs were not stopped; as they finish their slots retire: one job runs while others wait.
    seen_single = False
    while not seen_single:
        counts = (await client.queue.counts())[0]
        if counts.waiting == 0:
            break
        seen_single = counts.running == 1
        await asyncio.sleep(0.05)
    assert seen_single, "the worker kept more jobs than active slots while jobs waited"
    results = [await j.result(timeout=120) for j in first]
    assert all(r.status == JobStatus.SUCCEEDED and r.usage.completion_tokens == LONG for r in results)
    assert w.metric("slotq_slots_active") == 1 and w.metric("slotq_degradation_level") == 0

    w.hold(0)                                             # pressure gone; now give it work
    second = [await client.enqueue(job_request(f"second {i}", max_tokens=LONG)) for i in range(12)]
    await until(lambda: w.metric("slotq_slots_active") == 4, "slots to grow back to 4", w)
    assert w.metric('slotq_slot_changes_total{cause="demand",direction="up"}') == 3
    results = [await j.result(timeout=120) for j in second]
    assert all(r.status == JobStatus.SUCCEEDED for r in results)
    assert w.metric('slotq_jobs_total{status="failed"}') == 0
    log = w.proc.log_tail(20000)
    assert "active slots 4 -> 3: memory at" in log and "active slots 3 -> 4: " in log


@pytest.mark.slow
async def test_degradation_steps_on_under_sustained_pressure_and_off_afterwards(
        spawn: Callable[..., Worker], client: SlotqClient) -> None:
    w = spawn("el2", slots=2, min_slots=1, batch=512, prefill_chunk=256, memory_high=0.8, memory_low=0.7,
              memory_refuse=0.97, adapt_interval_s=0.2, adapt_cooldown_s=0.2, degrade_after_s=3, recover_after_s=1,
              degraded_batch_fraction=0.25, degraded_max_tokens=8, min_stream_tokens_per_s=0)
    await w.ready()
    assert (w.metric("slotq_batch_limit_tokens"), w.metric("slotq_prefill_chunk_limit_tokens")) == (512, 256)

    def step(name: str) -> bool:
        return w.metric(f'slotq_degradation_step{{step="{name}"}}') == 1

    w.hold(0.88)
    await until(lambda: step("small_batch"), "step 1: smaller batch", w)
    assert w.metric("slotq_slots_active") == 1                 # slots went first
    await until(lambda: w.metric("slotq_batch_limit_tokens") == 128, "the engine to apply the smaller batch", w)
    assert w.metric("slotq_prefill_chunk_limit_tokens") == 64

    await until(lambda: step("cap_tokens"), "step 2: max_tokens cap", w)
    capped = await (await client.enqueue(job_request("capped", max_tokens=64))).result(timeout=60)
    assert capped.status == JobStatus.SUCCEEDED and capped.usage.completion_tokens == 8
    cap = capped.max_tokens_cap
    assert cap is not None and (cap.requested, cap.applied) == (64, 8)
    assert "SLOTQ_DEGRADED_MAX_TOKENS" in capped.max_tokens_cap.reason

    await until(lambda: step("refuse"), "step 3: refusing new jobs", w)
    assert w.metric("slotq_degradation_level") == 3
    held = [await client.enqueue(job_request(f"held {i}", max_tokens=64)) for i in range(3)]
    # Not claimed: left for other workers. A refusal is the absence of a claim, so it is watched over a window of
    # several adapt intervals (0.2 s) and wake-ups, every 50 ms, rather than read once after a sleep.
    window_ends = time.monotonic() + 1.5
    while time.monotonic() < window_ends:
        counts = (await client.queue.counts())[0]
        assert (counts.waiting, counts.running) == (3, 0), w.proc.log_tail()
        await asyncio.sleep(0.05)
    status, body = w.get("/ready")
    assert status == 200 and json.loads(body)["degradation"] == "refuse"

    w.hold(0)
    await until(lambda: w.metric("slotq_degradation_level") == 0, "every step to be undone", w)
    assert w.metric('slotq_degradation_changes_total{direction="up"}') == 3
    assert w.metric('slotq_degradation_changes_total{direction="down"}') == 3
    await until(lambda: w.metric("slotq_batch_limit_tokens") == 512, "the full batch again", w)
    for job in held:        # claimed once refusing ended; the cap may still have applied then, and says so
        result = await job.result(timeout=60)
        assert result.status == JobStatus.SUCCEEDED and result.attempts == 1
        assert (result.usage.completion_tokens, result.max_tokens_cap is None) in ((64, True), (8, False)), result
    after = await (await client.enqueue(job_request("after", max_tokens=64))).result(timeout=60)
    assert after.usage.completion_tokens == 64 and after.max_tokens_cap is None
    assert w.metric('slotq_jobs_total{status="failed"}') == 0
    log = w.proc.log_tail(20000)
    for line in ("degradation none -> small_batch: memory at", "degradation small_batch -> cap_tokens",
                 "degradation cap_tokens -> refuse", "degradation refuse -> cap_tokens: memory clear for",
                 "degradation small_batch -> none"):
        assert line in log, line


async def test_no_job_is_claimed_before_the_warm_up_is_done(
        spawn: Callable[..., Worker], client: SlotqClient) -> None:
    jobs = [await client.enqueue(job_request(f"early {i}", max_tokens=4)) for i in range(3)]
    w = spawn("el3", slots=2, fault_warmup_delay_s=3)
    states = set()
    while True:
        counts = (await client.queue.counts())[0]
        workers = (await client.queue_info()).workers
        state = w.ready_state()          # read last: not ready now means not ready when the above was read
        states.add(state)
        if state == "ready":
            break
        assert (counts.waiting, counts.running) == (3, 0), f"claimed while {state}"
        assert all(not info.ready for info in workers), workers
        assert w.proc.proc.poll() is None, w.proc.log_tail()
        await asyncio.sleep(0.05)
    assert "warming_up" in states
    assert [(await j.result(timeout=60)).status for j in jobs] == [JobStatus.SUCCEEDED] * 3
    log = w.proc.log_tail(20000)
    assert log.index("worker el3 ready (warm-up decode") < log.index("attempt 1 started")
    assert (await client.queue_info()).workers[0].ready


async def test_a_refused_job_goes_back_unstarted_with_a_retryable_error(
        redis_url: str, client: SlotqClient, tiny_model_path: Path) -> None:
    """The race the claim gate leaves: a job claimed just before the worker started refusing."""
    settings = WorkerSettings(redis_url=redis_url, model=str(tiny_model_path), slots=1, ctx=256, threads=1)
    engine = await Engine.start(EngineConfig(model_path=tiny_model_path, slots=1, ctx=256, threads=1))
    writer = StreamWriter(client.redis, flush_ms=1, maxlen=1000, ttl_s=60)
    writer.start()
    refusal = Verdict(refuse=ErrorInfo(code=WORKER_OVERLOADED, message="worker w is refusing new jobs (memory at 95%)",
                                       retryable=True))
    try:
        run = JobRun(engine=engine, writer=writer, settings=settings, worker_id="w", job_id="refused-1", attempt=1,
                     enqueued_at=None, payload=encode_payload(job_request(max_tokens=4)),
                     is_abort=lambda: False, lease_lost=lambda: False, verdict=lambda **_: refusal)
        with pytest.raises(RetryJob):
            await run.run(StreamOpening(raised=True))
    finally:
        await writer.close()
        await engine.close()
    entries = await raw_entries(client, "refused-1")
    assert [(e.kind, e.error.code if e.error else None, e.error.retryable if e.error else None, e.final)
            for e in entries] == [(EntryKind.ERROR, WORKER_OVERLOADED, True, False)]
    assert engine.stats().generated_tokens == 0                 # nothing ran

