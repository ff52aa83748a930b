"""``slotq status`` and ``slotq status --watch``: the fleet view, from a live worker's heartbeat."""

from __future__ import annotations

import signal
import subprocess
import time
from typing import Any

from rich.console import Console

from slotq.jobs.cli.status_view import watch
from slotq.jobs.producer.client import SlotqClient
from tests.support.jobs import SLOTQ_BIN, clean_env


async def test_watch_redraws_the_fleet_in_place(start_worker: Any, client: SlotqClient) -> None:
    await start_worker(slots=3, worker_name="view-1")
    console = Console(record=True, width=220, force_terminal=True)
    reads = 0

    async def read() -> Any:
        nonlocal reads
        reads += 1
        return await client.queue_info()

    await watch(read, interval_s=0.05, console=console, rounds=3)
    assert reads == 3
    text = console.export_text()
    for expected in ("view-1", "ready", "busy / active / max slots", "0 / 3 / 3", "degradation", "none",
                     "interactive", "oldest wait", "fleet: 0/3 active slots busy (3 max) across 1 workers, 1 ready"):
        assert expected in text, expected


def test_status_watch_command_runs_until_interrupted(redis_url: str) -> None:
    proc = subprocess.Popen([str(SLOTQ_BIN), "status", "--watch", "--interval", "0.2"],
                            env=clean_env(redis_url=redis_url), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    time.sleep(3)
    assert proc.poll() is None            # still watching
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 130, out
    assert b"queue slotq:queue" in out and b"Traceback" not in out
