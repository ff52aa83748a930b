"""``slotq demo``: the whole path with no configuration.

An embedded Redis, one worker with the bundled model, and a dozen varied chat jobs that arrive at
once, streamed side by side as continuous batching serves them. Then the same jobs again, served
one at a time on the same worker, and a summary that sets the two runs side by side.
``slotq demo --tools`` runs a second demo on the same setup: questions the model answers by calling
a tool (:func:`run_tool_calls`).

The jobs arrive in a burst because that is where continuous batching pays: while jobs wait for a
slot, one decode step advances every running job for little more than the cost of one. Jobs that
arrive slower than one alone is served never wait, and on a CPU a batch only shares the cores
among them (the demo once spaced its jobs 0.25 s apart and so reported each job taking 2.3x longer
batched, true for those arrivals and the opposite of the project's point).

The one-at-a-time figures are a real run, not a rate times a token count: the same prompts and
seeds, each job generating exactly the tokens it got batched (``max_tokens`` = that count, EOS
ignored), on the same worker and model, with one job in flight at a time, which is what a one-slot
server does with a burst. A measured run counts each job's prompt processing and queue hand-off,
which a solo token rate leaves out, and it costs a few seconds (about 5 s for the default dozen
on 2 cores). It runs second, so whatever favours a later run (a warm machine, prompts already in
the prefix cache) favours one at a time, and the comparison errs against batching.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from slotq.jobs.cli.watch import ChildExited, WatchedTask, run_watched
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.schemas import EntryKind, JobRequest, assemble_tool_calls
from slotq.jobs.protocol.wire import (
    ChatMessage,
    FunctionDef,
    SamplingParams,
    ToolCallDelta,
    ToolCallSpec,
    ToolChoice,
    ToolSpec,
)
from slotq.jobs.redis_server import EmbeddedRedis
from slotq.jobs.worker.settings import WorkerSettings
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


# A ratio within this factor of 1 reads "about the same": run-to-run noise on a shared machine.
SAME_WITHIN = 1.05


@dataclass
class JobView:
    """One job as the demo watches it; the times are ``time.monotonic()`` readings."""

    prompt: str
    enqueued_at: float
    id: str = ""
    text: str = ""
    tokens: int = 0
    first_token_at: float | None = None
    done_at: float | None = None
    status: str = "queued"
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class Run:
    """One run of the demo's jobs, all of which arrived at ``arrived_at``."""

    arrived_at: float
    views: list[JobView] = field(default_factory=list)


@dataclass(frozen=True)
class RunFigures:
    """Seconds from the jobs' arrival until the last one ended, and on average until a job's first
    and its last token; a time that was not seen (a job that failed before its first token) is nan,
    so the summary says nothing it did not measure."""

    all_done_s: float
    mean_first_token_s: float
    mean_last_token_s: float
    tokens: int

    @classmethod
    def of(cls, run: Run) -> RunFigures:
        def since_arrival(at: float | None) -> float:
            return math.nan if at is None else at - run.arrived_at

        first = [since_arrival(v.first_token_at) for v in run.views]
        last = [since_arrival(v.done_at) for v in run.views]
        return cls(all_done_s=math.nan if any(map(math.isnan, last)) else max(last),
                   mean_first_token_s=sum(first) / len(first), mean_last_token_s=sum(last) / len(last),
                   tokens=sum(v.tokens for v in run.views))


def _request(index: int, max_tokens: int, *, exact: bool = False) -> JobRequest:
    """The demo's job ``index``: its prompt and its own seed, so the one-at-a-time run repeats it.
    ``exact``: exactly ``max_tokens`` tokens (EOS ignored), the count the job got batched."""
    return JobRequest(messages=[ChatMessage(role="user", content=PROMPTS[index % len(PROMPTS)])], max_tokens=max_tokens,
                      ignore_eos=exact, sampling=SamplingParams(temperature=0.7, seed=index))


def _table(title: str, run: Run) -> Table:
    table = Table(title=f"{title} — {time.monotonic() - run.arrived_at:5.1f} s", expand=True)
    table.add_column("job", width=8)
    table.add_column("prompt", ratio=2)
    table.add_column("status", width=9)
    table.add_column("TTFT", width=7, justify="right")
    table.add_column("tokens", width=6, justify="right")
    table.add_column("output", ratio=4)
    for v in run.views:
        ttft = f"{(v.first_token_at - v.enqueued_at) * 1000:.0f} ms" if v.first_token_at is not None else "-"
        tail = v.text.replace("\n", " ")[-90:]
        table.add_row(v.id[:8], v.prompt, v.status, ttft, str(v.tokens), tail)
    return table


