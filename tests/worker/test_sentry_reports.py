"""A worker's error reports reach Sentry without the job's prompt or text, or a Redis password.

``slotq worker`` calls ``sentry_sdk.init`` when SENTRY_DSN is set. sentry-sdk sends each stack
frame's local variables by default, and a worker's frames hold prompts and replies; its 3.0 also
renamed the options that turn that off (``send_default_pii`` became ``data_collection``): the old
spelling failed ``slotq worker`` at start-up with "Unknown option". Each event also carries the
command line, where ``--redis-url`` may hold a password. Here the installed sentry-sdk reports a real
exception to a local HTTP server standing in for sentry.io (the DSN's host), in a process of its own
so that the SDK's global client touches no other test. And a real ``slotq worker`` runs under the
SDK's integrations (arq's among them) and reports its engine's death.
"""

from __future__ import annotations

import asyncio
import gzip
import os
import subprocess
import sys
import textwrap
import threading
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from slotq.jobs.cli.commands.worker import sentry_privacy_options
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.schemas import EntryKind, JobStatus
from slotq.jobs.redis_server import EmbeddedRedis
from slotq.jobs.worker.worker import EXIT_ENGINE_DIED
from tests.support.faults import Fleet, worker_env
from tests.support.jobs import job_request

SECRET = "prompt-text-that-must-stay-private"


class _Collector(BaseHTTPRequestHandler):
    """Keeps every envelope POSTed to it, decompressed, on the server object."""

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        encoding = self.headers.get("Content-Encoding", "")
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding == "deflate":
            body = zlib.decompress(body)
        elif encoding == "br":
            import brotli  # only sent when the brotli package is installed

            body = brotli.decompress(body)
        self.server.envelopes.append(body.decode("utf-8", "replace"))  # type: ignore[attr-defined]
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        return


@pytest.fixture
def sentry_ingest() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    server.envelopes = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


REPORTING_PROCESS = textwrap.dedent(
    """
    import sys

    import sentry_sdk
    from slotq.jobs.cli.commands.worker import _init_sentry

    _init_sentry()

    def decode_step(prompt):
        reply_so_far = prompt + " and then"
        raise RuntimeError("engine step failed")

    try:
        decode_step(sys.stdin.read())   # not in this source nor argv: the report carries both
    except RuntimeError as exc:
        sentry_sdk.capture_exception(exc)
    sentry_sdk.flush(timeout=10)
    """
)


def test_a_worker_error_reaches_sentry_without_the_prompt_in_its_frames(
    sentry_ingest: ThreadingHTTPServer,
) -> None:
    port = sentry_ingest.server_address[1]
    env = {**os.environ, "SENTRY_DSN": f"http://publickey@127.0.0.1:{port}/1"}
    command = [sys.executable, "-c", REPORTING_PROCESS,                # a worker's command line, with passwords
               "--redis-url", "redis://:hunter2@redis:6379/0", "--redis-url=rediss://u:hunter3@redis/0"]
    done = subprocess.run(command, env=env, input=SECRET, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    envelopes: list[str] = sentry_ingest.envelopes  # type: ignore[attr-defined]
    reports = [envelope for envelope in envelopes if "engine step failed" in envelope]
    assert reports, f"no error report among {len(envelopes)} envelopes"
    assert "decode_step" in reports[0], "the report lost its stack trace"
    assert all(SECRET not in envelope for envelope in envelopes), "a frame's local variables were sent"
    assert "redis://:***@redis:6379/0" in reports[0] and "--redis-url=rediss://u:***@redis/0" in reports[0]
    assert not any("hunter" in envelope for envelope in envelopes), "a Redis password was sent"


@pytest.mark.parametrize(
    ("version", "option"),
    [("2.76.0", "include_local_variables"), ("3.0.0", "data_collection"), ("3.1.2", "data_collection")],
)
def test_the_privacy_options_follow_the_sentry_sdk_major_version(version: str, option: str) -> None:
    """The installed major is exercised above; this keeps the other one's spelling (an unknown
    option is a TypeError in 2.x and a mypy error in 3.x)."""
    assert option in sentry_privacy_options(version)


@pytest.mark.fault
async def test_a_worker_whose_engine_process_died_reports_it_without_the_jobs_prompt(
        sentry_ingest: ThreadingHTTPServer, fclient: SlotqClient, fsync_redis: EmbeddedRedis, tiny_model_path: Path,
        tmp_path: Path) -> None:
    """A real ``slotq worker`` with SENTRY_DSN set (so sentry-sdk's own integrations for arq, asyncio and
    logging wrap it too) serves a job, then its engine process is killed: the job still ends well (on
    the worker that replaces it), and Sentry hears of the engine's death, without the job's prompt."""
    dsn = f"http://publickey@127.0.0.1:{sentry_ingest.server_address[1]}/1"
    fleet = Fleet(fclient, worker_env(fsync_redis.url, tiny_model_path, slots=2, ctx=4096) | {"SENTRY_DSN": dsn},
                  tmp_path)
    fleet.spawn("reported", engine_process="true")
    try:
        await fleet.wait_ready("reported")
        handle = await fclient.enqueue(job_request(SECRET, max_tokens=1500))
        async with asyncio.timeout(60):
            async for entry in handle.stream():
                if entry.kind == EntryKind.CHUNK:
                    break
        assert await fleet.kill_engine("reported") == EXIT_ENGINE_DIED, fleet.logs()
        fleet.spawn("replacement")
        result = await handle.result(timeout=120)
        assert result.status == JobStatus.SUCCEEDED, result
    finally:
        fleet.stop_all()
    envelopes: list[str] = sentry_ingest.envelopes  # type: ignore[attr-defined]
    assert any("EngineDead" in envelope for envelope in envelopes), envelopes[:3]
    assert all(SECRET not in envelope for envelope in envelopes)
