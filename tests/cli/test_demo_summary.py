"""``slotq demo``'s comparison: the same staggered arrivals served one at a time. It used to divide
all tokens by the solo rate, as if every job had been there at the start, and on the demo's
arrivals (one every 0.25 s) reported continuous batching as 0.8x one at a time."""

from __future__ import annotations

import pytest

from slotq.jobs.cli.demo import one_at_a_time


def test_jobs_that_overlap_queue_behind_each_other() -> None:
    # 10 tokens at 10 tokens/s: 1 s each; the second arrives at 0.25 s and starts at 1 s
    assert one_at_a_time([(0.0, 10), (0.25, 10)], rate=10) == pytest.approx((2.0, (1.0 + 1.75) / 2))


def test_a_job_that_arrives_after_the_server_went_idle_waits_for_nothing() -> None:
    assert one_at_a_time([(5.0, 10), (0.0, 10)], rate=10) == pytest.approx((6.0, 1.0))


def test_no_rate_or_no_jobs_gives_no_figure() -> None:
    end, mean = one_at_a_time([(0.0, 10)], rate=0)
    assert end != end and mean != mean          # nan: the summary says nothing it did not measure
