"""``slotq status``: the queue and its workers, and every model the fleet can load with the jobs waiting
for it (``models`` in the JSON), once (a table or ``--json``) or live (``--watch``); on a Redis Cluster
also each shard's load (``shards`` in the JSON). The keys of the queue's demand, one per partition, are
what KEDA's triggers read (``demand_keys``; the lanes table's caption)."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from slotq.jobs.cli.commands.common import client_settings, connected_client, print_json, stop_on_interrupt
from slotq.jobs.cli.exit_codes import EXIT_INTERRUPTED

if TYPE_CHECKING:
    from slotq.jobs.cli.status_view import Status
    from slotq.jobs.producer.client import SlotqClient


def _reader(client: SlotqClient) -> Callable[[], Awaitable[Status]]:
    """One look at the queue, and on a cluster at its shards; one reader for all looks of a ``--watch``,
    so each shard's CPU is measured since the look before."""
    from slotq.jobs.cli.status_view import Status
    from slotq.jobs.protocol.partitioned_queue import partition_job_keys
    from slotq.jobs.protocol.shard_load import shard_reader

    demand_keys = partition_job_keys(client.queue)
    shards = shard_reader(client.redis, client.queue)

    async def read() -> Status:
        if shards is None:
            info, models = await asyncio.gather(client.queue_info(), client.models())
            return Status(info, models=models, demand_keys=demand_keys)
        info, models, loads = await asyncio.gather(client.queue_info(), client.models(), shards.read())
        return Status(info, loads, models, demand_keys)
    return read


async def cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console

    from slotq.jobs.cli.status_view import render, watch

    async with connected_client(client_settings(args)) as client:
        read = _reader(client)
        if args.watch:
            stop = asyncio.Event()
            stop_on_interrupt(stop.set)
            await watch(read, interval_s=args.interval, stop=stop)
            return EXIT_INTERRUPTED
        status = await read()
    if args.json:
        shards = {"shards": [s.model_dump(mode="json") for s in status.shards]} if status.shards else {}
        models = {"models": [m.model_dump(mode="json") for m in status.models]}
        print_json(status.queue.model_dump(mode="json") | models | shards | {"demand_keys": list(status.demand_keys)})
        return 0
    Console().print(render(status.queue, shards=status.shards, models=status.models, demand_keys=status.demand_keys))
    return 0
