"""The ``slotq`` command's edges, driven as a user drives it: the real ``slotq`` executable as a
subprocess, a real Redis, and an in-process worker on the tiny model where a job must run.

* Ctrl-C or SIGTERM while ``slotq enqueue --stream/--json`` waits cancels the job the command created
  (``--detach`` keeps it; a job merely attached to through ``--idempotency-key`` is left alone), and
  the job's id is printed first, so it can always be followed or cancelled.
* A reader that goes away (``slotq result ID | head -5``) ends the command quietly, exit code 141.
* ``enqueue --json --timeout`` that runs out lets go of its job as Ctrl-C does, exit code 124.
* ``slotq dlq`` says when there is nothing, and fails on a job that is not a dead letter.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol import dead_letters
from slotq.jobs.protocol.payload import encode_payload
from slotq.jobs.protocol.schemas import JobStatus
from slotq.jobs.protocol.wire import ErrorInfo, FinishReason
from slotq.jobs.worker.worker import SlotqWorker
from tests.support.jobs import SLOTQ_BIN, clean_env, job_request

StartWorker = Callable[..., Awaitable[SlotqWorker]]

# One slot and a long context, so one job generates for seconds: long enough to interrupt it midway.
LONG_JOB_TOKENS = 8000
LONG_JOB_WORKER: dict[str, Any] = {"slots": 1, "ctx": 8192}
LONG_JOB = ["enqueue", "count to ten thousand", "--raw", "--ignore-eos", "--temperature", "0",
            "--max-tokens", str(LONG_JOB_TOKENS)]

JOB_ID_LINE = re.compile(r"^[0-9a-f]{32}$")
QUIET_STDERR_MARKERS = ("Traceback", "BrokenPipeError", "Exception ignored")


async def _slotq(*args: str, redis_url: str, cwd: Path,
                 stdout: int = asyncio.subprocess.PIPE) -> asyncio.subprocess.Process:
    """``slotq ARGS`` as a child process with stderr piped (an in-process worker shares this event
    loop, so nothing here may block it)."""
    return await asyncio.create_subprocess_exec(str(SLOTQ_BIN), *args, env=clean_env(redis_url=redis_url), cwd=cwd,
                                                stdout=stdout, stderr=asyncio.subprocess.PIPE)


async def _finish(proc: asyncio.subprocess.Process, already_read: tuple[bytes, bytes] = (b"", b""),
                  timeout: float = 60) -> tuple[int, str, str]:
    """Wait for the command; its exit code, stdout and stderr (after what the test ``already_read``
    of them)."""
    async with asyncio.timeout(timeout):
        out, err = await proc.communicate()
    assert proc.returncode is not None
    return (proc.returncode, (already_read[0] + (out or b"")).decode(errors="replace"),
            (already_read[1] + err).decode(errors="replace"))


async def _run(*args: str, redis_url: str, cwd: Path) -> tuple[int, str, str]:
    return await _finish(await _slotq(*args, redis_url=redis_url, cwd=cwd))


def _printed_job_id(stderr: str) -> str:
    """The job id the command printed first on stderr (stdout carries the text or the JSON)."""
    first = stderr.splitlines()[0] if stderr else ""
    assert JOB_ID_LINE.match(first), f"no job id on stderr's first line: {stderr[:300]!r}"
    return first


async def _interrupt_enqueue(extra: list[str], sig: signal.Signals, *, redis_url: str,
                             cwd: Path) -> tuple[int, str, str]:
    """Start the long job with ``slotq enqueue ... EXTRA`` and send ``sig`` once the command has shown
    its first output: text with --stream, else the id line. Its exit code, stdout and stderr."""
    proc = await _slotq(*LONG_JOB, *extra, redis_url=redis_url, cwd=cwd)
    assert proc.stdout is not None and proc.stderr is not None
    async with asyncio.timeout(60):
        if "--stream" in extra:
            first_output = (await proc.stdout.read(1), b"")
        else:
            first_output = (b"", await proc.stderr.readline())
    assert proc.returncode is None, "the command ended before it could be interrupted"
    proc.send_signal(sig)
    return await _finish(proc, first_output)


# ---------------------------------------------------------------------- Ctrl-C and SIGTERM
@pytest.mark.parametrize(("mode", "sig"), [("--stream", signal.SIGINT), ("--json", signal.SIGTERM)],
                         ids=["stream-SIGINT", "json-SIGTERM"])
async def test_interrupting_enqueue_cancels_the_job_it_created(mode: str, sig: signal.Signals, client: SlotqClient,
                                                               start_worker: StartWorker, redis_url: str,
                                                               tmp_path: Path) -> None:
    """Before: the job ran to its end after Ctrl-C, SIGTERM killed the command outright, and with
    --json no id had been printed."""
    await start_worker(**LONG_JOB_WORKER)
    code, out, err = await _interrupt_enqueue([mode], sig, redis_url=redis_url, cwd=tmp_path)

    job_id = _printed_job_id(err)
    result = await client.result(job_id, timeout=60)
    assert result.status == JobStatus.CANCELLED, result
    assert result.finish_reason == FinishReason.CANCELLED
    assert result.usage.completion_tokens < LONG_JOB_TOKENS
    assert code == 130, err
    assert f"job {job_id} cancelled" in err
    if mode == "--json":
        assert out == ""                  # no half-written JSON: stdout is one object or nothing
    assert not any(marker in err for marker in QUIET_STDERR_MARKERS), err


@pytest.mark.slow
async def test_interrupting_enqueue_with_detach_leaves_the_job_running(client: SlotqClient, start_worker: StartWorker,
                                                                       redis_url: str, tmp_path: Path) -> None:
    await start_worker(**LONG_JOB_WORKER)
    code, out, err = await _interrupt_enqueue(["--stream", "--detach"], signal.SIGINT,
                                              redis_url=redis_url, cwd=tmp_path)

    job_id = _printed_job_id(err)
    result = await client.result(job_id, timeout=240)
    assert result.status == JobStatus.SUCCEEDED, result
    assert result.usage.completion_tokens == LONG_JOB_TOKENS
    assert code == 130, err                # interrupted before the stream ended
    assert out.strip() and len(out) < len(result.text)
    assert f"job {job_id} keeps running (--detach)" in err and f"slotq cancel {job_id}" in err


async def test_interrupting_enqueue_leaves_a_job_it_only_attached_to(client: SlotqClient, start_worker: StartWorker,
                                                                     redis_url: str, tmp_path: Path) -> None:
    """Another producer created the job; this command found it by its idempotency key and must not
    cancel it on the way out."""
    await start_worker(**LONG_JOB_WORKER)
    theirs = await client.enqueue(job_request("somebody else's job", max_tokens=LONG_JOB_TOKENS,
                                              idempotency_key="shared-key"))
    code, _out, err = await _interrupt_enqueue(["--stream", "--idempotency-key", theirs.id], signal.SIGINT,
                                               redis_url=redis_url, cwd=tmp_path)

    assert code == 130, err
    assert err.startswith(f"{theirs.id}\n")
    assert f"job {theirs.id} keeps running (--idempotency-key matched a job this command did not create)" in err
    assert await theirs.status() == JobStatus.RUNNING
    assert await theirs.cancel()          # done checking: free the worker


# ---------------------------------------------------------------------- a reader that goes away
def _closed_pipe() -> int:
    """The write end of a pipe whose reader is already gone, as `| head -5` is once it has its lines."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    return write_end


