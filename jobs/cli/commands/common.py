"""What several commands share: their settings, a client on the running Redis, JSON output, one-line
validation errors, and the Ctrl-C handling of the commands that wait."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from slotq.jobs.settings import ClientSettings, from_command_line
from slotq.jobs.worker.settings import WorkerSettings

if TYPE_CHECKING:
    from slotq.jobs.producer.client import SlotqClient


def client_settings(args: argparse.Namespace) -> ClientSettings:
    return from_command_line(ClientSettings, args, args.settings_source)


def worker_settings(args: argparse.Namespace) -> WorkerSettings:
    return from_command_line(WorkerSettings, args, args.settings_source)


@contextlib.asynccontextmanager
async def connected_client(settings: ClientSettings) -> AsyncIterator[SlotqClient]:
    """A client on the configured Redis, or on an embedded one that `slotq redis`/`slotq worker`
    started (waited for a while, as a worker started just before may still be starting it); commands
    that only talk to Redis never start a server of their own."""
    from slotq.jobs.producer.client import SlotqClient
    from slotq.jobs.redis_server import running_embedded_url

    url = settings.redis_url
    if url is None:
        url = running_embedded_url(settings.embedded_redis_port)
    client = await SlotqClient.connect(url, settings)
    try:
        yield client
    finally:
        await client.close()


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))


def describe(exc: ValidationError) -> str:
    """One line per problem, naming the field: ``slots: Input should be ... (got '0')``."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or exc.title
        shows_input = err.get("type") != "missing" and not isinstance(err.get("input"), dict)
        got = f" (got {err['input']!r})" if shows_input else ""
        lines.append(f"{where}: {err['msg']}{got}")
    return "\n".join(lines)


def stop_on_interrupt(stop: Callable[[], None]) -> None:
    """The first Ctrl-C (or SIGTERM) calls ``stop`` and the command ends cleanly; a second one is
    a plain KeyboardInterrupt."""
    loop = asyncio.get_running_loop()

    def first() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        stop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, first)
