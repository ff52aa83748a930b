"""What ``slotq bulk`` shows: a live bar while it runs (done / failed / total, tokens/s, ETA) and a
summary table at the end."""

from __future__ import annotations

import time
from collections import deque

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from slotq.jobs.bulk.runner import BulkSummary
from slotq.jobs.protocol.wire import Usage

RATE_WINDOW_S = 20.0


class _TokenRate(ProgressColumn):
    """Generated tokens per second over the last RATE_WINDOW_S, from the lines that finished."""

    def __init__(self, events: deque[tuple[float, int]], started: list[float]) -> None:
        super().__init__()
        self.events = events
        self.started = started

    def render(self, task: Task) -> Text:
        now = time.monotonic()
        while self.events and self.events[0][0] < now - RATE_WINDOW_S:
            self.events.popleft()
        span = min(RATE_WINDOW_S, now - self.started[0]) if self.started else 0
        rate = sum(n for _, n in self.events) / span if span > 0 else 0.0
        return Text(f"{rate:,.0f} tok/s", style="cyan")


class RichProgress:
    """A :class:`~slotq.jobs.bulk.runner.BulkObserver` drawing on stderr."""

    def __init__(self, console: Console | None = None) -> None:
        self._events: deque[tuple[float, int]] = deque()
        self._started: list[float] = []
        self.progress = Progress(
            TextColumn("[bold]bulk"), BarColumn(), MofNCompleteColumn(),
            TextColumn("[red]{task.fields[failed]} failed"),
            _TokenRate(self._events, self._started), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=console or Console(stderr=True))
        self._task: TaskID | None = None
        self._failed = 0

    def started(self, total: int, done: int) -> None:
        self._started.append(time.monotonic())
        self._task = self.progress.add_task("bulk", total=total, completed=done, failed=0)
        self.progress.start()

    def line_finished(self, ok: bool, usage: Usage) -> None:
        assert self._task is not None
        self._failed += not ok
        self._events.append((time.monotonic(), usage.completion_tokens))
        self.progress.update(self._task, advance=1, failed=self._failed)

    def stopped(self, summary: BulkSummary) -> None:
        self.progress.stop()


def summary_table(summary: BulkSummary) -> Table:
    table = Table("", "", title="slotq bulk", show_header=False, title_justify="left")
    rows = [
        ("input", f"{summary.input}  (run {summary.identity})"),
        ("output", summary.output),
        ("errors", f"{summary.errors}" if summary.failed else "-"),
        ("lines", f"{summary.total:,}"),
        ("done by earlier runs", f"{summary.done_before:,}"),
        ("succeeded now", f"{summary.succeeded:,}"),
        ("failed", f"[red]{summary.failed:,}[/red]" if summary.failed else "0"),
    ]
    if summary.interrupted:
        rows.append(("interrupted", (f"{summary.left_in_queue:,} lines still in the queue; run the same command "
                                     "again to finish")))
    rows += [
        ("tokens", f"{summary.prompt_tokens:,} prompt + {summary.completion_tokens:,} generated"),
        ("time", f"{summary.wall_s:,.1f} s, {summary.tokens_per_s:,.1f} generated tokens/s"),
        ("peak memory", f"{summary.peak_rss_mb:,.0f} MB"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table
