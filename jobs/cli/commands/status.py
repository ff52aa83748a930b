"""``slotq status``: the queue and its workers, once (a table or ``--json``) or live (``--watch``)."""

from __future__ import annotations

import argparse
import asyncio

from slotq.jobs.cli.commands.common import client_settings, connected_client, print_json, stop_on_interrupt
from slotq.jobs.cli.exit_codes import EXIT_INTERRUPTED


async def cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console

    from slotq.jobs.cli.status_view import render, watch

    async with connected_client(client_settings(args)) as client:
        if args.watch:
            stop = asyncio.Event()
            stop_on_interrupt(stop.set)
            await watch(client.queue_info, interval_s=args.interval, stop=stop)
            return EXIT_INTERRUPTED
        info = await client.queue_info()
    if args.json:
        print_json(info.model_dump(mode="json"))
        return 0
    Console().print(render(info))
    return 0
