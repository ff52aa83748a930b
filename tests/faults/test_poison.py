"""Poison cannot spread (issue 32): a job that kills every worker it starts on is dead-lettered after
``SLOTQ_MAX_WORKER_DEATHS`` (2) deaths, and the jobs beside it still finish.

Three real ``slotq worker`` processes on the tiny model and a Valkey of the test's own. The poison
job SIGKILLs its worker as its attempt is handed to the engine
(``SLOTQ_FAULT_KILL_WORKER_AT_START_OF``), where a grammar that exhausts memory or a prompt that
crashes llama.cpp would; ordinary jobs are enqueued around it, so the first workers it kills hold
some of them too, without progress, and hand them back with it.
"""

from __future__ import annotations

import asyncio
import io
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from slotq.jobs.cli.status_view import render
from slotq.jobs.protocol import dead_letters
from slotq.jobs.protocol.schemas import JobResult, JobStatus
from tests.support import free_port
from tests.support.engine import solo_greedy_tokens
from tests.support.faults import Fleet, check_job, worker_env
from tests.support.jobs import chunks, job_request, raw_entries

pytestmark = pytest.mark.fault

POISON = "poison-job"
MAX_TOKENS = 32
CTX = 512


def _dead_letters_counted(port: int) -> dict[str, float]:
    """``slotq_dead_letters_total`` by reason, from a worker's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {sample.labels["reason"]: sample.value for family in text_string_to_metric_families(text)
            if family.name == "slotq_dead_letters" for sample in family.samples if sample.name.endswith("_total")}


async def test_a_job_that_kills_its_workers_is_dead_lettered_after_two_and_the_others_finish(
        fclient, fsync_redis, tiny_model_path, tmp_path):
    prompts = [f"ordinary job {i}: {word}"
               for i, word in enumerate(["amber", "birch", "cedar", "dune", "ember", "fjord", "grove", "heath"])]
    references = await solo_greedy_tokens(tiny_model_path, prompts, max_tokens=MAX_TOKENS, ctx=CTX)
    # Enqueued before any worker runs: the first worker to be ready claims the poison with three others.
    handles = [await fclient.enqueue(job_request(prompt, max_tokens=MAX_TOKENS)) for prompt in prompts[:1]]
    poison = await fclient.enqueue(job_request("poison", max_tokens=MAX_TOKENS, idempotency_key=POISON))
    handles += [await fclient.enqueue(job_request(prompt, max_tokens=MAX_TOKENS)) for prompt in prompts[1:]]
    ids = [poison.id, *(h.id for h in handles)]
    assert poison.id == POISON

    fleet = Fleet(fclient, worker_env(fsync_redis.url, tiny_model_path, ctx=CTX, ubatch=1, poll_delay_s=0.2,
                                      fault_kill_worker_at_start_of=POISON), tmp_path)
    ports = {fleet.spawn(metrics_port=port).name: port for port in (free_port(), free_port(), free_port())}
    names = list(ports)
    try:
        results: dict[str, JobResult] = {}
        deadline = time.monotonic() + 120
        while len(results) < len(ids) and fleet.alive() and time.monotonic() < deadline:
            results = await fclient.finished(ids)
            await asyncio.sleep(0.1)
        dead = {name: fleet.procs[name].proc.returncode for name in names if name not in fleet.alive()}
        assert len(dead) <= 2, f"{len(dead)} workers died; results for {sorted(results)}:\n{fleet.logs()}"
        assert len(results) == len(ids), f"no result for {sorted(set(ids) - set(results))}:\n{fleet.logs()}"
        assert list(dead.values()) == [-9, -9], dead       # the poison ran twice, and SIGKILLed both workers
        summary = Console(width=400, record=True, file=io.StringIO())
        summary.print(render(await fclient.queue_info()))
        [survivor] = fleet.alive()
        dead_letter_counts = await asyncio.to_thread(_dead_letters_counted, ports[survivor])
    finally:
        fleet.stop_all()

    result = results[POISON]
    assert result.status == JobStatus.FAILED and result.error is not None, result
    assert result.error.code == "killed_its_worker" and not result.error.retryable, result.error
    assert result.attempts == 3, result     # the third attempt refused it
    assert not chunks(await raw_entries(fclient, POISON))
    letter = await dead_letters.get(fclient.redis, POISON)
    assert letter is not None, "no dead letter"
    assert (letter.reason, letter.worker_deaths, letter.attempts) == ("killed_its_worker", 2, 3), letter
    assert letter.payload is not None and letter.payload["prompt"] == "poison"     # requeueable
    assert await dead_letters.count(fclient.redis) == 1
    assert await dead_letters.by_reason(fclient.redis) == {"killed_its_worker": 1}
    assert "1 dead letters (1 killed_its_worker)" in summary.export_text(), summary.export_text()
    assert dead_letter_counts["killed_its_worker"] == 1, dead_letter_counts     # the survivor dead-lettered it

    for prompt, handle in zip(prompts, handles):
        ordinary = results[handle.id]
        s = await check_job(fclient, ordinary, max_tokens=MAX_TOKENS)
        assert s.token_ids == references[prompt], (handle.id, ordinary.attempts, s.attempts)
