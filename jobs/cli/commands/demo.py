"""``slotq demo``: the zero-config demo (:mod:`slotq.jobs.cli.demo`) with the worker settings its flags give."""

from __future__ import annotations

import argparse
import asyncio

from slotq.jobs.cli.commands.common import worker_settings


def cmd_demo(args: argparse.Namespace) -> None:
    from slotq.jobs.cli.demo import run_demo

    asyncio.run(run_demo(worker_settings(args), n_jobs=args.jobs, max_tokens=args.max_tokens, tools=args.tools))
