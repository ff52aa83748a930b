"""``slotq worker``: the one command that loads the model (and starts the embedded Redis when no
SLOTQ_REDIS_URL is set and none is running yet)."""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

from slotq.jobs.cli.commands.common import worker_settings
from slotq.jobs.protocol.connection import redacted


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
    """Report worker errors to Sentry when SENTRY_DSN is set (sentry-sdk reads it itself)."""
    if os.environ.get("SENTRY_DSN"):
        import sentry_sdk

        sentry_sdk.init(**sentry_privacy_options(sentry_sdk.VERSION))


def sentry_privacy_options(sentry_version: str) -> dict[str, Any]:
    """``sentry_sdk.init`` options that keep prompts, outputs and Redis passwords out of error reports.

    Job payloads never appear in log messages, but a stack frame's local variables would carry them
    (the prompt, the text so far), and sentry-sdk sends those by default. Its 3.x replaced
    ``send_default_pii`` and ``include_local_variables`` with one ``data_collection`` dict, so the
    options depend on the installed major version (both are supported: ``sentry-sdk>=2.0``). Every
    event also carries the command line, where ``--redis-url`` may hold a password: it is redacted."""
    common = {"before_send": _redact_command_line}
    if int(sentry_version.split(".", 1)[0]) >= 3:
        return common | {"data_collection": {"user_info": False, "stack_frame_variables": False}}
    return common | {"send_default_pii": False, "include_local_variables": False}


def _redact_command_line(event: dict[str, Any], hint: dict[str, Any]) -> dict[str, Any]:
    """The event with any password in its ``sys.argv`` (sentry-sdk's argv integration) replaced by ``***``:
    a URL given alone (``--redis-url URL``) or joined to its flag (``--redis-url=URL``)."""
    extra = event.get("extra")
    if isinstance(extra, dict) and isinstance(extra.get("sys.argv"), list):
        extra["sys.argv"] = [_redacted_arg(arg) if isinstance(arg, str) else arg for arg in extra["sys.argv"]]
    return event


def _redacted_arg(arg: str) -> str:
    flag, joined, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    return flag + joined + redacted(value)
