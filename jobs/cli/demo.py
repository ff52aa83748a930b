"""``slotq demo``: the whole path with no configuration.

An embedded Redis, one worker with the bundled model, a dozen varied chat jobs enqueued at
staggered times and streamed side by side, then a summary that compares the batched run with the
same arrivals served one at a time (:func:`one_at_a_time`), at the rate of a measured solo job.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from slotq.jobs.cli.redis_server import EmbeddedRedis
from slotq.jobs.cli.watch import ChildExited, WatchedTask, run_watched
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.schemas import EntryKind, JobRequest
from slotq.jobs.settings import WorkerSettings
from slotq.jobs.worker.worker import SlotqWorker

PROMPTS = [
    "Write a haiku about Redis.",
    "What is the capital of France?",
    "Give three tips for writing clean Python code.",
    "Explain continuous batching in one sentence.",
    "Name three planets of the solar system.",
    "Write a short greeting for a new colleague.",
    "What is 12 times 12?",
    "Describe the colour blue to someone who cannot see.",
    "Suggest a name for a friendly robot.",
    "Why is the sky blue? Answer briefly.",
    "List two benefits of unit tests.",
    "Write one sentence about the ocean.",
]


@dataclass
class JobView:
    prompt: str
    enqueued_at: float
    id: str = ""
    text: str = ""
    tokens: int = 0
    ttft: float | None = None
    done_at: float | None = None
    status: str = "queued"
    attempts: list[int] = field(default_factory=list)


def _table(views: list[JobView], started: float) -> Table:
    table = Table(title=f"slotq demo — {time.monotonic() - started:5.1f} s", expand=True)
    table.add_column("job", width=8)
    table.add_column("prompt", ratio=2)
    table.add_column("status", width=9)
    table.add_column("TTFT", width=7, justify="right")
    table.add_column("tokens", width=6, justify="right")
    table.add_column("output", ratio=4)
    for v in views:
        ttft = f"{v.ttft * 1000:.0f} ms" if v.ttft is not None else "-"
        tail = v.text.replace("\n", " ")[-90:]
        table.add_row(v.id[:8], v.prompt, v.status, ttft, str(v.tokens), tail)
    return table


async def _follow(client: SlotqClient, view: JobView) -> None:
    async for entry in client.stream(view.id):
        if entry.kind == EntryKind.CHUNK:
            if view.ttft is None:
                view.ttft = time.monotonic() - view.enqueued_at
            view.status = "running"
            view.text += entry.text
            view.tokens = entry.n_tokens
        elif entry.final:
            view.done_at = time.monotonic()
            view.status = entry.finish_reason.value if entry.finish_reason else entry.kind.value


async def run_demo(settings: WorkerSettings, *, n_jobs: int = 12, max_tokens: int = 48,
                   stagger_s: float = 0.25) -> None:
    console = Console()
    with contextlib.ExitStack() as stack:
        url = settings.redis_url
        if url is None:
            data = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="slotq-demo-")))
            server = EmbeddedRedis(data / "redis")
            url = server.start()
            stack.callback(server.stop)
            console.print(f"[dim]embedded Redis (Valkey) on {url}[/]")
        settings = settings.model_copy(update={"ctx": min(settings.ctx, 1024), "redis_url": url})
        worker = SlotqWorker(settings, url)
        console.print(f"[dim]loading {settings.engine_config().model_path.name} with {settings.slots} slots...[/]")
        worker_task = asyncio.create_task(worker.run(handle_signals=False))
        client = await SlotqClient.connect(url, settings)
        try:
            views, solo_rate = await run_watched(_demo_body(worker, client, console, n_jobs, max_tokens, stagger_s),
                                                 WatchedTask("the demo's worker", worker_task))
        except ChildExited as exc:
            Console(stderr=True, soft_wrap=True).print(f"[bold red]slotq demo stopped:[/] {escape(str(exc))}")
            raise SystemExit(1) from exc
        finally:
            await client.close()
            if not worker_task.done():
                worker.request_stop("demo finished", grace_s=0)
            await asyncio.gather(worker_task, return_exceptions=True)     # its error, if any, was reported
    _summary(console, views, solo_rate)


async def _demo_body(worker: SlotqWorker, client: SlotqClient, console: Console, n_jobs: int, max_tokens: int,
                     stagger_s: float) -> tuple[list[JobView], float]:
    await worker.ready.wait()
    views = await _run_jobs(client, console, n_jobs, max_tokens, stagger_s)
    return views, await _solo_rate(client, max_tokens)


async def _run_jobs(client: SlotqClient, console: Console, n_jobs: int, max_tokens: int,
                    stagger_s: float) -> list[JobView]:
    started = time.monotonic()
    views: list[JobView] = []
    followers: list[asyncio.Task[None]] = []
    with Live(_table(views, started), console=console, refresh_per_second=8) as live:
        for i in range(n_jobs):
            prompt = PROMPTS[i % len(PROMPTS)]
            view = JobView(prompt=prompt, enqueued_at=time.monotonic())
            job = await client.enqueue(JobRequest(messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=max_tokens, sampling={"temperature": 0.7, "seed": i}))
            view.id = job.id
            views.append(view)
            followers.append(asyncio.create_task(_follow(client, view)))
            live.update(_table(views, started))
            await asyncio.sleep(stagger_s)
        while not all(f.done() for f in followers):
            live.update(_table(views, started))
            await asyncio.sleep(0.1)
        live.update(_table(views, started))
    for f in followers:
        f.result()
    return views


async def _solo_rate(client: SlotqClient, max_tokens: int) -> float:
    """Tokens per second of one job running alone (the one-at-a-time baseline)."""
    started = time.monotonic()
    job = await client.enqueue(JobRequest(messages=[{"role": "user", "content": PROMPTS[0]}],
                                          max_tokens=max_tokens, ignore_eos=True,
                                          sampling={"temperature": 0.7, "seed": 0}))
    result = await job.result(timeout=300)
    return result.usage.completion_tokens / (time.monotonic() - started)


def _summary(console: Console, views: list[JobView], solo_rate: float) -> None:
    first = min(v.enqueued_at for v in views)
    wall = max(v.done_at or first for v in views) - first
    tokens = sum(v.tokens for v in views)
    table = Table(title="summary")
    table.add_column("job")
    table.add_column("TTFT", justify="right")
    table.add_column("tokens", justify="right")
    table.add_column("finish")
    for v in views:
        table.add_row(v.id[:8], f"{(v.ttft or 0) * 1000:.0f} ms", str(v.tokens), v.status)
    latency = sum((v.done_at or first) - v.enqueued_at for v in views) / len(views)
    solo_end, solo_latency = one_at_a_time([(v.enqueued_at - first, v.tokens) for v in views], solo_rate)
    console.print(Group(table,
                        f"{len(views)} jobs, {tokens} tokens in {wall:.1f} s: "
                        f"[bold]{tokens / wall:.1f} tokens/s[/] aggregate; a job took {latency:.1f} s on average "
                        f"from enqueue to its last token",
                        f"served one at a time as they arrived (at the measured solo rate, {solo_rate:.1f} "
                        f"tokens/s), the same jobs would end after about {solo_end:.1f} s, each taking "
                        f"{solo_latency:.1f} s on average: {_verdict(solo_latency / latency)}"))


def _verdict(speedup: float) -> str:
    """What the comparison says, both ways: on a CPU a batch shares the cores, so when jobs arrive
    slower than one alone is served, each job runs slower batched, and the summary says so."""
    if speedup >= 1:
        return f"continuous batching ran each job [bold]{speedup:.1f}x[/] faster"
    return (f"each job took {1 / speedup:.1f}x longer batched: these arrivals leave a lone job the cores to "
            "itself, and a batch shares them; batching pays once jobs arrive faster than one is served alone "
            "(slotq bench engine)")


def one_at_a_time(arrivals: list[tuple[float, int]], rate: float) -> tuple[float, float]:
    """The same jobs (seconds after the first arrival, tokens) served one at a time in arrival
    order, each taking its tokens / ``rate``: (when the last ends, the mean time from a job's
    arrival to its end). The jobs arrive staggered, so the batched run's wall time is mostly
    waiting for arrivals; what batching changes is how long each job takes."""
    if not arrivals or rate <= 0:
        return float("nan"), float("nan")
    free_at, total = 0.0, 0.0
    for arrived, tokens in sorted(arrivals):
        free_at = max(free_at, arrived) + tokens / rate
        total += free_at - arrived
    return free_at, total / len(arrivals)