async def _follow(client: SlotqClient, view: JobView) -> None:
    async for entry in client.stream(view.id):
        if entry.kind == EntryKind.CHUNK:
            if view.first_token_at is None:
                view.first_token_at = time.monotonic()
            view.status = "running"
            view.text += entry.text
            view.tool_calls += entry.tool_calls
            view.tokens = entry.n_tokens
        elif entry.final:
            view.done_at = time.monotonic()
            view.status = entry.finish_reason.value if entry.finish_reason else entry.kind.value


async def _follow_live(client: SlotqClient, views: Sequence[JobView], live: Live,
                       render: Callable[[], RenderableType]) -> None:
    """Follow each job's stream to its end, redrawing ``live`` as they go."""
    followers = {asyncio.create_task(_follow(client, v)) for v in views}
    while not all(f.done() for f in followers):
        live.update(render())
        await asyncio.wait(followers, timeout=0.1)
    live.update(render())
    for f in followers:
        f.result()


async def run_demo(settings: WorkerSettings, *, n_jobs: int = 12, max_tokens: int = 48, tools: bool = False) -> None:
    """The burst demo, or with ``tools`` the tool-call demo, on an embedded Redis (unless
    ``settings.redis_url`` names one) and an in-process worker."""
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
        body = (_tools_body(worker, client, console, max_tokens) if tools
                else _demo_body(worker, client, console, n_jobs, max_tokens, settings.slots))
        try:
            summary = await run_watched(body, WatchedTask("the demo's worker", worker_task))
        except ChildExited as exc:
            Console(stderr=True, soft_wrap=True).print(f"[bold red]slotq demo stopped:[/] {escape(str(exc))}")
            raise SystemExit(1) from exc
        finally:
            await client.close()
            if not worker_task.done():
                worker.request_stop("demo finished", grace_s=0)
            await asyncio.gather(worker_task, return_exceptions=True)     # its error, if any, was reported
    console.print(summary)


async def _demo_body(worker: SlotqWorker, client: SlotqClient, console: Console, n_jobs: int, max_tokens: int,
                     slots: int) -> RenderableType:
    await worker.ready.wait()
    batched = await run_burst(client, console, n_jobs, max_tokens, slots)
    return _summary(batched, await run_one_at_a_time(client, console, batched), slots)


async def run_burst(client: SlotqClient, console: Console, n_jobs: int, max_tokens: int, slots: int) -> Run:
    """All jobs enqueued at once and streamed side by side as the worker batches them."""
    run = Run(arrived_at=time.monotonic())
    run.views = [JobView(prompt=PROMPTS[i % len(PROMPTS)], enqueued_at=run.arrived_at) for i in range(n_jobs)]
    title = f"slotq demo: {n_jobs} jobs arrived at once, batched on {slots} slots"
    with Live(_table(title, run), console=console, refresh_per_second=8) as live:
        jobs = await asyncio.gather(*(client.enqueue(_request(i, max_tokens)) for i in range(n_jobs)))
        for view, job in zip(run.views, jobs, strict=True):
            view.id = job.id
        await _follow_live(client, run.views, live, lambda: _table(title, run))
    return run


async def run_one_at_a_time(client: SlotqClient, console: Console, batched: Run) -> Run:
    """The burst's jobs again, as if they had all arrived now at a server that runs one at a time:
    each enqueued when the one before it has ended, with the tokens it got batched."""
    run = Run(arrived_at=time.monotonic())

    def progress() -> Text:
        ended = sum(v.done_at is not None for v in run.views)
        return Text(f"for comparison, the same {len(batched.views)} jobs one at a time: {ended} done, "
                    f"{time.monotonic() - run.arrived_at:.1f} s", style="dim")

    with Live(progress(), console=console, refresh_per_second=8) as live:
        for index, job in enumerate(batched.views):
            view = JobView(prompt=job.prompt, enqueued_at=time.monotonic())
            view.id = (await client.enqueue(_request(index, max(job.tokens, 1), exact=True))).id
            run.views.append(view)
            await _follow_live(client, [view], live, progress)
    return run


