"""Commands that depend on a child stop as soon as it dies, with its exit code and log tail,
instead of waiting forever: jobs/cli/watch.py, `slotq bench queue` and `slotq demo`."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slotq.jobs.cli.watch import ChildExited, ChildProcess, WatchedTask, run_watched
from slotq.jobs.redis_server import port_is_serving
from tests.support.jobs import SLOTQ_BIN, clean_env
from tests.support.processes import alive, wait_for


async def forever() -> None:
    await asyncio.Event().wait()


def python_child(tmp_path: Path, code: str) -> ChildProcess:
    return ChildProcess("test child", [sys.executable, "-c", code], log_path=tmp_path / "child.log")


async def test_a_child_that_exits_stops_the_body_with_its_code_and_log_tail(tmp_path: Path) -> None:
    child = python_child(tmp_path, "import sys\nfor i in range(100): print('line', i)\nsys.exit(3)")
    cancelled = asyncio.Event()

    async def body() -> None:
        try:
            await forever()
        finally:
            cancelled.set()

    started = time.monotonic()
    with pytest.raises(ChildExited) as info:
        await asyncio.wait_for(run_watched(body(), child), 30)
    assert time.monotonic() - started < 10 and cancelled.is_set()
    report = str(info.value)
    assert "test child" in report and "exited (exit code 3)" in report and str(tmp_path / "child.log") in report
    assert report.rstrip().endswith("line 99") and "line 79" not in report     # the last 20 lines
    child.stop()


async def test_a_crashed_child_is_reported_with_its_signal(tmp_path: Path) -> None:
    child = python_child(tmp_path, "import ctypes; print('about to crash', flush=True); ctypes.string_at(0)")
    with pytest.raises(ChildExited, match=r"killed by signal SIGSEGV \(exit code -11\)[\s\S]*about to crash"):
        await asyncio.wait_for(run_watched(forever(), child), 30)
    child.stop()


async def test_the_body_result_is_returned_while_children_live(tmp_path: Path) -> None:
    child = python_child(tmp_path, "import time; time.sleep(60)")
    task = asyncio.create_task(forever())
    try:
        assert await run_watched(asyncio.sleep(0.2, result="done"), child, WatchedTask("task", task)) == "done"
        assert child.proc.poll() is None and not task.done()      # left running for the caller to stop
    finally:
        task.cancel()
        assert child.stop() == -15


async def test_the_body_error_is_raised_as_it_is(tmp_path: Path) -> None:
    child = python_child(tmp_path, "import time; time.sleep(60)")
    try:
        with pytest.raises(KeyError, match="boom"):
            await run_watched(_raise(), child)
    finally:
        child.stop()


async def _raise() -> None:
    raise KeyError("boom")


async def test_a_failed_task_is_reported_with_its_exception() -> None:
    async def worker() -> None:
        await asyncio.sleep(0.05)
        raise RuntimeError("llama.cpp could not load /nowhere.gguf")

    with pytest.raises(ChildExited, match=r"worker failed: RuntimeError: llama.cpp could not load /nowhere.gguf"
                                          r"[\s\S]*traceback[\s\S]*in worker"):
        await asyncio.wait_for(run_watched(forever(), WatchedTask("worker", asyncio.create_task(worker()))), 30)


async def test_a_task_that_returns_early_is_reported() -> None:
    with pytest.raises(ChildExited, match="worker stopped without an error"):
        await run_watched(forever(), WatchedTask("worker", asyncio.create_task(asyncio.sleep(0))))


# ----------------------------------------------------------------------------- the commands
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_a_child_ends_when_the_process_that_started_it_is_killed(tmp_path: Path) -> None:
    """A benchmark stopped by a signal runs no cleanup; its workers and fleet processes must still
    end (they get SIGTERM from the kernel), not run on against a Redis that went with it."""
    script = (f"import sys, time\nfrom pathlib import Path\nfrom slotq.jobs.cli.watch import ChildProcess\n"
              f"child = ChildProcess('sleeper', [sys.executable, '-c', 'import time; time.sleep(600)'], "
              f"log_path=Path({str(tmp_path / 'child.log')!r}))\nprint(child.proc.pid, flush=True)\ntime.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        parent.kill()
        parent.wait(10)
        wait_for(lambda: not alive(child_pid), 10, f"the child {child_pid} did not end after its parent's SIGKILL")
    finally:
        parent.kill()
        parent.wait()


def run_cli(args: list[str], tmp_path: Path, timeout: float,
            **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    proc = subprocess.run([str(SLOTQ_BIN), *args], env=clean_env(data_dir=str(tmp_path / "data"), **env), cwd=tmp_path,
                          capture_output=True, text=True, timeout=timeout, check=False)
    return proc, time.monotonic() - started


@pytest.mark.real_model      # the benchmark loads the bundled model in-process next to its worker
def test_bench_queue_stops_when_its_worker_dies_at_start_up(tmp_path: Path) -> None:
    # A setting only the worker uses: llama.cpp refuses a quantized V cache without flash attention,
    # so the worker subprocess exits while loading; the benchmark's own engine uses the defaults.
    proc, took = run_cli(["bench", "queue", "--quick"], tmp_path, 120, kv_type="q4_0", flash_attention="off")
    assert proc.returncode == 1, proc.stderr
    assert "slotq bench queue stopped: the benchmark's worker (slotq worker)" in proc.stderr
    assert "exited (exit code 1); last lines of" in proc.stderr
    assert "llama.cpp could not create a context" in proc.stderr          # the worker's own log
    assert took < 60, f"took {took:.0f} s"


def test_demo_stops_when_its_worker_cannot_load_the_model(tmp_path: Path) -> None:
    not_a_model = tmp_path / "model.gguf"
    not_a_model.write_bytes(b"this is not a GGUF file\n" * 100)
    proc, took = run_cli(["demo"], tmp_path, 120, model=str(not_a_model))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # the worker reads the file's metadata first (is it an embedding model?), and says it is no GGUF
    assert f"slotq demo stopped: the demo's worker failed: ValueError: {not_a_model}: not a readable GGUF file" \
        in proc.stderr
    assert took < 60, f"took {took:.0f} s"
    port = re.search(r"embedded Redis \(Valkey\) on redis://127.0.0.1:(\d+)/0", proc.stdout + proc.stderr)
    assert port and not port_is_serving(int(port.group(1)))               # its Redis went with it
