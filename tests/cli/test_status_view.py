"""``slotq status`` and ``slotq status --watch``: the fleet view, from a live worker's heartbeat, and
from heartbeats the worker's code builds from engine snapshots (speculative decoding's figures)."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from typing import Any

import redis as sync_redis
from rich.console import Console

from slotq.jobs.cli.status_view import render, watch
from slotq.jobs.producer.client import SlotqClient
from tests.support.engine import engine_stats
from tests.support.jobs import SLOTQ_BIN, advertise, clean_env


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
    for expected in ("view-1", "ready", "busy / active / max slots", "0 / 3 / 3", "drafts kept", "degradation", "none",
                     "interactive", "oldest wait", "fleet: 0/3 active slots busy (3 max) across 1 workers, 1 ready"):
        assert expected in text, expected


def commands_served(conn: sync_redis.Redis) -> int:
    """Commands the server has run for anyone but this probe (its own INFO calls left out)."""
    stats = conn.info("commandstats")
    return sum(int(s["calls"]) for name, s in stats.items() if name != "cmdstat_info")


def test_status_watch_command_runs_until_interrupted(redis_url: str) -> None:
    conn = sync_redis.Redis.from_url(redis_url)
    conn.config_resetstat()
    proc = subprocess.Popen([str(SLOTQ_BIN), "status", "--watch", "--interval", "0.2"],
                            env=clean_env(redis_url=redis_url), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    # Off a terminal the view is drawn once, at the end; that it keeps reading the queue shows it is watching:
    # wait until the server's command count has grown on three separate looks (two rounds at least).
    counts = {commands_served(conn)}
    while len(counts) < 4:
        assert proc.poll() is None, proc.communicate()[0]
        counts.add(commands_served(conn))
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=20)
    conn.close()
    assert proc.returncode == 130, out
    assert b"queue slotq:queue" in out and b"Traceback" not in out


async def test_status_shows_each_workers_draft_source_and_acceptance(client: SlotqClient) -> None:
    await advertise(client.redis, "drafting", engine_stats(spec="ngram", spec_draft_tokens=40, spec_accepted_tokens=30))
    await advertise(client.redis, "plain", engine_stats(spec="off"))
    info = await client.queue_info()
    console = Console(record=True, width=220)
    console.print(render(info))
    rows = [[cell.strip() for cell in re.split("[│┃]", line)[1:-1]] for line in console.export_text().splitlines()
            if line.startswith(("│", "┃"))]
    header = next(row for row in rows if row[0] == "worker")
    drafts = {row[0]: row[header.index("drafts kept")] for row in rows if row[0] in ("drafting", "plain")}
    assert drafts == {"drafting": "ngram 75% (30/40)", "plain": "off"}
    workers = {w["id"]: w for w in info.model_dump(mode="json")["workers"]}       # `slotq status --json`
    assert workers["drafting"] | {"spec": "ngram", "spec_draft_tokens": 40, "spec_accepted_tokens": 30,
                                  "spec_acceptance": 0.75} == workers["drafting"]
    assert workers["plain"]["spec"] == "off" and workers["plain"]["spec_acceptance"] is None