def _summary(batched: Run, alone: Run, slots: int) -> RenderableType:
    table = Table(title="summary: seconds from the jobs' arrival to their first / last token")
    table.add_column("job")
    table.add_column("tokens", justify="right")
    table.add_column("finish")
    table.add_column("batched", justify="right")
    table.add_column("one at a time", justify="right")
    for b, a in zip(batched.views, alone.views, strict=True):
        table.add_row(b.id[:8], str(b.tokens), b.status, _first_and_last(b, batched), _first_and_last(a, alone))
    return Group(table, *summary_lines(len(batched.views), slots, RunFigures.of(batched), RunFigures.of(alone)))


def _first_and_last(view: JobView, run: Run) -> str:
    def since_arrival(at: float | None) -> str:
        return "-" if at is None else f"{at - run.arrived_at:.2f}"

    return f"{since_arrival(view.first_token_at)} / {since_arrival(view.done_at)}"


def summary_lines(n_jobs: int, slots: int, batched: RunFigures, alone: RunFigures) -> list[str]:
    """What a newcomer reads at the end: the burst batched against the same jobs one at a time."""
    all_done = (f"{n_jobs} jobs arrived at once: all done in [bold]{batched.all_done_s:.1f} s batched[/] on {slots} "
                f"slots vs {alone.all_done_s:.1f} s one at a time ({_compare(batched.all_done_s, alone.all_done_s)})")
    waits = (f"mean time to first token {batched.mean_first_token_s:.2f} s vs {alone.mean_first_token_s:.2f} s "
             f"({_compare(batched.mean_first_token_s, alone.mean_first_token_s)}), to last token "
             f"{batched.mean_last_token_s:.1f} s vs {alone.mean_last_token_s:.1f} s "
             f"({_compare(batched.mean_last_token_s, alone.mean_last_token_s)})")
    rates = (f"{batched.tokens} tokens: {batched.tokens / batched.all_done_s:.0f} tokens/s aggregate batched vs "
             f"{alone.tokens / alone.all_done_s:.0f} one at a time; {_verdict(batched.all_done_s, alone.all_done_s)}")
    return [all_done, waits, rates]


def _compare(batched_s: float, alone_s: float) -> str:
    """How a batched time compares with the same one at a time, in words."""
    if batched_s * SAME_WITHIN <= alone_s:
        return f"{alone_s / batched_s:.1f}x sooner"
    if alone_s * SAME_WITHIN <= batched_s:
        return f"{batched_s / alone_s:.1f}x later"
    return "about the same" if batched_s == batched_s and alone_s == alone_s else "not measured"


def _verdict(batched_s: float, alone_s: float) -> str:
    """Why the burst went the way it did, either way. Batching wins where a decode step has compute
    to spare, so that advancing many jobs costs little more than one (a GPU, a CPU whose cores one
    sequence does not keep busy). Where one job alone already keeps every core busy (a 1-core CPU
    with no GPU), a batch only shares the cores, and the summary says so."""
    if batched_s * SAME_WITHIN <= alone_s:
        return ("continuous batching wins a burst: each decode step advances every running job, and a job that "
                "arrives starts at the next step instead of waiting for the jobs before it to end")
    if alone_s * SAME_WITHIN <= batched_s:
        return ("here one job alone already keeps the cores busy, and a batch only shares them; batching pays where "
                "a decode step has compute to spare (a GPU, more cores: slotq bench engine)")
    return ("here a batch costs about as much per job as it saves; batching pays where a decode step has compute to "
            "spare (a GPU, more cores: slotq bench engine)")


