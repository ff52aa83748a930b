"""A worker change measured side by side: ``python -m bench.worker_ab --before REV``.

The job layer's cost per token is what a worker change moves, and on a shared machine two runs
minutes apart differ more than the change does. So this runs, in ONE run and in rotated rounds, the
same engine in-process, a ``slotq worker`` of git revision ``REV`` (``git archive`` of it, laid out
as the package-dir mapping of ``pyproject.toml`` lays out an install) and a ``slotq worker`` of this
checkout, each through its own queue of one Redis, on two workloads (``--after-env NAME=VALUE`` sets
a setting of this checkout's worker only: ``--before HEAD --after-env SLOTQ_ENGINE_PROCESS=true``
measures that setting on / off):

- ``overhead``: ``slotq bench overhead``'s, the suite's tiny model with S slots (``--streams``, 64)
  and S greedy streams of ``--tokens`` (128) started together: decode costs little, the job layer shows;
- ``queue``: ``slotq bench queue``'s at 8 clients (closed loop, the bundled model, 8 slots, 64-token
  jobs): tokens/s and time to first token through Redis beside the engine in-process.

Each worker's figure is also given over the in-process engine's. Wall time on a shared machine is
noisy, so each system's CPU time per 1,000 generated tokens is measured too (``/proc``): of its
main thread, where the event loop runs (the job layer, Redis, the engine's deliveries), and of its
whole process (the engine thread and llama.cpp's threads besides; a worker's engine process too). Writes
``bench/results/worker_ab.md`` and ``.json`` (``--results NAME``: ``NAME.md``) unless ``--quick``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench import overhead_bench, queue_bench
from bench.isolated import IsolatedProcess
from bench.report import markdown_table, percentile, progress, write_results
from slotq.engine import EngineConfig, KVLayout, bundled_model_path
from slotq.jobs.cli.watch import ChildProcess, run_watched
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.redis_server import EmbeddedRedis
from slotq.jobs.settings import ClientSettings

REPO = Path(__file__).resolve().parent.parent
ROUNDS = 3
JOB_TOKENS = 64      # the queue workload's jobs, as slotq bench queue's
PACKAGES = {"slotq": "jobs/public", "slotq/engine": "engine", "slotq/jobs": "jobs"}   # pyproject's package-dir


def cpu_seconds(pid: int, *, with_children: bool = False) -> tuple[float, float]:
    """CPU seconds (user + system) of a process's main thread, and of the whole process (with its
    running child processes if asked: a worker's engine process, ``SLOTQ_ENGINE_PROCESS``)."""
    def ticks(stat: str) -> float:
        fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    children = [child for task in Path(f"/proc/{pid}/task").iterdir()
                for child in (task / "children").read_text().split()] if with_children else []
    return ticks(f"/proc/{pid}/task/{pid}/stat"), ticks(f"/proc/{pid}/stat") + sum(
        ticks(f"/proc/{child}/stat") for child in children)


def _engine_streams_cpu(streams: int, tokens: int, first: int) -> tuple[float, float, float]:
    """``overhead_bench._engine_streams`` in the isolated process, with its CPU seconds there (main
    thread, whole process)."""
    main, process = time.thread_time(), time.process_time()
    rate = overhead_bench._engine_streams(streams, tokens, first)
    return rate, time.thread_time() - main, time.process_time() - process


def per_1k_tokens(cpu: tuple[float, float], tokens: int) -> dict[str, float]:
    return {"loop_cpu_ms_per_1k": 1e6 * cpu[0] / tokens, "cpu_ms_per_1k": 1e6 * cpu[1] / tokens}


def checkout(rev: str, into: Path) -> Path:
    """The code of ``rev`` as an importable tree: a folder for PYTHONPATH whose ``slotq`` is that
    revision's (ahead of this checkout's editable install)."""
    source = into / "src"
    source.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    tree = into / "pkg"
    for package, folder in PACKAGES.items():
        shutil.copytree(source / folder, tree / package, dirs_exist_ok=True)
    return tree


Measure = Callable[[str, int], Awaitable[dict[str, float]]]     # system, round -> figures


async def rotated_rounds(systems: list[str], measure: Measure, rounds: int) -> dict[str, list[dict[str, float]]]:
    """Every system once per round, each round starting at another system (drift hits all alike)."""
    figures: dict[str, list[dict[str, float]]] = {system: [] for system in systems}
    for r in range(rounds):
        for system in systems[r % len(systems):] + systems[:r % len(systems)]:
            progress(f"round {r + 1}/{rounds}: {system}")
            figures[system].append(await measure(system, r))
    return figures


AFTER_ENV: dict[str, str] = {}
"""``--after-env``: settings of the "after" worker only (``SLOTQ_ENGINE_PROCESS=true`` with ``--before
HEAD`` measures that setting on / off)."""


