"""Benchmarks (``slotq bench api-shapes|clients|engine|queue|prefix|gateway|gateway-batch|fleet|bulk|peers|overhead|
constraints|logprobs|embeddings|rerank|spec|step-costs|on-demand|lora``). Each measures its variants side by side in
one run, prints a table with ratios (or one JSON object with ``--json``; ``--json PATH`` writes it there) and writes
the table to ``bench/results/<name>.md`` for the README.

A benchmark that depends on a child (the queue and bulk benchmarks'
``slotq worker``, the fleet benchmark's fleet processes) runs under
:func:`slotq.jobs.cli.watch.run_watched`: if the child dies, the benchmark stops at once with its exit code
and log tail. The engine and prefix benchmarks run everything in this process, so a model that
does not load raises at once and a crash inside llama.cpp ends the process itself."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from slotq.jobs.cli.watch import ChildExited


def run_benchmark(which: str, *, as_json: bool = False, quick: bool = False, json_path: Path | None = None,
                  options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run benchmark ``which``; ``options`` are its own keyword arguments (``slotq bench spec``'s
    ``concurrency``, ``rounds``, ``draft_model``; ``slotq bench fleet``'s ``cluster``)."""
    from bench import (
        api_shapes,
        bulk_bench,
        clients_bench,
        constraints_bench,
        embeddings_bench,
        engine_bench,
        fleet_bench,
        gateway_batch_bench,
        gateway_bench,
        logprobs_bench,
        lora_bench,
        on_demand_bench,
        overhead_bench,
        peers_bench,
        prefix_bench,
        queue_bench,
        rerank_bench,
        spec_bench,
        step_costs_bench,
    )

    runners: dict[str, Callable[[bool], Awaitable[tuple[dict[str, Any], str]]]] = {
        "api-shapes": api_shapes.run,
        "clients": clients_bench.run,
        "engine": engine_bench.run,
        "queue": queue_bench.run,
        "prefix": prefix_bench.run,
        "gateway": gateway_bench.run,
        "gateway-batch": gateway_batch_bench.run,
        "fleet": fleet_bench.run,
        "bulk": bulk_bench.run,
        "peers": peers_bench.run,
        "overhead": overhead_bench.run,
        "constraints": constraints_bench.run,
        "logprobs": logprobs_bench.run,
        "embeddings": embeddings_bench.run,
        "rerank": rerank_bench.run,
        "spec": spec_bench.run,
        "step-costs": step_costs_bench.run,
        "on-demand": on_demand_bench.run,
        "lora": lora_bench.run,
    }
    try:
        data, table = asyncio.run(functools.partial(runners[which], **(options or {}))(quick))
    except ChildExited as exc:          # a child the benchmark needs has died: say how, do not hang
        raise SystemExit(f"slotq bench {which} stopped: {exc}") from exc
    if json_path is not None:
        json_path.write_text(json.dumps(data, indent=2) + "\n")
    if as_json:
        print(json.dumps(data))
    else:
        print(table)
    return data
