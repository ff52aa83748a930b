"""``slotq bench gateway-batch``: a chat request's TTFT through the gateway while the same gateway writes
a 100 MB Batch API output, against the gateway idle (issue 32: the gateway's loop never waits on a disk).

One worker (the suite's tiny model, as ``slotq bench overhead`` uses it: generating costs next to nothing, so
a probe's TTFT is mostly the gateway's and Redis' own time, which is what a stalled loop delays; 4 slots, one
thread) and one ``slotq gateway`` subprocess on one Redis. Each round:

* **idle**: ``IDLE_PROBES`` probes, one at a time: a streamed chat request (``PROBE_TOKENS`` tokens),
  TTFT = request sent to the first content chunk;
* **writing**, once to the local disk and once to an emulated network volume (``VOLUME_MB_S``, the
  gateway runs through :mod:`bench.slow_volume`): a batch of ``LINES`` chat lines is created, and
  probes run one at a time until it is completed. Every line's result (``TEXT_CHARS`` characters of
  text) is stored in Redis under the line's job id beforehand, as a gateway that died mid-batch
  leaves them, so the batch asks nothing of the worker: its whole cost is in the gateway, which
  adopts the results and writes ~100 MB of output records, in the process whose event loop also
  serves the probes.

Rounds repeat the three phases on one warm stack, so a busy neighbour on a shared machine does not
favour one. Reported: TTFT p50, p95 and max of each phase (all rounds pooled), the ratios to idle (p50 also
for each round against the idle probes just before it), the output's size and the time the gateway took to
write it. Target: writing p50 <= 1.2 x idle p50.
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

from bench import slow_volume
from bench.gateway_bench import MODEL_NAME, _ready
from bench.overhead_bench import write_tiny_model
from bench.report import distinct_prompt, markdown_table, percentile, progress, write_results
from slotq.jobs.bulk import identity
from slotq.jobs.bulk.formats import raw_key
from slotq.jobs.bulk.source import InputFile
from slotq.jobs.cli.watch import ChildProcess, run_watched
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.keys import JOB_FUNCTION
from slotq.jobs.protocol.schemas import ChoiceResult, JobResult, JobStatus
from slotq.jobs.protocol.serialization import serialize
from slotq.jobs.protocol.wire import FinishReason, Timings, Usage
from slotq.jobs.redis_server import EmbeddedRedis, free_port
from slotq.jobs.settings import ClientSettings

SLOTS = 4
CTX = 512
LINES = 5_000
TEXT_CHARS = 20_000          # LINES x ~20 KB records: ~100 MB of output
ROUNDS = 3
VOLUME_MB_S = 100            # the emulated network volume's bandwidth (bench/slow_volume.py)
VOLUMES = {"local disk": 0, f"network volume, {VOLUME_MB_S} MB/s": VOLUME_MB_S}
PHASES = ["idle", *VOLUMES]
IDLE_PROBES = 30
PROBE_TOKENS = 8
RESULT_TTL_MS = 3_600_000
STORE_AT_ONCE = 200          # results stored per pipeline


async def run(quick: bool) -> tuple[dict[str, Any], str]:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    lines, rounds = (500, 1) if quick else (LINES, ROUNDS)
    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as tmp:
        server = EmbeddedRedis(Path(tmp) / "redis")
        url = server.start()
        port = free_port()
        env = {**os.environ, "SLOTQ_REDIS_URL": url, "SLOTQ_MODEL": str(write_tiny_model(Path(tmp) / "tiny.gguf")),
               "SLOTQ_MODEL_NAME": MODEL_NAME, "SLOTQ_SLOTS": str(SLOTS), "SLOTQ_CTX": str(CTX), "SLOTQ_THREADS": "1",
               "SLOTQ_PREFIX_CACHE": "false", "SLOTQ_LOG_LEVEL": "WARNING",
               "SLOTQ_GATEWAY_FILES_DIR": str(Path(tmp) / "files")}
        children = [ChildProcess(f"the benchmark's {name} (slotq {name})",
                                 [sys.executable, "-m", module, *argv],
                                 env=env, log_path=Path(tmp) / f"{name}.log")
                    for name, module, argv in (("worker", "slotq.jobs.cli", ["worker"]),
                                               ("gateway", "bench.slow_volume", ["gateway", "--port", str(port)]))]
        try:
            data = await run_watched(_rounds(url, port, Path(tmp), lines, rounds), *children)
        finally:
            for child in children:
                child.stop()
            server.stop()
    table = _table(data)
    if not quick:
        write_results("gateway_batch", data, table, "slotq bench gateway-batch")
    return data, table


async def _rounds(url: str, port: int, tmp: Path, lines: int, rounds: int) -> dict[str, Any]:
    client = await SlotqClient.connect(url, ClientSettings(redis_url=url))
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120)
    files_dir = tmp / "files"
    try:
        progress("waiting for the worker and the gateway")
        await _ready(client, http)
        queue = (await client.workers())[0].queue
        for i in range(4):                                            # warm-up
            await _probe(http, i)
        ttfts: dict[str, list[float]] = {phase: [] for phase in PHASES}
        per_round: list[dict[str, Any]] = []
        for round_ in range(rounds):
            progress(f"round {round_ + 1}: {IDLE_PROBES} probes on the idle gateway")
            idle = [await _probe(http, i) for i in range(IDLE_PROBES)]
            ttfts["idle"] += idle
            for phase, mb_per_s in VOLUMES.items():
                progress(f"round {round_ + 1}: storing {lines} results of {TEXT_CHARS} characters")
                file_id = await _batch_ready(client, http, queue, tmp / f"{round_}-{mb_per_s}.jsonl", lines)
                control = files_dir / slow_volume.CONTROL_FILE
                if mb_per_s:
                    control.write_text(str(mb_per_s))
                progress(f"round {round_ + 1}: probes while the gateway writes the batch's output ({phase})")
                writing, write = await _while_writing(http, files_dir, file_id)
                control.unlink(missing_ok=True)
                ttfts[phase] += writing
                per_round.append(write | {"round": round_ + 1, "phase": phase, "p50_ratio": round(
                    percentile(writing, 50) / percentile(idle, 50), 2)})
        return {"lines": lines, "text_chars": TEXT_CHARS, "volume_mb_s": VOLUME_MB_S,
                "phases": {phase: _stats(values) for phase, values in ttfts.items()}, "rounds": per_round}
    finally:
        await http.aclose()
        await client.close()


async def _probe(http: httpx.AsyncClient, i: int) -> float:
    body = {"model": MODEL_NAME, "max_tokens": PROBE_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": distinct_prompt(i)}]}
    started = time.perf_counter()
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and (json.loads(line[6:])["choices"] or [{}])[0].get("delta", {}).get(
                    "content"):
                return time.perf_counter() - started
    raise RuntimeError("a probe streamed no content")


async def _batch_ready(client: SlotqClient, http: httpx.AsyncClient, queue: str, path: Path, lines: int) -> str:
    """Upload a batch input and store every line's result under the job id the gateway's run gives it."""
    path.write_text("".join(json.dumps({
        "custom_id": f"{path.stem}-{n}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL_NAME, "max_tokens": 1, "messages": [{"role": "user", "content": f"line {n}"}]}})
        + "\n" for n in range(1, lines + 1)))
    source = InputFile(path, queue)
    run_identity = (await source.scan(raw_key)).identity
    usage = Usage(prompt_tokens=8, completion_tokens=TEXT_CHARS // 4)
    choice = ChoiceResult(index=0, text="x" * TEXT_CHARS, finish_reason=FinishReason.LENGTH, usage=usage,
                          timings=Timings())
    for first in range(1, lines + 1, STORE_AT_ONCE):
        job_ids = [identity.job_id(run_identity, n) for n in range(first, min(first + STORE_AT_ONCE, lines + 1))]
        await asyncio.gather(*(client.queue.store_result(
            job_id, JOB_FUNCTION, JobResult(id=job_id, status=JobStatus.SUCCEEDED, text=choice.text, usage=usage,
                                            finish_reason=choice.finish_reason, choices=[choice], worker="bench",
                                            attempts=1).model_dump(mode="json"),
            ttl_ms=RESULT_TTL_MS, serializer=serialize) for job_id in job_ids))
    with path.open("rb") as f:
        response = await http.post("/v1/files", files={"file": (path.name, f)}, data={"purpose": "batch"})
    response.raise_for_status()
    return str(response.json()["id"])


async def _while_writing(http: httpx.AsyncClient, files_dir: Path, file_id: str) -> tuple[list[float], dict[str, Any]]:
    """Create the batch and probe, one at a time, until it is completed."""
    response = await http.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                                    "completion_window": "24h"})
    response.raise_for_status()
    batch_id = response.json()["id"]
    started = time.perf_counter()
    ttfts: list[float] = []
    i = 0
    while True:
        ttfts.append(await _probe(http, 1000 + i))
        i += 1
        batch = (await http.get(f"/v1/batches/{batch_id}")).json()
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            break
    if batch["status"] != "completed" or batch["request_counts"]["failed"]:
        raise RuntimeError(f"the benchmark's batch ended {batch['status']}: {batch}")
    size = (files_dir / batch["output_file_id"]).stat().st_size
    return ttfts, {"output_mb": round(size / 1e6, 1), "seconds": round(time.perf_counter() - started, 2),
                   "probes": len(ttfts)}


def _stats(ttfts: list[float]) -> dict[str, float]:
    return {"n": len(ttfts), "p50_ms": round(percentile(ttfts, 50) * 1000, 1),
            "p95_ms": round(percentile(ttfts, 95) * 1000, 1), "max_ms": round(max(ttfts) * 1000, 1)}


def _table(d: dict[str, Any]) -> str:
    idle = d["phases"]["idle"]
    rows = [["idle", str(idle["n"]), f"{idle['p50_ms']:.1f}", f"{idle['p95_ms']:.1f}", f"{idle['max_ms']:.1f}", "",
             "", ""]]
    for phase in VOLUMES:
        stats, rounds = d["phases"][phase], [r for r in d["rounds"] if r["phase"] == phase]
        mb, seconds = (sum(r[k] for r in rounds) / len(rounds) for k in ("output_mb", "seconds"))
        rows.append([f"writing {mb:.0f} MB to the {phase} ({seconds:.1f} s)", str(stats["n"]),
                     f"{stats['p50_ms']:.1f}", f"{stats['p95_ms']:.1f}", f"{stats['max_ms']:.1f}",
                     f"{stats['p50_ms'] / idle['p50_ms']:.2f}", ", ".join(f"{r['p50_ratio']:.2f}" for r in rounds),
                     f"{stats['p95_ms'] / idle['p95_ms']:.2f}"])
    return markdown_table(["gateway", "probes", "TTFT p50 ms", "TTFT p95 ms", "TTFT max ms", "p50 / idle",
                           "p50 / idle, each round", "p95 / idle"], rows)
