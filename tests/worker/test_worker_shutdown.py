"""A worker always exits within its bound, and says nothing false on its way (issue 18).

* SIGTERM while the heartbeat's wait has just ended: Python 3.11's ``asyncio.wait_for`` swallowed
  the stop's cancellation there (CPython gh-86296), the heartbeat beat on, and the worker never
  exited. ``SLOTQ_FAULT_BEAT_BEFORE_STOP`` forces that interleaving in a real ``slotq worker``.
* A heartbeat RENEW that reaches Redis after the job's FINISH: the job succeeded, and yet the
  worker logged that its lease had expired and the job was requeued.
  ``SLOTQ_FAULT_RENEW_AFTER_FINISH`` forces that order.
* SIGTERM while the worker compiles constraints that take it seconds (issue 32). With llama.cpp's
  grammar sampler the worker handed its jobs back at once, then waited for the builds (the loop's
  default executor is joined at exit) until its exit deadline ended it with code 70 (180 kB GBNF:
  11 s per build, two per job). llguidance (engine/constraints.py) compiles under the
  ``SLOTQ_GRAMMAR_*`` bounds and lets the event loop run meanwhile; this test keeps it so.
* SIGTERM while an aborted attempt writes its final entry and Redis is down: that write is shielded
  from the hand-back's cancel, and retried for ever after the worker stopped; it ends with its bound.
* The deploy manifests' grace periods outlast the bound.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from redis.asyncio import Redis

from slotq.engine import GenerationRequest, RequestHandle, TextDelta
from slotq.engine.outbox import StepReceiver
from slotq.jobs.protocol.keys import stream_key
from slotq.jobs.protocol.payload import encode_payload
from slotq.jobs.protocol.schemas import JobStatus
from slotq.jobs.protocol.streams import StreamOpening
from slotq.jobs.redis_server import EmbeddedRedis
from slotq.jobs.worker import job_run
from slotq.jobs.worker.fault_injection import BEAT_BEFORE_STOP, RENEW_AFTER_FINISH
from slotq.jobs.worker.job_run import JobRun
from slotq.jobs.worker.settings import WorkerSettings
from slotq.jobs.worker.stream_writer import StreamWriter
from slotq.jobs.worker.worker import EXIT_MARGIN_S
from tests.support import REPO_ROOT
from tests.support.jobs import WorkerProcess, clean_env, job_request, wait_for_workers

DRAIN_GRACE_S = 1
BOUND_S = DRAIN_GRACE_S + EXIT_MARGIN_S
# Legal, 60 kB, within the default SLOTQ_GRAMMAR_* limits and GenerationParams' 200,000 characters:
# the slowest grammar to compile found for the tiny model (0.9 s to prepare a request here, more
# with four at once; 30,000 optional rules in a row, about the most llguidance's parser takes).
SLOW_GRAMMAR = "root ::= " + "x " * 24_000 + '\nx ::= "a"?\n'


async def _sigterm(worker: WorkerProcess) -> tuple[int, float]:
    """SIGTERM the worker; its exit code and the seconds it took to exit, or fail past its bound."""
    worker.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    try:
        code = await asyncio.to_thread(worker.proc.wait, BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the worker did not exit within its bound of {BOUND_S} s after SIGTERM:\n{worker.log_tail()}")
    return code, time.monotonic() - sent


async def test_sigterm_exits_within_the_bound_when_a_beat_races_the_stop(client, redis_url, tiny_model_path,
                                                                          tmp_path):
    env = clean_env(redis_url=redis_url, model=tiny_model_path, slots=1, threads=1, ctx=256, lock_ttl_s=3,
                    drain_grace_s=DRAIN_GRACE_S) | {BEAT_BEFORE_STOP: "1"}
    worker = WorkerProcess("beat-races-stop", env, tmp_path)
    try:
        await wait_for_workers(client, {"beat-races-stop"}, procs=[worker])
        assert (await (await client.enqueue(job_request(max_tokens=8))).result(timeout=60)).status == \
            JobStatus.SUCCEEDED
        code, took = await _sigterm(worker)
    finally:
        worker.stop()
    log = worker.log_tail(20_000)
    assert "the beat event fired right before the stop" in log, log     # the race really was forced
    assert code == 0, log            # a clean exit, not the exit deadline's
    assert took < BOUND_S


async def test_sigterm_exits_within_the_bound_while_grammars_are_being_compiled(client, redis_url, tiny_model_path,
                                                                               tmp_path):
    """Four jobs whose grammar takes the worker seconds: SIGTERM once they run, and the worker
    hands them back and exits cleanly within its bound."""
    env = clean_env(redis_url=redis_url, model=tiny_model_path, slots=4, threads=1, ctx=256, lock_ttl_s=3,
                    drain_grace_s=DRAIN_GRACE_S)
    worker = WorkerProcess("builds-grammars", env, tmp_path)
    try:
        await wait_for_workers(client, {"builds-grammars"}, procs=[worker])
        ids = [(await client.enqueue(job_request(f"slow grammar {i}", max_tokens=8, ignore_eos=False,
                                                 sampling={"temperature": 0, "grammar": SLOW_GRAMMAR}))).id
               for i in range(4)]
        async with asyncio.timeout(30):
            while not all([(await client.queue.place(job_id))[1] for job_id in ids]):
                await asyncio.sleep(0.05)
        code, took = await _sigterm(worker)
    finally:
        worker.stop()
    log = worker.log_tail(20_000)
    assert code == 0, log            # a clean exit, not the exit deadline's
    assert took < BOUND_S
    assert log.count("handed back") == 4, log
    assert await client.finished(ids) == {}, log                           # none was done with its grammar
    assert [await client.queue.place(job_id) for job_id in ids] == [("interactive", False)] * 4


async def test_a_job_that_finished_is_not_reported_as_requeued(client, start_worker, monkeypatch, caplog):
    monkeypatch.setenv(RENEW_AFTER_FINISH, "1")
    caplog.set_level(logging.WARNING)
    worker = await start_worker(slots=1, lock_ttl_s=3)
    result = await (await client.enqueue(job_request(max_tokens=16))).result(timeout=60)
    assert result.status == JobStatus.SUCCEEDED, result

    async with asyncio.timeout(30):      # the held RENEW is sent, then the beat it belongs to ends
        while "RENEW sent after the jobs it names left" not in caplog.text:
            await asyncio.sleep(0.02)
        renewed_at = time.time()
        while not any(w.id == worker.id and w.updated_at > renewed_at for w in (await client.queue_info()).workers):
            await asyncio.sleep(0.05)
    assert "lease expired" not in caplog.text, caplog.text


def test_deploy_grace_periods_outlast_the_exit_bound():
    """Kubernetes and systemd must not SIGKILL a worker that is still within its exit bound."""
    deploy = REPO_ROOT / "deploy"
    configmap = yaml.safe_load((deploy / "kubernetes" / "configmap.yaml").read_text())
    bound_s = int(configmap["data"]["SLOTQ_DRAIN_GRACE_S"]) + EXIT_MARGIN_S
    deployment = yaml.safe_load((deploy / "kubernetes" / "worker-deployment.yaml").read_text())
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > bound_s
    unit = (deploy / "systemd" / "slotq-worker@.service").read_text()
    [stop_s] = re.findall(r"^TimeoutStopSec=(\d+)$", unit, re.MULTILINE)
    assert int(stop_s) > bound_s


class OneTokenThenGenerating:
    """The engine as the attempt sees it here: its request delivers one token, then generates on
    (no end in sight) until it is cancelled."""

    async def submit_async(self, request: GenerationRequest, receiver: StepReceiver) -> RequestHandle:
        handle = RequestHandle(self, request, receiver)
        asyncio.get_running_loop().call_soon(
            receiver.receive, [TextDelta(request_id=request.id, text="a", token_ids=[7], n_tokens=1)])
        return handle

    def cancel(self, request_id: str) -> None:
        """It generates on: a cancel changes nothing the attempt could see."""

    def prompt_tokens(self, request: GenerationRequest) -> list[int]:
        return [1, 2, 3]


async def test_a_final_write_during_a_redis_outage_ends_with_its_bound_after_shutdown(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """An aborted attempt writes its final entry under a shield, so the worker's hand-back (which
    cancels every attempt, again and again) does not cut it off. With Redis down that write
    retried for ever: the attempt was gone, the worker stopped, and the write went on. It now ends
    with its bound, and says what it did not write."""
    monkeypatch.setattr(job_run, "SHIELDED_WRITE_BOUND_S", 0.5)
    caplog.set_level(logging.WARNING)
    server = EmbeddedRedis(tmp_path / "redis", port=0, fsync="no")
    server.start()
    redis = Redis.from_url(server.url, socket_timeout=2)
    settings = WorkerSettings(redis_url=server.url, slots=1)
    writer = StreamWriter(redis, flush_ms=1, maxlen=1000, ttl_s=60)
    writer.start()
    aborted = False
    try:
        run = JobRun(engine=OneTokenThenGenerating(), writer=writer, settings=settings, worker_id="w",
                     job_id="aborted", attempt=1, enqueued_at=None, payload=encode_payload(job_request(max_tokens=200)),
                     is_abort=lambda: aborted, lease_lost=lambda: False)
        before = asyncio.all_tasks()
        attempt = asyncio.create_task(run.run(StreamOpening(raised=True)))
        async with asyncio.timeout(60):
            while not await redis.xlen(stream_key("aborted")):
                await asyncio.sleep(0.01)
        server.kill()
        aborted = True
        attempt.cancel()                                  # the producer's cancel
        async with asyncio.timeout(30):                   # it added its final entry, and writes it (shielded)
            while not writer.unwritten("aborted")[0]:
                await asyncio.sleep(0.01)
        attempt.cancel()                                  # the shutdown's hand-back
        with pytest.raises(asyncio.CancelledError):
            await attempt
        async with asyncio.timeout(30):                   # nothing of the attempt is left running
            while asyncio.all_tasks() - before - {asyncio.current_task()}:
                await asyncio.sleep(0.05)
    finally:
        await writer.close()
        await redis.aclose()
        server.stop()
    assert re.search(r"job aborted: \d+ stream entries \(\d+ tokens\) not written within 0.5 s", caplog.text), \
        caplog.text
