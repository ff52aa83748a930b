"""A test run stopped with SIGTERM (a CI time limit, ``timeout``, a closed terminal) leaves no
server or worker behind: an orphaned ``valkey-server`` was found after such a run (issue 18).

The inner run starts the kinds of children the suite starts: an embedded Valkey from a thread (as a
test restarting a server off the event loop does; such a server has no parent-death signal), a
plain Valkey as the Sentinel set-up starts them, and a ``slotq worker``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support import REPO_ROOT

INNER_TEST = '''
import json
import os
import subprocess
import threading
import time

from slotq.jobs.redis_server import EmbeddedRedis, free_port, valkey_binary
from tests.support.jobs import SLOTQ_BIN, clean_env


def test_starts_children_then_waits(tmp_path, tiny_model_path):
    threaded = EmbeddedRedis(tmp_path / "threaded", fsync="no")
    starter = threading.Thread(target=threaded.start)
    starter.start()
    starter.join()
    plain = subprocess.Popen([str(valkey_binary()), "--port", str(free_port()), "--save", ""], cwd=tmp_path,
                             stdout=subprocess.DEVNULL)
    worker = subprocess.Popen([str(SLOTQ_BIN), "worker"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT,
                              env=clean_env(redis_url=threaded.url, model=tiny_model_path, slots=1, threads=1, ctx=256))
    pids = [threaded.pid, plain.pid, worker.pid]
    with open(os.environ["CHILD_PIDS_FILE"] + ".tmp", "w") as f:
        json.dump(pids, f)
    os.rename(os.environ["CHILD_PIDS_FILE"] + ".tmp", os.environ["CHILD_PIDS_FILE"])
    time.sleep(600)
'''


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat), None once it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def test_a_run_stopped_with_sigterm_leaves_no_child_running(tmp_path):
    (tmp_path / "test_inner.py").write_text(INNER_TEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pids_file = tmp_path / "pids.json"
    env = os.environ | {"PYTHONPATH": str(REPO_ROOT), "CHILD_PIDS_FILE": str(pids_file)}
    inner = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q",
                              "test_inner.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    children: dict[int, str | None] = {}
    try:
        deadline = time.monotonic() + 120
        while not pids_file.exists():
            assert inner.poll() is None, inner.communicate()[0]
            assert time.monotonic() < deadline, "the inner run did not start its children"
            time.sleep(0.1)
        children = {pid: _start_time(pid) for pid in json.loads(pids_file.read_text())}
        assert all(children.values()), children

        inner.send_signal(signal.SIGTERM)
        output = inner.communicate(timeout=60)[0]
        assert inner.returncode == -signal.SIGTERM, output       # still stopped by the signal, as before
        deadline = time.monotonic() + 10
        while (left := [pid for pid, started in children.items() if _start_time(pid) == started]) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"still running after the run was stopped: {left}\n{output}"
    finally:
        if inner.poll() is None:
            inner.kill()
            inner.wait()
        for pid, started in children.items():
            if started and _start_time(pid) == started:
                os.kill(pid, signal.SIGKILL)
