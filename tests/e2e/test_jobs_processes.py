"""The job layer across processes: two `slotq worker` processes sharing one Redis, the `slotq`
CLI against a live worker, and `slotq demo` on the bundled model."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from slotq.engine import FinishReason
from slotq.jobs.protocol.schemas import EntryKind, JobStatus
from tests.support.jobs import (
    SLOTQ_BIN,
    WorkerProcess,
    clean_env,
    job_request,
    jobs_in_queue,
    raw_entries,
    wait_for_workers,
)


async def _run_cli(*args: str, env: dict[str, str], cwd: Path, timeout: float = 120) -> tuple[int, str, str]:
    """Run `slotq ...` without blocking the event loop (an in-process worker shares it)."""
    proc = await asyncio.create_subprocess_exec(str(SLOTQ_BIN), *args, env=env, cwd=cwd,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode, out.decode(), err.decode()


# ---------------------------------------------------------------------- two worker processes
async def test_two_worker_processes_share_forty_jobs(client, redis_url, tiny_model_path, tmp_path):
    env = clean_env(redis_url=redis_url, model=tiny_model_path, slots=4, threads=1, ctx=512)
    procs = [WorkerProcess(name, env, tmp_path) for name in ("proc-w1", "proc-w2")]
    try:
        await wait_for_workers(client, {"proc-w1", "proc-w2"}, procs=procs)
        handles = [await client.enqueue(job_request(f"job number {i}", max_tokens=48)) for i in range(40)]
        assert len({h.id for h in handles}) == 40
        async with asyncio.timeout(240):
            results = await asyncio.gather(*(h.result() for h in handles))

        assert [r.id for r in results] == [h.id for h in handles]
        for r in results:
            assert r.status == JobStatus.SUCCEEDED, r
            assert r.attempts == 1, r
            assert r.usage.completion_tokens == 48
            assert r.finish_reason == FinishReason.LENGTH
        per_worker = Counter(r.worker for r in results)
        assert set(per_worker) == {"proc-w1", "proc-w2"}, per_worker
        assert sum(per_worker.values()) == 40

        # each job ran exactly once: one attempt, one final entry, every token streamed once
        for h, r in zip(handles, results):
            entries = await raw_entries(client, h.id)
            assert {e.attempt for e in entries} == {1}
            assert sum(e.final for e in entries) == 1 and entries[-1].final
            body = [e for e in entries if e.kind == EntryKind.CHUNK]
            assert "".join(e.text for e in body) == r.text
            assert sum(len(e.token_ids) for e in body) == 48

        info = await client.queue_info()
        assert info.queued == info.running == info.deferred == 0
        assert info.dead_letters == 0
        assert await jobs_in_queue(client) == 0
    finally:
        codes = [p.stop() for p in procs]
    # both left on SIGTERM by themselves (the exit status is checked in test_worker_exits_cleanly_on_sigterm)
    assert all(code is not None and code >= 0 for code in codes), [p.log_tail() for p in procs]


async def test_worker_exits_cleanly_on_sigterm(client, redis_url, tiny_model_path, tmp_path):
    env = clean_env(redis_url=redis_url, model=tiny_model_path, slots=2, threads=1, ctx=512)
    proc = WorkerProcess("proc-sigterm", env, tmp_path)
    try:
        await wait_for_workers(client, {"proc-sigterm"}, procs=[proc])
        job = await client.enqueue(job_request("before shutdown", max_tokens=4))
        assert (await job.result(timeout=60)).status == JobStatus.SUCCEEDED
    finally:
        code = proc.stop()
    assert code != -9, "needed SIGKILL"
    assert "Traceback" not in proc.log_tail(100_000), proc.log_tail()
    assert code == 0
    # the worker unregistered itself
    assert (await client.queue_info()).workers == []


# ---------------------------------------------------------------------- CLI
async def test_cli_help(tmp_path):
    code, out, _ = await _run_cli("--help", env=clean_env(), cwd=tmp_path, timeout=60)
    assert code == 0
    for command in ("worker", "enqueue", "status", "cancel", "result", "dlq", "demo"):
        assert command in out


async def test_cli_enqueue_json_and_status(client, worker, redis_url, tmp_path):
    env = clean_env(redis_url=redis_url)
    await wait_for_workers(client, {worker.id})

    code, out, err = await _run_cli("enqueue", "hi", "--max-tokens", "8", "--json", env=env, cwd=tmp_path)
    assert code == 0, err
    result = json.loads(out)       # exactly one JSON object on stdout
    assert isinstance(result, dict)
    for key in ("id", "status", "text", "finish_reason", "usage", "attempts"):
        assert key in result
    assert result["status"] == "succeeded"
    assert result["attempts"] == 1
    assert result["worker"] == worker.id
    assert result["usage"]["prompt_tokens"] > 0
    assert 0 <= result["usage"]["completion_tokens"] <= 8
    assert result["finish_reason"] in ("stop", "length")
    # the CLI's view matches the client's
    assert (await client.result(result["id"], timeout=10)).model_dump(mode="json") == result

    code, out, err = await _run_cli("status", "--json", env=env, cwd=tmp_path)
    assert code == 0, err
    status = json.loads(out)
    assert [w["id"] for w in status["workers"]] == [worker.id]
    assert status["workers"][0]["slots_total"] == 4
    assert status["slots_total"] == 4
    assert status["queued"] == 0 and status["dead_letters"] == 0
    assert [(m["queue"], m["status"], m["loaded_on"], m["queued"]) for m in status["models"]] == [
        ("slotq:queue", "loaded", [worker.id], 0)]                # the fleet's catalog: this worker's one model


async def test_cli_enqueue_rejects_bad_request(client, redis_url, tmp_path):
    code, out, err = await _run_cli("enqueue", "hi", "--max-tokens", "0", "--json",
                                    env=clean_env(redis_url=redis_url), cwd=tmp_path, timeout=60)
    assert code == 2
    assert "max_tokens" in err
    assert await jobs_in_queue(client) == 0


# ---------------------------------------------------------------------- demo
@pytest.mark.real_model
def test_demo_runs_to_completion(tmp_path):
    proc = subprocess.run([str(SLOTQ_BIN), "demo", "--jobs", "4", "--max-tokens", "16"],
                          env=clean_env(), cwd=tmp_path, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = " ".join(proc.stdout.split())        # rich wraps long lines
    assert "4 jobs arrived at once: all done in" in out and "s one at a time (" in out
    assert "tokens/s aggregate batched vs" in out
    assert any(verdict in out for verdict in ("wins a burst", "keeps the cores busy", "as much per job as it saves"))


@pytest.mark.real_model
def test_demo_tools_calls_a_tool_for_every_question(tmp_path):
    proc = subprocess.run([str(SLOTQ_BIN), "demo", "--tools", "--max-tokens", "16"],
                          env=clean_env(), cwd=tmp_path, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = " ".join(proc.stdout.split())
    assert "4 questions, 4 answered with a tool call" in out and "get_weather(" in out