async def test_result_into_a_closed_pipe_exits_quietly(client: SlotqClient, redis_url: str, tmp_path: Path) -> None:
    """Before: "Exception ignored ... BrokenPipeError" on stderr and exit code 120."""
    job = await client.enqueue(job_request("never runs"))
    assert await job.cancel()             # no worker: the job gets its (cancelled) result at once
    write_end = _closed_pipe()
    try:
        proc = await _slotq("result", job.id, redis_url=redis_url, cwd=tmp_path, stdout=write_end)
    finally:
        os.close(write_end)
    code, _out, err = await _finish(proc)
    assert code == 141, err
    assert err == ""


async def test_enqueue_stream_into_a_closed_pipe_cancels_its_job(client: SlotqClient, start_worker: StartWorker,
                                                                 redis_url: str, tmp_path: Path) -> None:
    """Before: a BrokenPipeError traceback, and the job ran on with nobody reading it."""
    await start_worker(**LONG_JOB_WORKER)
    write_end = _closed_pipe()
    try:
        proc = await _slotq(*LONG_JOB, "--stream", redis_url=redis_url, cwd=tmp_path, stdout=write_end)
    finally:
        os.close(write_end)
    code, _out, err = await _finish(proc)

    job_id = _printed_job_id(err)
    assert code == 141, err
    assert f"the reader of the output went away; job {job_id} cancelled" in err
    assert not any(marker in err for marker in QUIET_STDERR_MARKERS), err
    assert (await client.result(job_id, timeout=60)).status == JobStatus.CANCELLED


@pytest.mark.parametrize("detach", [False, True], ids=["cancels", "detach-keeps"])
async def test_enqueue_json_that_times_out_lets_go_of_its_job(detach: bool, client: SlotqClient,
                                                              start_worker: StartWorker, redis_url: str,
                                                              tmp_path: Path) -> None:
    """Before: `--timeout` ended the command (exit 1) and left the job it created running for nobody, unlike
    Ctrl-C. Now the wait's end is the caller's, as with Ctrl-C: the job is cancelled unless --detach."""
    await start_worker(**LONG_JOB_WORKER)
    extra = ["--json", "--timeout", "1", *(["--detach"] if detach else [])]
    code, out, err = await _run(*LONG_JOB, *extra, redis_url=redis_url, cwd=tmp_path)

    job_id = _printed_job_id(err)
    assert code == 124, err
    assert out == ""
    assert "no result within --timeout 1 s" in err
    assert not any(marker in err for marker in QUIET_STDERR_MARKERS), err
    if detach:
        assert f"job {job_id} keeps running (--detach)" in err
        assert await client.status(job_id) in (JobStatus.QUEUED, JobStatus.RUNNING)
        await client.cancel(job_id)
    else:
        assert f"job {job_id} cancelled" in err
        assert (await client.result(job_id, timeout=60)).status == JobStatus.CANCELLED


