"""Where a worker's time goes: ``python -m bench.profile_worker`` (needs py-spy: ``pip install 'slotq[bench]'``).

Starts Valkey and a ``slotq worker`` (bundled model, 8 slots), warms it up, then records it with
py-spy (native frames, every thread, idle samples included) while 8 closed-loop clients run 64-token
jobs through Redis, and reads Valkey's ``INFO commandstats`` over the same window. Prints, per
thread, the share of samples by leaf frame, and the Redis commands per generated token. Profiling
with native frames slows the worker, so its tokens/s here is not a benchmark figure.
"""

from __future__ import annotations

import asyncio
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.queue_bench import _closed_loop, _queue_request
from slotq.engine import bundled_model_path
from slotq.jobs.cli.redis_server import EmbeddedRedis
from slotq.jobs.cli.watch import ChildProcess, run_watched
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.settings import ClientSettings

CLIENTS, PER_CLIENT, MAX_TOKENS = 8, 6, 64


def summarize(raw_profile: Path, top: int = 6) -> str:
    """py-spy's raw (collapsed) stacks -> per thread: idle share and the busiest leaf frames."""
    by_thread: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in raw_profile.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        by_thread[frames[0]][frames[-1]] += int(count)
    out = []
    for thread, leaves in sorted(by_thread.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(leaves.values())
        leaf, most = leaves.most_common(1)[0]
        if most > 0.99 * total and leaf.startswith("0x"):
            continue                                    # an executor thread that only ever slept
        out.append(f"{thread}: {total} samples")
        out += [f"  {n / total:6.1%}  {leaf}" for leaf, n in leaves.most_common(top)]
    return "\n".join(out)


async def main() -> None:
    if shutil.which("py-spy") is None and not (Path(sys.executable).parent / "py-spy").exists():
        raise SystemExit("py-spy is not installed: pip install 'slotq[bench]'")
    spy_bin = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    with tempfile.TemporaryDirectory(prefix="slotq-profile-") as tmp:
        redis = EmbeddedRedis(Path(tmp) / "redis")
        url = redis.start()
        env = {**os.environ, "SLOTQ_REDIS_URL": url, "SLOTQ_MODEL": str(bundled_model_path()), "SLOTQ_SLOTS": "8",
               "SLOTQ_CTX": "512", "SLOTQ_PREFIX_CACHE": "false", "SLOTQ_LOG_LEVEL": "WARNING"}
        worker = ChildProcess("the profiled worker", [sys.executable, "-m", "slotq.jobs.cli", "worker"], env=env,
                              log_path=Path(tmp) / "worker.log")
        try:
            await run_watched(_profile(url, worker, spy_bin, Path(tmp) / "profile.txt"), worker)
        finally:
            worker.stop()
            redis.stop()


async def _profile(url: str, worker: ChildProcess, spy_bin: str, out: Path) -> None:
    async with await SlotqClient.connect(url, ClientSettings(redis_url=url)) as client:
        while not (await client.queue_info()).workers:
            await asyncio.sleep(0.2)
        one = _queue_request(client, MAX_TOKENS)
        await _closed_loop(one, CLIENTS, 1)                                   # warm-up
        await client.redis.execute_command("CONFIG", "RESETSTAT")
        spy = subprocess.Popen([spy_bin, "record", "--pid", str(worker.proc.pid), "--native", "--threads", "--idle",
                                "--rate", "50", "--format", "raw", "-o", str(out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await asyncio.sleep(1.0)
        tokens_per_s, _ = await _closed_loop(one, CLIENTS, PER_CLIENT)
        spy.send_signal(signal.SIGINT)
        spy.wait()
        stats = await client.redis.execute_command("INFO", "commandstats")
    tokens = CLIENTS * PER_CLIENT * MAX_TOKENS
    print(f"{CLIENTS} clients x {PER_CLIENT} jobs x {MAX_TOKENS} tokens at {tokens_per_s:.1f} tokens/s under py-spy")
    print(summarize(out))
    print("Redis commands per generated token (INFO commandstats, commands inside scripts included):")
    rows = sorted(stats.items(), key=lambda kv: -kv[1]["calls"])
    print(f"  total {sum(v['calls'] for _, v in rows) / tokens:.2f}")
    for name, v in rows[:10]:
        print(f"  {v['calls'] / tokens:6.3f}  {name.removeprefix('cmdstat_')}")


if __name__ == "__main__":
    asyncio.run(main())
