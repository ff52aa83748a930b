"""``slotq bulk``: a JSONL file of requests through the queue, resumably (:mod:`slotq.jobs.bulk`)."""

from __future__ import annotations

import argparse

from slotq.jobs.cli.commands.common import client_settings, connected_client, print_json, stop_on_interrupt
from slotq.jobs.cli.exit_codes import EXIT_FAILED, EXIT_INTERRUPTED


async def cmd_bulk(args: argparse.Namespace) -> int:
    """Exit code 0: every line has its output; 1: some lines are in the errors file; 130: interrupted."""
    from slotq.jobs.bulk import BulkOptions, open_bulk
    from slotq.jobs.bulk.progress import RichProgress, summary_table

    options = BulkOptions(window=args.window, lane=args.lane)
    async with connected_client(client_settings(args)) as client, open_bulk(
            client, args.input, args.output, errors=args.errors, options=options,
            observer=None if args.quiet or args.json else RichProgress()) as run:
        stop_on_interrupt(run.stop)
        summary = await run.run()
    if args.json:
        print_json(summary.model_dump(mode="json"))
    elif not args.quiet:
        from rich.console import Console

        Console().print(summary_table(summary))
    return EXIT_INTERRUPTED if summary.interrupted else 0 if summary.all_succeeded else EXIT_FAILED
