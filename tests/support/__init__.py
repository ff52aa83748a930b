"""Helpers shared by the test folders: real processes, the tiny model, proxies that inject latency and faults."""

from pathlib import Path

from slotq.jobs.redis_server import free_port

__all__ = ["REPO_ROOT", "free_port"]

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The checkout the suite runs from: deploy/, docs/, README.md and the Makefile are checked against the code."""