def workers(before: Path, url: str, model: Path, tmp: Path, queue: str, **env: str) -> dict[str, ChildProcess]:
    """A worker of each revision, on queues of their own."""
    base = {**os.environ, "SLOTQ_REDIS_URL": url, "SLOTQ_MODEL": str(model), "SLOTQ_LOG_LEVEL": "WARNING",
            "SLOTQ_ELASTIC": "false", **env}
    here = os.environ.get("PYTHONPATH", "")
    paths = {"before": f"{before}{os.pathsep}{here}" if here else str(before), "after": here}
    extra = {"before": {}, "after": AFTER_ENV}
    return {system: ChildProcess(f"the {system} worker", [sys.executable, "-m", "slotq.jobs.cli", "worker"],
                                 env={**base, **extra[system], "PYTHONPATH": paths[system],
                                      "SLOTQ_QUEUE_NAME": f"{queue}-{system}"},
                                 log_path=tmp / f"worker-{queue}-{system}.log")
            for system in ("before", "after")}


async def clients(url: str, queue: str) -> dict[str, SlotqClient]:
    out = {system: await SlotqClient.connect(url, ClientSettings(redis_url=url, queue_name=f"{queue}-{system}"))
           for system in ("before", "after")}
    for client in out.values():
        while not (await client.queue_info()).workers:
            await asyncio.sleep(0.2)
    return out


async def overhead(before: Path, url: str, tmp: Path, streams: int, tokens: int,
                   rounds: int) -> dict[str, list[dict[str, float]]]:
    model = overhead_bench.write_tiny_model(tmp / "tiny.gguf")
    config = EngineConfig(model_path=model, slots=streams, ctx=overhead_bench.CTX, threads=overhead_bench.THREADS,
                          kv_layout=KVLayout.AUTO)
    engine = IsolatedProcess(overhead_bench._start_engine, config)
    children = workers(before, url, model, tmp, "ab-overhead", SLOTQ_SLOTS=str(streams),
                       SLOTQ_CTX=str(overhead_bench.CTX), SLOTQ_THREADS=str(overhead_bench.THREADS))

    async def run() -> dict[str, list[dict[str, float]]]:
        by = await clients(url, "ab-overhead")
        try:
            first = 10_000_000
            engine.call(overhead_bench._engine_streams, 1, 4, first - 1)
            for client in by.values():
                await overhead_bench._redis_stream(client, 4, first - 2)(0)

            async def measure(system: str, r: int) -> dict[str, float]:
                start = first + (r * 3 + ["inprocess", "before", "after"].index(system)) * streams
                if system == "inprocess":
                    rate, main, process = engine.call(_engine_streams_cpu, streams, tokens, start)
                    return {"tokens_per_s": rate, **per_1k_tokens((main, process), streams * tokens)}
                pid = children[system].proc.pid
                cpu_before = cpu_seconds(pid, with_children=True)
                stream = overhead_bench._redis_stream(by[system], tokens, start)
                rate = await overhead_bench.all_streams(stream, streams)
                cpu = tuple(b - a for a, b in zip(cpu_before, cpu_seconds(pid, with_children=True), strict=True))
                return {"tokens_per_s": rate, **per_1k_tokens((cpu[0], cpu[1]), streams * tokens)}
            return await rotated_rounds(["inprocess", "before", "after"], measure, rounds)
        finally:
            for client in by.values():
                await client.close()
    try:
        return await run_watched(run(), *children.values())
    finally:
        for child in children.values():
            child.stop()
        engine.close()


