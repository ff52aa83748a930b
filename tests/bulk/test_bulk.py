"""``slotq bulk`` end to end: a real Valkey, real ``slotq worker`` processes on the tiny model, and
``slotq bulk`` as a subprocess, interrupted (SIGINT and SIGKILL) and run again.

Worker logs say ``job <id> attempt <n> started`` once per attempt: counting those lines shows how
many times each line was generated, across runs of the bulk command.
"""

from __future__ import annotations

import asyncio
import builtins
import gzip
import json
import os
import re
import signal
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pytest

from slotq.jobs.bulk import BulkOptions, open_bulk, run_bulk
from slotq.jobs.protocol.keys import result_key, stream_key
from slotq.jobs.protocol.schemas import JobRequest, JobStatus
from slotq.jobs.protocol.wire import ErrorInfo
from tests.support.jobs import SLOTQ_BIN, WorkerProcess, clean_env, job_request, wait_for_workers

STARTED_RE = re.compile(r"job (bulk:[0-9a-f]+:\d+|\S+) attempt (\d+) started")


def slotq_lines(n: int, max_tokens: int = 4) -> list[dict[str, Any]]:
    return [{"id": f"req-{i}", "prompt": f"prompt number {i}", "max_tokens": max_tokens, "ignore_eos": True,
             "sampling": {"temperature": 0}, "metadata": {"i": i}} for i in range(1, n + 1)]


