"""The embedded Valkey: it dies with the process that started it, and no two servers share a
data directory. Real servers, real processes, nothing mocked."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as sync_redis

from slotq.jobs.errors import RedisUnavailable
from slotq.jobs.redis_server import (
    EPHEMERAL_PORTS,
    SPARE_PORTS_FROM,
    DataDirInUse,
    EmbeddedRedis,
    free_port,
    port_data_dir,
    port_is_serving,
    running_embedded_url,
)
from tests.support.jobs import SLOTQ_BIN, clean_env
from tests.support.processes import alive, wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux")


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


# ----------------------------------------------------------------------------- no orphans
def test_server_dies_when_the_process_that_started_it_is_killed(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import time
        from slotq.jobs.redis_server import EmbeddedRedis
        server = EmbeddedRedis({str(tmp_path / "redis")!r})
        server.start()
        print(server.pid, server.port, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        valkey_pid, port = map(int, parent.stdout.readline().split())
        assert alive(valkey_pid) and port_is_serving(port)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        wait_for(lambda: not alive(valkey_pid), 5,
                 f"valkey-server {valkey_pid} did not exit after its parent's SIGKILL")
    finally:
        parent.kill()
        parent.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(valkey_pid, signal.SIGKILL)
    assert not port_is_serving(port)
    # It exited cleanly (SIGTERM: append-only file flushed) and the directory is free again.
    assert "ready to exit, bye bye" in (tmp_path / "redis" / "valkey.log").read_text()
    again = EmbeddedRedis(tmp_path / "redis")
    again.start()
    again.stop()


def test_ctrl_c_in_the_terminal_does_not_reach_the_server(tmp_path: Path) -> None:
    """The server has its own session: a terminal's SIGINT goes to slotq only, which stops the
    server when its workers are done with it (not while they still hand jobs back)."""
    server = EmbeddedRedis(tmp_path / "redis")
    server.start()
    try:
        assert os.getsid(server.pid) == server.pid != os.getsid(0)
    finally:
        server.stop()
    assert server.pid is None


# ----------------------------------------------------------------------------- one server per directory
def test_each_port_has_its_own_directory(tmp_path: Path) -> None:
    assert port_data_dir(tmp_path, 6399) == tmp_path / "redis-6399"
    assert port_data_dir(tmp_path, 6400) != port_data_dir(tmp_path, 6399)


def test_a_second_server_on_a_directory_in_use_is_refused(tmp_path: Path) -> None:
    first = EmbeddedRedis(tmp_path / "redis")
    first.start()
    try:
        second = EmbeddedRedis(tmp_path / "redis")
        with pytest.raises(DataDirInUse) as info:
            second.start()
        message = str(info.value)
        assert str(tmp_path / "redis") in message
        assert f"slotq process {os.getpid()}" in message and f"port {first.port}" in message
        assert second.pid is None                          # nothing was started
        assert sync_redis.Redis.from_url(first.url).ping()  # the first one is untouched
    finally:
        first.stop()
    second.start()                                         # free again once the first has stopped
    second.stop()


def test_legacy_shared_directory_is_pointed_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "redis").mkdir()
    with caplog.at_level(logging.WARNING, logger="slotq.jobs.redis_server"):
        port_data_dir(tmp_path, 6399)
    assert f"mv {tmp_path / 'redis'} {tmp_path / 'redis-6399'}" in caplog.text


@pytest.fixture
def slotq_redis(tmp_path: Path) -> Iterator:
    """Start ``slotq redis --port P`` processes with SLOTQ_DATA_DIR=tmp_path; stopped at teardown."""
    procs: list[subprocess.Popen[str]] = []

    def start(port: int) -> subprocess.Popen[str]:
        proc = subprocess.Popen([str(SLOTQ_BIN), "redis", "--port", str(port)], env=clean_env(data_dir=str(tmp_path)),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(15)


def test_slotq_redis_on_two_ports_keeps_two_directories(tmp_path: Path, slotq_redis) -> None:
    ports = [free_port(), free_port()]
    procs = [slotq_redis(p) for p in ports]
    for proc, port in zip(procs, ports):
        data_dir = tmp_path / f"redis-{port}"
        assert f"listening on redis://127.0.0.1:{port}/0; data in {data_dir}" in proc.stdout.readline()
        sync_redis.Redis(port=port).set("owner", str(port))
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    for port in ports:          # each append-only file holds its own server's write only
        aof = b"".join(f.read_bytes() for f in (tmp_path / f"redis-{port}" / "appendonlydir").iterdir())
        assert str(port).encode() in aof and str(ports[1 - ports.index(port)]).encode() not in aof


def test_slotq_redis_refuses_a_directory_in_use(tmp_path: Path, slotq_redis) -> None:
    port = free_port()
    first = slotq_redis(port)
    assert "listening on" in first.stdout.readline()
    second = slotq_redis(port)
    assert second.wait(15) == 1
    err = second.stderr.read()
    assert f"{tmp_path / f'redis-{port}'} is in use by the embedded Redis of slotq process {first.pid}" in err, err
    assert first.poll() is None and port_is_serving(port)


def test_slotq_redis_exits_when_its_server_dies(slotq_redis) -> None:
    port = free_port()
    proc = slotq_redis(port)
    assert "listening on" in proc.stdout.readline()
    [valkey] = children_of(proc.pid)
    os.kill(valkey, signal.SIGKILL)
    assert proc.wait(15) == 1
    assert "Valkey stopped (killed by signal SIGKILL (exit code -9))" in proc.stderr.read()


# ----------------------------------------------------------------------------- producers wait for it
def test_a_producer_waits_for_the_server_a_worker_is_starting(tmp_path: Path, slotq_redis) -> None:
    """``slotq worker &`` followed at once by a producer command (``slotq gateway``, ``status``, ...):
    the producer waits for the embedded server the worker is about to start, rather than failing."""
    port = free_port()
    status = subprocess.Popen([str(SLOTQ_BIN), "status", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=clean_env(data_dir=str(tmp_path), embedded_redis_port=str(port)), text=True)
    try:
        said = ""
        while "waiting up to 30 s for the embedded Redis" not in said and status.poll() is None:
            said = status.stderr.readline()
        assert f"redis://127.0.0.1:{port}/0 (`slotq worker` or `slotq redis` starts it)" in said, said
        assert "listening on" in slotq_redis(port).stdout.readline()
        out, err = status.communicate(timeout=60)
    finally:
        status.kill()
        status.wait()
    assert status.returncode == 0, err
    assert "lanes" in json.loads(out)


def test_with_no_server_a_producer_says_how_to_start_one() -> None:
    port = free_port()
    with pytest.raises(RedisUnavailable) as raised:
        running_embedded_url(port, wait_s=0)
    assert str(raised.value) == (f"no Redis at redis://127.0.0.1:{port}/0; start one with `slotq worker` or "
                                 f"`slotq redis` (embedded, SLOTQ_EMBEDDED_REDIS_PORT), or set SLOTQ_REDIS_URL")


@pytest.mark.skipif(not EPHEMERAL_PORTS.exists(), reason="no /proc/sys/net/ipv4/ip_local_port_range (not Linux)")
def test_a_free_port_is_picked_below_the_ports_outbound_connections_take() -> None:
    """A port picked by the OS can be taken by any client's connection before the server that was to
    bind it starts (a gateway in the suite met "Address already in use"); these are not the OS's picks."""
    ephemeral_from = int(EPHEMERAL_PORTS.read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert all(SPARE_PORTS_FROM <= port < ephemeral_from for port in ports), ports
    assert len(set(ports)) > 40                 # at random, not the same few
