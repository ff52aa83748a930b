"""``slotq worker``: the one command that loads the model (and starts the embedded Redis when no
SLOTQ_REDIS_URL is set and none is running yet)."""

from __future__ import annotations

import argparse
import asyncio
import os

from slotq.jobs.cli.commands.common import worker_settings


def cmd_worker(args: argparse.Namespace) -> int:
    """Exit code 0 after a drain; 70 when the engine died (its supervisor should restart it)."""
    from slotq.jobs.redis_server import redis_url_or_embedded
    from slotq.jobs.worker.worker import SlotqWorker

    settings = worker_settings(args)
    _init_sentry()

    async def run(url: str) -> int:
        return await SlotqWorker(settings, url).run()     # arq binds to the running loop: build it inside

    with redis_url_or_embedded(settings.redis_url, settings.data_dir, settings.embedded_redis_port) as url:
        return asyncio.run(run(url))


def _init_sentry() -> None:
    """Report worker errors to Sentry when SENTRY_DSN is set (sentry-sdk reads it itself).
    Prompts and outputs are not sent: job payloads never appear in log messages."""
    if os.environ.get("SENTRY_DSN"):
        import sentry_sdk

        sentry_sdk.init(send_default_pii=False)
