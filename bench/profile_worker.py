"""Where a worker's time goes: ``python -m bench.profile_worker [--tiny-streams S]`` (needs py-spy:
``pip install 'slotq[bench]'``).

Starts Valkey and a ``slotq worker``, warms it up, then records it with py-spy (native frames, every
thread, idle samples included, its engine process too with ``SLOTQ_ENGINE_PROCESS=true`` in the
environment) while jobs run through Redis, and reads Valkey's ``INFO
commandstats`` over the same window. Two workloads:

- default: the bundled model, 8 slots, 8 closed-loop clients running 64-token jobs;
- ``--tiny-streams S``: ``slotq bench overhead``'s workload, the suite's tiny model with S slots of
  1,024 tokens and S streams of 256 tokens started together, where decode costs little and the job
  layer's per-token work shows.

Prints, per thread, the share of samples by leaf frame and by slotq function (the innermost
``slotq`` frame of each sample: where the job layer spends its own time), and the Redis commands per
generated token. Profiling with native frames slows the worker, so its tokens/s here is not a
benchmark figure. ``--keep PATH`` keeps py-spy's raw stacks (for a flame graph: ``py-spy``'s
``--format raw`` output feeds ``flamegraph.pl`` or speedscope).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import overhead_bench
from bench.overhead_bench import write_tiny_model
from bench.queue_bench import _closed_loop, _queue_request
from slotq.engine import bundled_model_path
from slotq.jobs.cli.watch import ChildProcess, run_watched
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.redis_server import EmbeddedRedis
from slotq.jobs.settings import ClientSettings

CLIENTS, PER_CLIENT, MAX_TOKENS = 8, 6, 64
TINY_ROUNDS = 5


_PROCESSES = re.compile(r'((?:process \d+:"[^"]*";)*)')


def summarize(raw_profile: Path, top: int = 8) -> str:
    """py-spy's raw (collapsed) stacks -> per thread: the busiest leaf frames, and the busiest
    innermost slotq frames (the job layer's and the engine's own functions, callees included)."""
    leaves: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    ours: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in raw_profile.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        processes = _PROCESSES.match(stack)       # --subprocesses: the process and its parents first
        assert processes is not None
        pids = re.findall(r"process (\d+):", processes.group(1))
        frames = stack[processes.end():].split(";")
        thread = f"process {pids[-1]} ({len(pids) - 1} below the worker), {frames[0]}" if pids else frames[0]
        leaves[thread][frames[-1]] += int(count)
        inner = next((f for f in reversed(frames) if _is_slotq(f)), "(no slotq frame)")
        ours[thread][inner] += int(count)
    out = []
    for thread, counts in sorted(leaves.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(counts.values())
        leaf, most = counts.most_common(1)[0]
        if most > 0.99 * total and leaf.startswith("0x"):
            continue                                    # an executor thread that only ever slept
        out.append(f"{thread}: {total} samples")
        out += [f"  {n / total:6.1%}  {leaf}" for leaf, n in counts.most_common(top)]
        out.append("  innermost slotq frame:")
        out += [f"  {n / total:6.1%}  {frame}" for frame, n in ours[thread].most_common(top)]
    return "\n".join(out)


def _is_slotq(frame: str) -> bool:
    """A frame of slotq's own code: py-spy names a frame ``function (path:line)``, the path relative
    to its ``sys.path`` entry (``jobs/...``, ``engine/...`` in a checkout; ``slotq/...`` installed)."""
    return any(f"({root}/" in frame for root in ("jobs", "engine", "slotq"))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny-streams", type=int, metavar="S",
                        help="profile slotq bench overhead's workload: the tiny model, S slots, S streams")
    parser.add_argument("--keep", type=Path, metavar="PATH", help="keep py-spy's raw stacks here")
    args = parser.parse_args()
    asyncio.run(_run(args.tiny_streams, args.keep))


async def _run(tiny_streams: int | None, keep: Path | None) -> None:
    if shutil.which("py-spy") is None and not (Path(sys.executable).parent / "py-spy").exists():
        raise SystemExit("py-spy is not installed: pip install 'slotq[bench]'")
    spy_bin = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    with tempfile.TemporaryDirectory(prefix="slotq-profile-") as tmp:
        redis = EmbeddedRedis(Path(tmp) / "redis")
        url = redis.start()
        env = {**os.environ, "SLOTQ_REDIS_URL": url, "SLOTQ_LOG_LEVEL": "WARNING"}
        if tiny_streams:
            env |= {"SLOTQ_MODEL": str(write_tiny_model(Path(tmp) / "tiny.gguf")), "SLOTQ_SLOTS": str(tiny_streams),
                    "SLOTQ_CTX": str(overhead_bench.CTX), "SLOTQ_THREADS": str(overhead_bench.THREADS),
                    "SLOTQ_ELASTIC": "false"}
        else:
            env |= {"SLOTQ_MODEL": str(bundled_model_path()), "SLOTQ_SLOTS": "8", "SLOTQ_CTX": "512",
                    "SLOTQ_PREFIX_CACHE": "false"}
        worker = ChildProcess("the profiled worker", [sys.executable, "-m", "slotq.jobs.cli", "worker"], env=env,
                              log_path=Path(tmp) / "worker.log")
        out = keep or Path(tmp) / "profile.txt"
        try:
            await run_watched(_profile(url, worker, spy_bin, out, tiny_streams), worker)
        finally:
            worker.stop()
            redis.stop()


async def _profile(url: str, worker: ChildProcess, spy_bin: str, out: Path, tiny_streams: int | None) -> None:
    async with await SlotqClient.connect(url, ClientSettings(redis_url=url)) as client:
        while not (await client.queue_info()).workers:
            await asyncio.sleep(0.2)
        if tiny_streams:
            tokens = TINY_ROUNDS * tiny_streams * overhead_bench.TOKENS
            label = f"{TINY_ROUNDS} rounds of {tiny_streams} streams x {overhead_bench.TOKENS} tokens (tiny model)"

            async def workload() -> float:      # a round lasts a second or two: several, so the window is mostly work
                rates = [await overhead_bench.all_streams(
                    overhead_bench._redis_stream(client, overhead_bench.TOKENS, 1_000_000 + r * tiny_streams),
                    tiny_streams) for r in range(TINY_ROUNDS)]
                return sum(rates) / len(rates)
            await overhead_bench.all_streams(overhead_bench._redis_stream(client, 8, 2_000_000), tiny_streams)
        else:
            tokens = CLIENTS * PER_CLIENT * MAX_TOKENS
            label = f"{CLIENTS} clients x {PER_CLIENT} jobs x {MAX_TOKENS} tokens"
            one = _queue_request(client, MAX_TOKENS)

            async def workload() -> float:
                return (await _closed_loop(one, CLIENTS, PER_CLIENT))[0]
            await _closed_loop(one, CLIENTS, 1)                                   # warm-up
        await client.redis.execute_command("CONFIG", "RESETSTAT")
        spy = subprocess.Popen([spy_bin, "record", "--pid", str(worker.proc.pid), "--native", "--threads", "--idle",
                                "--subprocesses", "--rate", "50", "--format", "raw", "-o", str(out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await asyncio.sleep(1.0)                # py-spy attaches (its first second is idle in every thread)
        tokens_per_s = await workload()
        spy.send_signal(signal.SIGINT)
        spy.wait()
        stats = await client.redis.execute_command("INFO", "commandstats")
    print(f"{label} at {tokens_per_s:.1f} tokens/s under py-spy")
    print(summarize(out))
    print("Redis commands per generated token (INFO commandstats, commands inside scripts included):")
    rows = sorted(stats.items(), key=lambda kv: -kv[1]["calls"])
    print(f"  total {sum(v['calls'] for _, v in rows) / tokens:.2f}")
    for name, v in rows[:10]:
        print(f"  {v['calls'] / tokens:6.3f}  {name.removeprefix('cmdstat_')}")


if __name__ == "__main__":
    main()