# ---------------------------------------------------------------------- dead letters
async def test_dlq_list_says_when_there_are_none(redis_url: str, tmp_path: Path) -> None:
    code, out, err = await _run("dlq", "list", redis_url=redis_url, cwd=tmp_path)
    assert (code, out, err) == (0, "", "no dead-lettered jobs\n")


async def test_dlq_list_shows_how_many_attempts_were_interruptions(client: SlotqClient, redis_url: str,
                                                                   tmp_path: Path) -> None:
    """A job dead-lettered after 5 attempts of which 4 were lost while making progress reads very
    differently from one that failed 5 times: the listing says which. Before: attempts only."""
    await dead_letters.record(client.redis, "lost-often", encode_payload(job_request()),
                              ErrorInfo(code="interruptions_exhausted", message="lost", retryable=True), attempts=5,
                              enqueued_at=None, interruptions=4)
    code, out, err = await _run("dlq", "list", redis_url=redis_url, cwd=tmp_path)
    assert (code, err) == (0, ""), err
    assert out == "lost-often  attempts=5 (interrupted=4)  interruptions_exhausted: lost\n"


async def test_dead_letters_are_counted_by_reason(client: SlotqClient, redis_url: str, tmp_path: Path) -> None:
    """``slotq status`` says why jobs were dead-lettered and ``dlq list`` how many workers a job
    killed; a job dead-lettered twice counts once, a purged one no more. Before: a total only."""
    payload = encode_payload(job_request())
    killed = ErrorInfo(code="killed_its_worker", message="killed 2 workers", retryable=False)
    exhausted = ErrorInfo(code="tries_exhausted", message="tries", retryable=True)
    for job_id, error in [("killer", killed), ("killer", killed), ("flaky", exhausted), ("flakier", exhausted)]:
        await dead_letters.record(client.redis, job_id, payload, error, attempts=3, enqueued_at=None,
                                  worker_deaths=2 if error is killed else 0)
    assert await dead_letters.by_reason(client.redis) == {"killed_its_worker": 1, "tries_exhausted": 2}
    code, out, err = await _run("status", redis_url=redis_url, cwd=tmp_path)
    assert code == 0, err
    assert "3 dead letters (1 killed_its_worker, 2 tries_exhausted)" in out, out
    code, out, err = await _run("dlq", "list", redis_url=redis_url, cwd=tmp_path)
    assert "killer  attempts=3 (interrupted=0) worker_deaths=2  killed_its_worker: killed 2 workers\n" in out, out
    code, out, err = await _run("dlq", "purge", "flaky", redis_url=redis_url, cwd=tmp_path)
    assert code == 0, err
    assert await dead_letters.by_reason(client.redis) == {"killed_its_worker": 1, "tries_exhausted": 1}


@pytest.mark.parametrize("action", ["requeue", "purge"])
async def test_dlq_action_on_a_job_that_is_no_dead_letter_fails(action: str, client: SlotqClient, redis_url: str,
                                                                tmp_path: Path) -> None:
    """Before: exit code 0 ("purge" even printed "purged 1"), while `dlq show nosuch` exits 1."""
    code, out, err = await _run("dlq", action, "nosuch", redis_url=redis_url, cwd=tmp_path)
    assert code == 1, (out, err)
    assert "no dead letter nosuch" in err

    await dead_letters.record(client.redis, "dead-one", encode_payload(job_request()),
                              ErrorInfo(code="engine_error", message="test", retryable=True), attempts=3,
                              enqueued_at=None)
    code, out, err = await _run("dlq", action, "dead-one", redis_url=redis_url, cwd=tmp_path)
    assert code == 0, err
    assert out == ("dead-one requeued\n" if action == "requeue" else "purged 1\n")
    assert await dead_letters.count(client.redis) == 0


# ---------------------------------------------------------------------- help
async def test_enqueue_help_explains_the_new_flags(redis_url: str, tmp_path: Path) -> None:
    code, out, err = await _run("enqueue", "--help", redis_url=redis_url, cwd=tmp_path)
    assert code == 0, err
    text = " ".join(out.split())
    for expected in ("--detach", "leaves the job running", "Ctrl-C or SIGTERM cancels the job", "--ignore-eos"):
        assert expected in text, expected


def test_make_bench_runs_every_benchmark_slotq_bench_offers() -> None:
    """``make bench`` (the Makefile's ``bench`` target) runs each of ``slotq bench``'s choices at least once;
    one added to the command but not to the target was left out of every full run (rerank, lora, ...)."""
    import argparse

    from slotq.jobs.cli.parser import build_parser
    from tests.support import REPO_ROOT

    [commands] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    [which] = [a for a in commands.choices["bench"]._actions if a.dest == "which"]
    target = re.search(r"^bench:.*\n((?:\t.*\n)+)", (REPO_ROOT / "Makefile").read_text(), re.MULTILINE)
    assert target is not None
    run = set(re.findall(r"slotq bench ([\w-]+)", target.group(1)))
    assert set(which.choices or ()) == run
