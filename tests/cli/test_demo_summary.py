"""``slotq demo``: a burst of jobs batched, then the same jobs one at a time on the same worker, and a
summary that says plainly which way the comparison went. The demo used to space its jobs 0.25 s
apart; on 2 cores a lone job then has the cores to itself, and the summary read "each job took 2.3x
longer batched", the project's point shown backwards."""

from __future__ import annotations

import io
import math
from collections.abc import Awaitable, Callable

from rich.console import Console

from slotq.jobs.cli.demo import JobView, Run, RunFigures, run_burst, run_one_at_a_time, summary_lines
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.worker.worker import SlotqWorker


def test_the_summary_names_the_burst_and_the_one_at_a_time_run() -> None:
    lines = summary_lines(12, 8, batched=RunFigures(all_done_s=2.0, mean_first_token_s=0.2, mean_last_token_s=1.5,
                                                    tokens=400),
                          alone=RunFigures(all_done_s=5.0, mean_first_token_s=2.5, mean_last_token_s=2.9, tokens=400))
    assert lines[0] == ("12 jobs arrived at once: all done in [bold]2.0 s batched[/] on 8 slots vs 5.0 s one at a time "
                        "(2.5x sooner)")
    assert "first token 0.20 s vs 2.50 s (12.5x sooner), to last token 1.5 s vs 2.9 s (1.9x sooner)" in lines[1]
    assert "200 tokens/s aggregate batched vs 80 one at a time" in lines[2]
    assert "continuous batching wins a burst" in lines[2]


def test_where_batching_loses_the_summary_says_so_and_why() -> None:
    # a 1-core CPU with no GPU: one job alone keeps the core busy, and a batch only shares it
    lines = summary_lines(12, 8, batched=RunFigures(all_done_s=6.0, mean_first_token_s=1.0, mean_last_token_s=5.0,
                                                    tokens=400),
                          alone=RunFigures(all_done_s=5.0, mean_first_token_s=2.5, mean_last_token_s=2.9, tokens=400))
    assert lines[0].endswith("vs 5.0 s one at a time (1.2x later)")
    assert "to last token 5.0 s vs 2.9 s (1.7x later)" in lines[1]
    assert "wins" not in lines[2] and "one job alone already keeps the cores busy" in lines[2]


def test_a_difference_within_noise_is_about_the_same() -> None:
    figures = RunFigures(all_done_s=5.0, mean_first_token_s=2.5, mean_last_token_s=2.9, tokens=400)
    lines = summary_lines(12, 8, batched=figures, alone=figures)
    assert lines[0].endswith("(about the same)") and "costs about as much per job as it saves" in lines[2]


def test_figures_count_from_the_jobs_arrival_and_leave_an_unseen_time_unknown() -> None:
    run = Run(arrived_at=100.0, views=[JobView("a", 100.0, tokens=10, first_token_at=100.5, done_at=102.0),
                                       JobView("b", 100.0, tokens=20, first_token_at=101.5, done_at=104.0)])
    assert RunFigures.of(run) == RunFigures(all_done_s=4.0, mean_first_token_s=1.0, mean_last_token_s=3.0, tokens=30)
    failed = Run(arrived_at=100.0, views=[*run.views, JobView("c", 100.0, status="error", done_at=100.1)])
    assert math.isnan(RunFigures.of(failed).mean_first_token_s)     # no first token: says nothing it did not see


async def test_the_burst_arrives_at_once_and_the_same_jobs_then_run_one_at_a_time(
        start_worker: Callable[..., Awaitable[SlotqWorker]], client: SlotqClient) -> None:
    await start_worker(slots=4)
    quiet = Console(file=io.StringIO())
    batched = await run_burst(client, quiet, n_jobs=6, max_tokens=8, slots=4)
    assert {v.enqueued_at for v in batched.views} == {batched.arrived_at}
    assert all(v.status in ("stop", "length") and v.done_at is not None for v in batched.views)

    alone = await run_one_at_a_time(client, quiet, batched)
    assert [v.prompt for v in alone.views] == [v.prompt for v in batched.views]
    assert [v.tokens for v in alone.views] == [v.tokens for v in batched.views]      # the same work, to the token
    for before, after in zip(alone.views, alone.views[1:], strict=False):
        assert before.done_at is not None and after.enqueued_at >= before.done_at     # never two in flight