async def queue(before: Path, url: str, tmp: Path, clients_n: int, per_client: int,
                rounds: int) -> dict[str, list[dict[str, float]]]:
    from slotq.engine import Engine

    model = bundled_model_path()
    children = workers(before, url, model, tmp, "ab-queue", SLOTQ_SLOTS=str(queue_bench.SLOTS),
                       SLOTQ_CTX=str(queue_bench.CTX), SLOTQ_PREFIX_CACHE="false")

    async def run() -> dict[str, list[dict[str, float]]]:
        engine = await Engine.start(EngineConfig(model_path=model, slots=queue_bench.SLOTS, ctx=queue_bench.CTX,
                                                 prefix_cache=False))
        by = await clients(url, "ab-queue")
        try:
            paths = {"inprocess": queue_bench._engine_request(engine, JOB_TOKENS),
                     **{system: queue_bench._queue_request(client, JOB_TOKENS)
                        for system, client in by.items()}}
            first = 0
            for one in paths.values():
                await queue_bench._closed_loop(one, clients_n, 1, first)        # warm-up, not measured
                first += clients_n

            async def measure(system: str, r: int) -> dict[str, float]:
                nonlocal first
                worker = system in children
                pid = children[system].proc.pid if worker else os.getpid()
                cpu_before = cpu_seconds(pid, with_children=worker)
                tps, timed = await queue_bench._closed_loop(paths[system], clients_n, per_client, first)
                cpu = tuple(b - a for a, b in zip(cpu_before, cpu_seconds(pid, with_children=worker), strict=True))
                first += clients_n * per_client
                return {"tokens_per_s": tps, "ttft_p50_ms": percentile([t.first_s or 0.0 for t in timed], 50) * 1000,
                        **per_1k_tokens((cpu[0], cpu[1]), sum(t.tokens for t in timed))}
            return await rotated_rounds(list(paths), measure, rounds)
        finally:
            for client in by.values():
                await client.close()
            await engine.close()
    try:
        return await run_watched(run(), *children.values())
    finally:
        for child in children.values():
            child.stop()


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def summary(figures: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """Per system: the mean of each figure over the rounds, and tokens/s over the in-process engine's."""
    out: dict[str, dict[str, Any]] = {
        system: {**{key: round(_mean([f[key] for f in rounds]), 1) for key in rounds[0]},
                 "rounds_tokens_per_s": [round(f["tokens_per_s"], 1) for f in rounds]}
        for system, rounds in figures.items()}
    for system in ("before", "after"):
        out[system]["over_inprocess"] = round(out[system]["tokens_per_s"] / out["inprocess"]["tokens_per_s"], 3)
        if "ttft_p50_ms" in out[system]:
            out[system]["added_ttft_ms"] = round(out[system]["ttft_p50_ms"] - out["inprocess"]["ttft_p50_ms"], 1)
    return out


def table(name: str, result: dict[str, dict[str, Any]]) -> str:
    header = ["workload", "system", "tok/s", "/ in-process", "TTFT p50 ms", "added TTFT ms",
              "main thread CPU ms / 1k tokens", "process CPU ms / 1k tokens"]
    rows = [[name, system, f"{r['tokens_per_s']:.0f}", f"{r.get('over_inprocess', 1.0):.2f}x",
             f"{r['ttft_p50_ms']:.0f}" if "ttft_p50_ms" in r else "-",
             f"{r['added_ttft_ms']:.0f}" if "added_ttft_ms" in r else "-",
             f"{r['loop_cpu_ms_per_1k']:.0f}", f"{r['cpu_ms_per_1k']:.0f}"]
            for system, r in result.items()]
    return markdown_table(header, rows)


def report(args: argparse.Namespace, data: dict[str, Any], tables: list[str]) -> None:
    """Print (and unless ``--quick`` write) what is measured so far: a workload's figures are kept
    even if a later one is stopped."""
    text = "\n\n".join(tables)
    print(text, flush=True)
    if not args.quick:
        command = f"python -m bench.worker_ab --before {args.before} --workloads {','.join(args.workloads)}" + "".join(
            f" --after-env {name}={value}" for name, value in AFTER_ENV.items()) + (
            f" --results {args.results}" if args.results != "worker_ab" else "")
        write_results(args.results, data, text, command)


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="slotq-bench-ab-") as tmp_name:
        tmp = Path(tmp_name)
        before = checkout(args.before, tmp / "before")
        redis = EmbeddedRedis(tmp / "redis")
        url = redis.start()
        data: dict[str, Any] = {"before": args.before, "after_env": AFTER_ENV, "rounds": args.rounds}
        tables = []
        try:
            if "overhead" in args.workloads:
                result = summary(await overhead(before, url, tmp, args.streams, args.tokens, args.rounds))
                data["overhead"] = {"streams": args.streams, "tokens": args.tokens, "systems": result}
                tables.append(table(f"overhead, {args.streams} streams x {args.tokens} tokens", result))
                report(args, data, tables)
            if "queue" in args.workloads:
                result = summary(await queue(before, url, tmp, args.clients, args.per_client, args.rounds))
                data["queue"] = {"clients": args.clients, "per_client": args.per_client, "systems": result}
                tables.append(table(f"queue, {args.clients} clients", result))
                report(args, data, tables)
        finally:
            redis.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the git revision to compare this checkout with")
    parser.add_argument("--workloads", default="overhead,queue", type=lambda s: s.split(","))
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--per-client", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--after-env", action="append", default=[], metavar="SLOTQ_NAME=VALUE",
                        help="a setting of the after worker only (repeatable): with --before HEAD, a setting on / off")
    parser.add_argument("--results", default="worker_ab", help="the name of the files written in bench/results")
    parser.add_argument("--quick", action="store_true", help="do not write bench/results")
    arguments = parser.parse_args()
    AFTER_ENV.update(item.split("=", 1) for item in arguments.after_env)
    asyncio.run(main(arguments))
