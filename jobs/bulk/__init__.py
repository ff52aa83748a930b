"""Offline bulk processing: JSONL in, JSONL out, resumable, in a lower-priority lane.

    async with await SlotqClient.connect(url) as client:
        summary = await run_bulk(client, "prompts.jsonl", "out.jsonl")
        print(summary.succeeded, summary.failed, summary.all_succeeded)

    summary = bulk("prompts.jsonl.gz", "out.jsonl", redis_url="redis://...")   # blocking, for scripts

Running the same call again after an interruption finishes the remaining lines: the output file
says which lines are done, and jobs still in Redis are collected rather than generated again.
The modules: :mod:`~slotq.jobs.bulk.source` (input and its identity), :mod:`~slotq.jobs.bulk.formats` (slotq and
OpenAI Batch lines, output records), :mod:`~slotq.jobs.bulk.output` (output and errors files),
:mod:`~slotq.jobs.bulk.runner` (the bounded window), :mod:`~slotq.jobs.bulk.progress` (the CLI's bar and table).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from slotq.jobs.bulk.output import OutputError, OutputFiles
from slotq.jobs.bulk.runner import BulkObserver, BulkOptions, BulkRun, BulkSummary
from slotq.jobs.bulk.source import STDIN, InputError, InputFile
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.settings import ClientSettings

__all__ = ["BulkObserver", "BulkOptions", "BulkRun", "BulkSummary", "InputError", "OutputError", "bulk", "open_bulk",
           "run_bulk"]


@contextlib.asynccontextmanager
async def open_bulk(client: SlotqClient, input: str | Path, output: str | Path, *, errors: str | Path | None = None,
                    options: BulkOptions | None = None, observer: BulkObserver | None = None) -> AsyncIterator[BulkRun]:
    """A run of ``input`` (a path, gzip or not, or ``"-"`` for stdin) into ``output``; await its
    ``run()``. Call ``stop()`` (e.g. on Ctrl-C) to leave early, ``cancel()`` to cancel what is in flight."""
    sink, source = await asyncio.to_thread(_files, input, output, errors, client.settings.queue_name)
    try:
        yield BulkRun(client, source, sink, options=options or BulkOptions(), observer=observer,
                      names=("<stdin>" if str(input) == STDIN else str(input), str(sink.output), str(sink.errors)))
    finally:
        source.close()


def _files(input: str | Path, output: str | Path, errors: str | Path | None,
           queue_name: str) -> tuple[OutputFiles, InputFile]:
    """The run's files, checked (and stdin spooled) in a thread: a bulk run inside the gateway never
    makes its event loop wait on a disk."""
    sink = OutputFiles(Path(output), Path(errors) if errors is not None else None)
    return sink, InputFile(input, queue_name, spool_dir=sink.output.resolve().parent)


async def run_bulk(client: SlotqClient, input: str | Path, output: str | Path, *, errors: str | Path | None = None,
                   options: BulkOptions | None = None, observer: BulkObserver | None = None) -> BulkSummary:
    async with open_bulk(client, input, output, errors=errors, options=options, observer=observer) as run:
        return await run.run()


def bulk(input: str | Path, output: str | Path, *, redis_url: str, settings: ClientSettings | None = None,
         errors: str | Path | None = None, **options: Any) -> BulkSummary:
    """Blocking :func:`run_bulk` for scripts; ``options`` are :class:`BulkOptions` fields."""
    async def main() -> BulkSummary:
        async with await SlotqClient.connect(redis_url, settings) as client:
            return await run_bulk(client, input, output, errors=errors, options=BulkOptions(**options))
    return asyncio.run(main())
