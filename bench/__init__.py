"""Benchmarks (``slotq bench engine|queue|prefix|gateway``). Each measures its variants side by side in
one run, prints a table with ratios (or one JSON object with ``--json``) and writes the table to
``bench/results/<name>.md`` for the README."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any


def run_benchmark(which: str, *, as_json: bool = False, quick: bool = False) -> dict[str, Any]:
    from bench import engine_bench, gateway_bench, prefix_bench, queue_bench

    runners: dict[str, Callable[[bool], Awaitable[tuple[dict[str, Any], str]]]] = {
        "engine": engine_bench.run,
        "queue": queue_bench.run,
        "prefix": prefix_bench.run,
        "gateway": gateway_bench.run,
    }
    data, table = asyncio.run(runners[which](quick))
    if as_json:
        print(json.dumps(data))
    else:
        print(table)
    return data