def write_jsonl(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def starts(procs: list[WorkerProcess]) -> list[tuple[str, int]]:
    """(job id, attempt) of every job start in the workers' logs."""
    return [(m[1], int(m[2])) for p in procs for m in STARTED_RE.finditer(p.log.read_text(errors="replace"))]


async def bulk_process(*args: str, env: dict[str, str], cwd: Path) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(str(SLOTQ_BIN), "bulk", *args, env=env, cwd=cwd,
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)


async def run_bulk_cli(*args: str, env: dict[str, str], cwd: Path, stdin: bytes = b"",
                       timeout: float = 180) -> tuple[int, str, str]:
    proc = await bulk_process(*args, env=env, cwd=cwd)
    async with asyncio.timeout(timeout):
        out, err = await proc.communicate(stdin)
    return proc.returncode or 0, out.decode(), err.decode()


async def wait_for_lines(path: Path, at_least: int, proc: asyncio.subprocess.Process, timeout: float = 120) -> None:
    async with asyncio.timeout(timeout):
        while not path.exists() or path.read_bytes().count(b"\n") < at_least:
            assert proc.returncode is None, "slotq bulk ended before the interruption"
            await asyncio.sleep(0.02)


async def leftover_keys(client) -> list[bytes]:
    """Results and streams left in Redis (each worker's one flush mark is not a job's)."""
    return [k async for k in client.redis.scan_iter(match="arq:result:*")] + \
        [k async for k in client.redis.scan_iter(match="slotq:stream:*")]


def fleet(names: tuple[str, ...], redis_url: str, model: Path, cwd: Path, **env: Any) -> list[WorkerProcess]:
    base = {"redis_url": redis_url, "model": model, "slots": 4, "threads": 1, "ctx": 512} | env
    return [WorkerProcess(name, clean_env(**base), cwd) for name in names]


# ---------------------------------------------------------------------- complete, ids, no duplicates
async def test_500_lines_on_two_workers(client, redis_url, tiny_model_path, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", slotq_lines(500))
    procs = fleet(("bulk-w1", "bulk-w2"), redis_url, tiny_model_path, tmp_path)
    try:
        await wait_for_workers(client, {"bulk-w1", "bulk-w2"}, procs=procs)
        code, out, err = await run_bulk_cli(str(inp), "-o", "out.jsonl", "--window", "32", "--json",
                                            env=clean_env(redis_url=redis_url), cwd=tmp_path)
    finally:
        for p in procs:
            p.stop()
    assert code == 0, err
    summary = json.loads(out)
    assert summary["total"] == summary["succeeded"] == 500 and summary["failed"] == 0 and summary["all_succeeded"]
    records = read_jsonl(tmp_path / "out.jsonl")
    assert len(records) == 500
    assert sorted(r["line"] for r in records) == list(range(1, 501))          # complete, no duplicates
    for r in records:                                                          # each output is its line's
        assert r["id"] == f"req-{r['line']}" and r["metadata"] == {"i": r["line"]}
        assert r["status"] == "succeeded" and r["usage"]["completion_tokens"] == 4
    assert {r["worker"] for r in records} == {"bulk-w1", "bulk-w2"}
    assert (tmp_path / "out.errors.jsonl").read_text() == ""
    assert Counter(attempt for _, attempt in starts(procs)) == {1: 500}       # each line generated once
    assert await leftover_keys(client) == []                                   # Redis holds nothing of the run


# ---------------------------------------------------------------------- interrupted twice, then finished
async def test_interrupted_runs_resume_without_regenerating(client, redis_url, tiny_model_path, tmp_path):
    n = 400
    inp = write_jsonl(tmp_path / "in.jsonl", slotq_lines(n, max_tokens=24))      # long enough to interrupt
    out = tmp_path / "out.jsonl"
    env = clean_env(redis_url=redis_url)
    procs = fleet(("resume-w1", "resume-w2"), redis_url, tiny_model_path, tmp_path)
    try:
        await wait_for_workers(client, {"resume-w1", "resume-w2"}, procs=procs)
        args = (str(inp), "-o", str(out), "--window", "24", "--json")

        first = await bulk_process(*args, env=env, cwd=tmp_path)              # Ctrl-C at a third
        await wait_for_lines(out, n // 3, first)
        first.send_signal(signal.SIGINT)
        stdout, _ = await asyncio.wait_for(first.communicate(), 60)
        assert first.returncode == 130
        interrupted = json.loads(stdout)
        assert interrupted["interrupted"] and not interrupted["all_succeeded"]

        second = await bulk_process(*args, env=env, cwd=tmp_path)             # a crash at two thirds
        await wait_for_lines(out, 2 * n // 3, second)
        second.kill()
        await second.wait()

        code, stdout, err = await run_bulk_cli(*args, env=env, cwd=tmp_path)  # and to the end
        assert code == 0, err
        final = json.loads(stdout)
        assert final["done_before"] >= 2 * n // 3 and final["done_before"] + final["succeeded"] == n
    finally:
        for p in procs:
            p.stop()
    records = read_jsonl(out)
    assert sorted(r["line"] for r in records) == list(range(1, n + 1))       # complete, no duplicate lines
    assert all(r["id"] == f"req-{r['line']}" for r in records)
    started = starts(procs)
    assert Counter(attempt for _, attempt in started) == {1: n}              # no line was generated twice
    assert {job_id for job_id, _ in started} == {r["job_id"] for r in records}
    assert await leftover_keys(client) == []


# ---------------------------------------------------------------------- OpenAI Batch lines, bad lines
async def test_openai_batch_lines_and_bad_lines(client, redis_url, tiny_model_path, tmp_path):
    def chat(custom_id: str, **body: Any) -> dict[str, Any]:
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "tiny", "messages": [{"role": "user", "content": f"hello {custom_id}"}],
                         "max_tokens": 6, "temperature": 0} | body}

    lines: list[Any] = [
        chat("c1"),
        {"custom_id": "t1", "method": "POST", "url": "/v1/completions",
         "body": {"model": "tiny", "prompt": "Once upon", "max_tokens": 5, "n": 2, "seed": 3}},
        "{not json",                                                           # line 3
        chat("c2", temperature=9),                                             # line 4: out of range
        {"custom_id": "e1", "method": "POST", "url": "/v1/embeddings", "body": {"model": "tiny", "input": "x"}},  # 5
        chat("c1"),                                                            # line 6: repeated custom_id
        "",                                                                    # blank: skipped
        chat("long", max_tokens=505),                                          # line 8: prompt + 505 > ctx 512
        chat("c3", functions=[{"name": "f"}]),                                 # line 9: not supported
        {"prompt": "a slotq line", "max_tokens": 3},                           # line 10: mixed formats work
        chat("c4", max_completion_tokens=4, response_format={"type": "json_object"}),
        chat("huge", max_tokens=600),                                          # line 12: refused at enqueue
        chat("m2", model="another-model"),                                     # line 13: another model's line
    ]
    inp = write_jsonl(tmp_path / "batch.jsonl", lines)
    env = clean_env(redis_url=redis_url)
    procs = fleet(("batch-w1",), redis_url, tiny_model_path, tmp_path)
    try:
        await wait_for_workers(client, {"batch-w1"}, procs=procs)
        code, out, err = await run_bulk_cli("-", "-o", "out.jsonl", "--errors", "bad.jsonl", "--quiet",  # gzip on stdin
                                            stdin=gzip.compress(inp.read_bytes()), env=env, cwd=tmp_path)
        assert code == 1, err                 # not every line succeeded
        assert out == ""                      # --quiet
        assert list(tmp_path.glob(".slotq-bulk-stdin-*")) == []       # the spooled copy of stdin is gone
        # the same text from the plain file is the same run: finished lines are done, failed ones are retried
        again, out, err = await run_bulk_cli(str(inp), "-o", "out.jsonl", "--errors", "bad.jsonl", "--json",
                                             env=env, cwd=tmp_path)
        assert again == 1, err
        assert {k: json.loads(out)[k] for k in ("total", "done_before", "succeeded", "failed")} == {
            "total": 12, "done_before": 4, "succeeded": 0, "failed": 8}
        # an output file of another input is refused
        other = write_jsonl(tmp_path / "other.jsonl", slotq_lines(2))
        refused, _, err = await run_bulk_cli(str(other), "-o", "out.jsonl", env=env, cwd=tmp_path)
        assert refused == 2 and "another input" in err, err
    finally:
        for p in procs:
            p.stop()
    records = {r.get("custom_id", r.get("id")): r for r in read_jsonl(tmp_path / "out.jsonl")}
    assert set(records) == {"c1", "t1", "10", "c4"}
    c1 = records["c1"]
    assert c1["id"].startswith("batch_req_") and c1["error"] is None
    assert c1["response"]["status_code"] == 200
    body = c1["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] <= 6
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    t1 = records["t1"]["response"]["body"]
    assert t1["object"] == "text_completion" and [c["index"] for c in t1["choices"]] == [0, 1]
    assert records["10"]["status"] == "succeeded" and records["10"]["line"] == 10
    assert records["c4"]["response"]["body"]["usage"]["completion_tokens"] <= 4

    errors = {r["line"]: r for r in read_jsonl(tmp_path / "bad.jsonl")}
    assert set(errors) == {3, 4, 5, 6, 8, 9, 12, 13}
    assert errors[3]["error"]["code"] == "invalid_json"
    def refused(number: int) -> dict[str, Any]:
        """A body the endpoint refused: the gateway's HTTP answer, no job (no request id)."""
        response = errors[number]["response"]
        assert errors[number]["error"] is None and response["status_code"] == 400 and response["request_id"] is None
        return response["body"]["error"]

    assert errors[4]["custom_id"] == "c2"
    assert refused(4)["param"] == "temperature" and "less than or equal to 2" in refused(4)["message"]
    assert (refused(5)["param"], refused(5)["code"]) == ("model", "wrong_model_kind")   # a text generator's queue
    assert errors[6]["error"]["code"] == "duplicate_id" and "line 1" in errors[6]["error"]["message"]
    assert errors[8]["custom_id"] == "long"       # ran and failed in the worker: OpenAI's error response shape
    assert errors[8]["response"]["status_code"] == 400
    assert "max_tokens" in errors[8]["response"]["body"]["error"]["message"]
    assert (refused(9)["param"], refused(9)["code"]) == ("functions", "unsupported_parameter")
    assert (refused(12)["param"], refused(12)["code"]) == ("max_tokens", "context_length_exceeded")   # at enqueue
    assert refused(13)["param"] == "model"                 # a run feeds one queue: the line names its model's
    assert "'another-model' is not served on queue" in refused(13)["message"] and "'tiny'" in refused(13)["message"]


# ---------------------------------------------------------------------- lanes: interactive goes first
async def test_interactive_job_starts_before_queued_bulk_jobs(client, redis_url, tiny_model_path, tmp_path):
    """One worker with 2 slots, a bulk run keeping 12 lines in Redis (2 running, 10 waiting). An
    interactive job enqueued then is claimed at the next slot turnover, before every bulk job that
    was waiting when it arrived; the bulk run still finishes every line."""
    # Lines long enough that the run's window fills while both slots are busy: with a KV stream per
    # slot, 48-token lines finished as fast as the run enqueued them and 8 never waited at once.
    inp = write_jsonl(tmp_path / "in.jsonl", slotq_lines(40, max_tokens=240))
    procs = fleet(("lanes-w1",), redis_url, tiny_model_path, tmp_path, slots=2)
    try:
        await wait_for_workers(client, {"lanes-w1"}, procs=procs)
        run = asyncio.create_task(run_bulk(client, inp, tmp_path / "out.jsonl", options=BulkOptions(window=12)))
        async with asyncio.timeout(60):
            while True:
                lanes = {c.lane: c for c in await client.queue.counts()}
                if lanes["bulk"].running == 2 and lanes["bulk"].waiting >= 8:
                    break
                await asyncio.sleep(0.005)
        waiting_before = set(await client.redis.zrange(client.queue.keys.waiting("bulk"), 0, -1))
        job = await client.enqueue(job_request("an interactive request", max_tokens=4))
        waiting_bulk = {m.decode() for m in await client.redis.zrange(client.queue.keys.waiting("bulk"), 0, -1)}
        assert len(waiting_bulk) >= 6
        assert (await job.result(timeout=60)).status == JobStatus.SUCCEEDED
        summary = await asyncio.wait_for(run, 120)
    finally:
        for p in procs:
            p.stop()
    assert summary.all_succeeded and summary.succeeded == 40
    order = [job_id for job_id, _ in starts(procs)]           # one worker: its log is the claim order
    position = order.index(job.id)
    # Jobs claimed by one claim call (both slots freed by the same step) log their start in either
    # order, so one bulk job claimed beside the interactive job may log first; no more than that.
    logged_first = [b for b in waiting_bulk if order.index(b) < position]
    assert len(logged_first) <= 1, (position, order)
    # within one slot turnover: at most the 2 slots' worth of bulk jobs, claimed as it arrived, went first
    overtaken = [j for j in order[:position] if j.encode() in waiting_before]
    assert len(overtaken) <= 2, overtaken


# ---------------------------------------------------------------------- forget
async def test_forget_removes_a_finished_job_only(client, worker):
    done = await client.enqueue(job_request("finished", max_tokens=2))
    assert (await done.result(timeout=60)).status == JobStatus.SUCCEEDED
    worker.request_stop("test", grace_s=0)
    await asyncio.sleep(0.2)
    queued = await client.enqueue(JobRequest(prompt="still queued", max_tokens=2))
    assert await client.forget([done.id, queued.id]) == 1
    assert not await client.redis.exists(result_key(done.id), stream_key(done.id))
    assert await client.finished([done.id, queued.id]) == {}
    assert (await client.status(queued.id)) == JobStatus.QUEUED


# ---------------------------------------------------------------------- cancel (the Batch API's cancel)
@pytest.mark.parametrize("reason",
                         [None, ErrorInfo(code="batch_expired", message="the window ran out", retryable=False)],
                         ids=["plain", "with-a-reason"])
async def test_cancel_ends_the_lines_in_flight_as_cancelled(reason, client, redis_url, tiny_model_path, tmp_path):
    """A plain cancel lists the lines it cut short; a cancel with a reason (a batch's completion
    window ran out) lists every line that did not finish, started or not, with that reason."""
    inp = write_jsonl(tmp_path / "in.jsonl", slotq_lines(60, max_tokens=400))     # slow enough to cancel
    procs = fleet(("cancel-w1",), redis_url, tiny_model_path, tmp_path, slots=2)
    try:
        await wait_for_workers(client, {"cancel-w1"}, procs=procs)
        async with open_bulk(client, inp, tmp_path / "out.jsonl", options=BulkOptions(window=8)) as run:
            task = asyncio.create_task(run.run())
            async with asyncio.timeout(60):
                while not (tmp_path / "out.jsonl").exists() or (tmp_path / "out.jsonl").read_text().count("\n") < 2:
                    await asyncio.sleep(0.01)
            await run.cancel(reason)
            summary = await asyncio.wait_for(task, 60)
    finally:
        for p in procs:
            p.stop()
    assert not summary.interrupted and not summary.all_succeeded and summary.left_in_queue == 0
    errors = read_jsonl(tmp_path / "out.errors.jsonl")
    code = "cancelled" if reason is None else reason.code
    assert len(errors) == summary.failed > 0 and {e["error"]["code"] for e in errors} == {code}
    done = {r["line"] for r in read_jsonl(tmp_path / "out.jsonl")}
    assert len(done) == summary.succeeded and done.isdisjoint(e["line"] for e in errors)
    if reason is None:
        assert summary.succeeded + summary.failed < 60              # the rest were never enqueued
    else:
        assert sorted(done | {e["line"] for e in errors}) == list(range(1, 61))
    assert (await client.queue_info()).queued == 0 and await leftover_keys(client) == []


# ---------------------------------------------------------------------- the event loop never waits on a disk
class ThreadNotingFile:
    """A real open file that notes which thread makes each call on it (``calls``: file name, method, thread id)."""

    def __init__(self, file: IO[bytes], calls: list[tuple[str, str, int]]) -> None:
        self._file = file
        self._calls = calls

    def _note(self, method: str) -> None:
        self._calls.append((Path(self._file.name).name, method, threading.get_ident()))

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._file, name)
        if not callable(attr):
            return attr

        def noted(*args: Any, **kwargs: Any) -> Any:
            self._note(name)
            return attr(*args, **kwargs)
        return noted

    def __iter__(self) -> ThreadNotingFile:
        return self

    def __next__(self) -> bytes:
        self._note("__next__")
        return next(self._file)

    def __enter__(self) -> ThreadNotingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture
def file_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, int]]:
    """(file name, call, thread id) of every call on a file in ``tmp_path`` (opened with ``open``,
    which gzip uses too) and every ``stat``/``lstat`` of one, while the test runs."""
    calls: list[tuple[str, str, int]] = []
    real_open, real_stat, real_lstat = builtins.open, os.stat, os.lstat

    def ours(path: Any) -> bool:
        return isinstance(path, str | os.PathLike) and Path(os.fsdecode(path)).parent == tmp_path

    def noting_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        opened = real_open(file, *args, **kwargs)
        return ThreadNotingFile(opened, calls) if ours(file) else opened

    def noting(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(path: Any, *args: Any, **kwargs: Any) -> Any:
            if ours(path):
                calls.append((Path(os.fsdecode(path)).name, name, threading.get_ident()))
            return real(path, *args, **kwargs)
        return call

    monkeypatch.setattr(builtins, "open", noting_open)
    monkeypatch.setattr(os, "stat", noting("stat", real_stat))
    monkeypatch.setattr(os, "lstat", noting("lstat", real_lstat))
    return calls


async def test_input_and_output_files_are_read_and_written_off_the_event_loop(client, worker, tmp_path, file_calls):
    """The gateway runs Batch API jobs as bulk runs inside its own event loop, beside every HTTP
    request it serves, so no call on a run's files (checks, gzip reads, output writes, fsync, close)
    may block that loop: each runs in a thread."""
    inp = tmp_path / "in.jsonl.gz"
    inp.write_bytes(gzip.compress(b"".join(json.dumps(line).encode() + b"\n" for line in slotq_lines(30))))
    file_calls.clear()
    summary = await run_bulk(client, inp, tmp_path / "out.jsonl", options=BulkOptions(window=8, commit_s=0.05))
    calls = list(file_calls)
    assert summary.all_succeeded and len(read_jsonl(tmp_path / "out.jsonl")) == 30
    seen = {(name, call) for name, call, _ in calls}
    assert {("in.jsonl.gz", "stat"), ("in.jsonl.gz", "read"), ("out.jsonl", "write"), ("out.jsonl", "fileno"),
            ("out.jsonl", "close")} <= seen                                   # the spy saw the run's files
    loop_thread = threading.get_ident()
    assert sorted({(name, call) for name, call, thread in calls if thread == loop_thread}) == []