# ---------------------------------------------------------------------- slotq demo --tools
CITY = {"type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 32}}}
TOOLS = [ToolSpec(function=FunctionDef(name="get_weather", description="Current weather in a city", parameters=CITY)),
         ToolSpec(function=FunctionDef(name="get_time", description="Current local time in a city", parameters=CITY))]
TOOL_QUESTIONS = [
    "What is the weather in Paris?",
    "What time is it in Tokyo?",
    "Is it raining in London?",
    "What is the weather like in Lisbon today?",
]
# Room for the longest call the schema allows (32 characters of city, up to 4 tokens each on a byte-level
# vocabulary); a real model's call ends after a dozen or so.
CALL_MAX_TOKENS = 160


@dataclass
class ToolTurn:
    """One question: the job that called a tool, what the (stand-in) tool returned, and the job
    that answered from it."""

    question: str
    call: JobView
    calls: list[ToolCallSpec] = field(default_factory=list)
    results: list[str] = field(default_factory=list)
    answer: JobView | None = None


def run_tool(call: ToolCallSpec) -> str:
    """The demo's stand-in tools: fixed answers that name the city asked about, so the demo needs
    no network and the answer shows whether the result reached the model."""
    city = str(json.loads(call.function.arguments).get("city", "?"))
    if call.function.name == "get_weather":
        return f"Sunny and 21 degrees in {city}."
    return f"It is 14:05 in {city}."


def _tool_request(messages: list[ChatMessage], tool_choice: ToolChoice, max_tokens: int) -> JobRequest:
    return JobRequest(messages=messages, tools=TOOLS, tool_choice=tool_choice, max_tokens=max_tokens,
                      sampling=SamplingParams(temperature=0))


def _call_text(calls: list[ToolCallSpec]) -> str:
    return "; ".join(f"{c.function.name}({c.function.arguments})" for c in calls)


def _tools_table(turns: list[ToolTurn], started: float) -> Table:
    table = Table(title=f"slotq demo --tools: a question, a tool call, its result, the answer — "
                        f"{time.monotonic() - started:5.1f} s", expand=True)
    table.add_column("question", ratio=2)
    table.add_column("tool call", ratio=3, overflow="fold")     # JSON arguments have no spaces to wrap at
    table.add_column("tool result", ratio=2)
    table.add_column("answer", ratio=3)
    for t in turns:
        call = _call_text(assemble_tool_calls(t.call.tool_calls))
        if t.call.status != "tool_calls":
            call = f"{call} ({t.call.status})" if call else t.call.status      # queued, running, or how it failed
        answer = t.answer.text.replace("\n", " ") or t.answer.status if t.answer else ""
        table.add_row(t.question, call, " ".join(t.results), answer)
    return table


async def _tools_body(worker: SlotqWorker, client: SlotqClient, console: Console, max_tokens: int) -> RenderableType:
    await worker.ready.wait()
    turns = await run_tool_calls(client, console, max_tokens)
    called = [t for t in turns if t.calls]      # the replies that ended in a complete call
    return (f"{len(turns)} questions, {len(called)} answered with a tool call (finish_reason tool_calls): "
            "tool_choice \"required\" constrains each call's arguments to its function's JSON schema, so even a "
            "135M model's calls validate; the demo ran stand-in tools and sent the results back as tool messages "
            "for the answers")


async def run_tool_calls(client: SlotqClient, console: Console, max_tokens: int) -> list[ToolTurn]:
    """Each question enqueued at once with ``tool_choice="required"``; each call the replies make run
    by :func:`run_tool`; the conversation sent back with the results (``tool_choice="none"``) for
    the answers. One live table shows the calls stream in and the answers after them."""
    started = time.monotonic()
    turns = [ToolTurn(question=q, call=JobView(prompt=q, enqueued_at=started)) for q in TOOL_QUESTIONS]
    with Live(_tools_table(turns, started), console=console, refresh_per_second=8) as live:
        asked = [[ChatMessage(role="user", content=t.question)] for t in turns]
        jobs = await asyncio.gather(*(client.enqueue(_tool_request(messages, "required", CALL_MAX_TOKENS))
                                      for messages in asked))
        for turn, job in zip(turns, jobs, strict=True):
            turn.call.id = job.id
        await _follow_live(client, [t.call for t in turns], live, lambda: _tools_table(turns, started))
        answering: list[tuple[ToolTurn, JobRequest]] = []
        for turn, messages in zip(turns, asked, strict=True):
            if turn.call.status != "tool_calls":
                continue            # the reply failed: its row shows why, and there is no call to answer from
            turn.calls = assemble_tool_calls(turn.call.tool_calls)
            turn.results = [run_tool(c) for c in turn.calls]
            conversation = [*messages, ChatMessage(role="assistant", tool_calls=turn.calls),
                            *(ChatMessage(role="tool", tool_call_id=c.id, content=result)
                              for c, result in zip(turn.calls, turn.results, strict=True))]
            answering.append((turn, _tool_request(conversation, "none", max_tokens)))
        answers = await asyncio.gather(*(client.enqueue(request) for _, request in answering))
        for (turn, _), job in zip(answering, answers, strict=True):
            turn.answer = JobView(prompt=turn.question, enqueued_at=time.monotonic(), id=job.id)
        await _follow_live(client, [t.answer for t in turns if t.answer], live, lambda: _tools_table(turns, started))
    return turns
