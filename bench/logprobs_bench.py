"""``slotq bench logprobs``: what one request that asks for logprobs costs the requests beside it.

Through Redis, to a ``slotq worker`` subprocess with ``SLOTS`` slots on the bundled model: each
round enqueues ``SLOTS`` jobs at once (distinct prompts, a fixed output length, greedy) and reads
every job's stream to its end. Seven are plain in every round; the eighth is plain too (the
baseline) or asks for logprobs, with no alternatives (``logprobs: 0``) or OpenAI's most
(``top_logprobs: 20``). Every round runs each variant once, starting with a different one each
time, so neither the machine's drift nor the order favours one. Reported: the seven plain streams'
tokens/s (their tokens over the time from enqueue until the last of them ended) and its ratio to
the baseline (the median over rounds of the variant's figure over the same round's baseline); the
issue's target is >= 0.95. The engine's extra work per token (a log-softmax
over the vocabulary and a top-k, on the engine thread) is timed on its own on a random row of
the bundled model's vocabulary size.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.report import distinct_prompt, markdown_table, progress, write_results
from slotq.engine import bundled_model_path
from slotq.engine.logprobs import StepLogprobs, as_event
from slotq.jobs.cli.watch import ChildProcess, run_watched
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.schemas import EntryKind, JobRequest
from slotq.jobs.redis_server import EmbeddedRedis
from slotq.jobs.settings import ClientSettings

SLOTS = 8
CTX = 512
VARIANTS: dict[str, int | None] = {"8th plain (baseline)": None, "8th logprobs: 0": 0, "8th top_logprobs: 20": 20}
BASELINE = "8th plain (baseline)"
SMOLLM2_VOCAB = 49_152


async def _round(client: SlotqClient, logprobs: int | None, max_tokens: int, first_prompt: int) -> float:
    """One round: SLOTS jobs at once, the last with ``logprobs``; the plain ones' tokens/s."""
    started = time.perf_counter()

    async def one(i: int, asks: int | None) -> tuple[int, float]:
        job = await client.enqueue(JobRequest(prompt=distinct_prompt(first_prompt + i), max_tokens=max_tokens,
                                              ignore_eos=True, sampling={"temperature": 0}, logprobs=asks))
        tokens = 0
        async for entry in job.stream():
            if entry.kind == EntryKind.CHUNK:
                tokens += len(entry.token_ids)
                assert asks is None or (entry.logprobs is not None and len(entry.logprobs) == len(entry.token_ids))
        return tokens, time.perf_counter() - started

    done = await asyncio.gather(*(one(i, None) for i in range(SLOTS - 1)), one(SLOTS - 1, logprobs))
    plain = done[:-1]
    return sum(tokens for tokens, _ in plain) / max(seconds for _, seconds in plain)


async def _measure(url: str, rounds: int, max_tokens: int) -> dict[str, list[float]]:
    client = await SlotqClient.connect(url, ClientSettings(redis_url=url))
    try:
        progress("waiting for the worker to load the model")
        while not (await client.queue_info()).workers:
            await asyncio.sleep(0.2)
        await _round(client, None, 8, 0)                 # warm-up, not measured
        measured: dict[str, list[float]] = {name: [] for name in VARIANTS}
        prompt = SLOTS
        names = list(VARIANTS)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:   # each round starts with the next one
                progress(f"round {r + 1}/{rounds}: {name}")
                measured[name].append(await _round(client, VARIANTS[name], max_tokens, prompt))
                prompt += SLOTS
        return measured
    finally:
        await client.close()


def _engine_work_ms(top: int, repeats: int = 200) -> float:
    """Median ms of one token's logprobs (log-softmax, top ``top``, the entry) on a random row."""
    rows = np.random.default_rng(0).normal(0, 4, (1, SMOLLM2_VOCAB)).astype(np.float32)
    step = StepLogprobs()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        as_event(step.compute(list(rows), [top], [lambda token: b"tok"])[0].of(int(rows[0].argmax())))
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


async def run(quick: bool) -> tuple[dict[str, Any], str]:
    rounds = 3 if quick else 6
    max_tokens = 32 if quick else 128
    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as tmp:
        server = EmbeddedRedis(Path(tmp) / "redis")
        url = server.start()
        env = {**os.environ, "SLOTQ_REDIS_URL": url, "SLOTQ_MODEL": str(bundled_model_path()),
               "SLOTQ_SLOTS": str(SLOTS), "SLOTQ_CTX": str(CTX), "SLOTQ_PREFIX_CACHE": "false"}
        worker = ChildProcess("the benchmark's worker (slotq worker)",
                              [sys.executable, "-m", "slotq.jobs.cli", "worker"], env=env,
                              log_path=Path(tmp) / "worker.log")
        try:
            measured = await run_watched(_measure(url, rounds, max_tokens), worker)
        finally:
            worker.stop()
            server.stop()
    base = measured[BASELINE]
    rows, data = [], {"slots": SLOTS, "max_tokens": max_tokens, "rounds": rounds, "variants": {}}
    for name, logprobs in VARIANTS.items():
        ratio = statistics.median(value / baseline for value, baseline in zip(measured[name], base, strict=True))
        work_ms = None if logprobs is None else _engine_work_ms(logprobs)
        data["variants"][name] = {"plain_tokens_per_s": measured[name], "ratio_to_baseline": ratio,
                                  "engine_work_ms_per_token": work_ms}
        rows.append([name, f"{statistics.median(measured[name]):.1f}",
                     f"{min(measured[name]):.1f} - {max(measured[name]):.1f}", f"{ratio:.3f}",
                     "" if work_ms is None else f"{work_ms:.2f}"])
    table = markdown_table(["8 jobs at once", "7 plain streams' tokens/s (median)", "range",
                            "ratio to baseline (target >= 0.95)", "engine work per logprobs token, ms"], rows)
    write_results("logprobs", data, table, "slotq bench logprobs" + (" --quick" if quick else ""))
    return data, table
