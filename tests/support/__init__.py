"""Helpers shared by the test folders: real processes, the tiny model, proxies that inject latency and faults."""

import socket
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The checkout the suite runs from: deploy/, docs/, README.md and the Makefile are checked against the code."""


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it), for a server a test starts."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
