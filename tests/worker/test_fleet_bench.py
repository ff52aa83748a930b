"""``slotq bench fleet``'s measuring step, run small: both claim paths, real fleet processes
(``bench/fleet_host.py``), a real Valkey, the real producer client and stream readers.

The benchmark's figures are only as good as its load. Two defects went unseen because nothing ran
it: every stream reader but the first failed at once (so the tables streamed far less than their
captions said), and the arq baseline never entered the worker registry (so the benchmark waited
three minutes for it and stopped). ``slotq bench fleet --cluster`` runs the same step on a local
Valkey Cluster; it is run here on the smallest cluster that has more than one primary to split
the load over. These tests assert counts only, never timings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.fleet_bench import READ_EVERY, FleetSettings, Plan, _capacity, measure_step
from bench.fleet_cluster_bench import _cluster_table, _queues_table
from bench.fleet_host import Design
from bench.sim_engine import SimulationParams
from slotq.jobs.cli.main import main
from slotq.jobs.protocol.keys import STREAM_TAGS, partition_names

SLOTS = 100                  # two workers of 50, one per fleet process
RATE = 20.0                  # enqueues/s
# 20-token jobs at 50 tokens/s (0.4 s each): the first ones finish within the warm-up.
SETTINGS = FleetSettings(job_tokens=20, sim=SimulationParams(tokens_per_s=50, step_s=0.1), stream_flush_ms=100)
PLAN = Plan(sizes=(SLOTS,), warmup_s=1, window_s=2, min_jobs=0, max_window_s=2, tail_s=1.5, up=(), down=())


def _assert_every_job_claimed_and_streams_followed(row: dict[str, Any]) -> None:
    assert row["workers"] == 2
    assert row["jobs_measured"] > 0
    assert row["unclaimed_jobs"] == 0
    assert row["enqueues_unanswered_after_1s"] == 0
    # about 5 s of enqueues at 20/s, one in READ_EVERY followed; most of them have ended
    enqueued_before_the_tail = RATE * (SETTINGS.job_seconds + 2 + PLAN.window_s)
    assert row["streams_followed_to_the_end"] >= enqueued_before_the_tail / READ_EVERY / 2


def _fleet_errors(workdir: Path) -> list[str]:
    """The ERROR lines the fleet processes logged: a worker's loop failing on the backend (a cluster
    refusing a command) would change the load measured without stopping the step."""
    return [line for log in sorted(workdir.glob("host*.log")) for line in log.read_text().splitlines()
            if " ERROR " in line]


@pytest.mark.slow
@pytest.mark.parametrize("design", ["slotq", "baseline"])
async def test_a_small_fleet_step_claims_every_job_and_follows_one_stream_in_ten(design: Design,
                                                                                 tmp_path: Path) -> None:
    row = await measure_step(design, SLOTS, RATE, PLAN, SETTINGS, tmp_path / design)
    _assert_every_job_claimed_and_streams_followed(row)
    assert list(row["valkey_cores_by_primary"]) == [row["queue_primary"]]        # one Valkey holds everything
    assert row["hottest_primary_cores"] == row["queue_primary_cores"]


@pytest.mark.slow
async def test_the_step_on_a_cluster_splits_its_valkey_cpu_over_the_primaries(tmp_path: Path) -> None:
    row = await measure_step("slotq", SLOTS, RATE, PLAN, SETTINGS, tmp_path / "cluster", primaries=2)
    _assert_every_job_claimed_and_streams_followed(row)
    assert _fleet_errors(tmp_path / "cluster") == []
    by_primary = row["valkey_cores_by_primary"]
    assert len(by_primary) == 2 and min(by_primary.values()) > 0      # streams on both, claims on one
    assert row["queue_primary"] in by_primary
    assert row["hottest_primary_cores"] == max(by_primary.values())
    assert row["stream_buckets_by_primary"].keys() == by_primary.keys()
    assert sum(row["stream_buckets_by_primary"].values()) == len(STREAM_TAGS)
    # each primary's time by command: the flush scripts, every stream bucket's, took time on both
    assert row["command_usec_per_s_by_primary"].keys() == by_primary.keys()
    assert all(usec["evalsha"] > 0 for usec in row["command_usec_per_s_by_primary"].values())


def test_the_cluster_option_is_the_fleet_benchmarks_only() -> None:
    with pytest.raises(SystemExit, match="--cluster apply to `slotq bench fleet` only"):
        main(["bench", "queue", "--cluster", "3"])


@pytest.mark.slow
async def test_the_load_spread_over_models_puts_each_queue_on_its_own_primary(tmp_path: Path) -> None:
    """``--models 2`` on 2 primaries: two models' queues, a worker each, named so that their hash slots lie on
    different primaries; every job of both is claimed, and each primary serves one queue's claim path."""
    row = await measure_step("slotq", SLOTS, RATE, PLAN, SETTINGS, tmp_path / "models", primaries=2, models=2)
    _assert_every_job_claimed_and_streams_followed(row)
    assert _fleet_errors(tmp_path / "models") == []
    by_queue = row["queue_primary_by_queue"]
    assert len(by_queue) == 2 and all(queue.startswith("slotq:queue:model-") for queue in by_queue)
    assert set(by_queue.values()) == set(row["valkey_cores_by_primary"])        # one queue on each primary
    assert row["queue_primary"] in by_queue.values()


def test_the_models_option_needs_the_cluster_option() -> None:
    with pytest.raises(SystemExit, match="--models applies with --cluster only"):
        main(["bench", "fleet", "--models", "3"])


@pytest.mark.slow
async def test_one_queue_split_into_partitions_puts_a_partition_on_each_primary(tmp_path: Path) -> None:
    """``--partitions 2`` on 2 primaries: one queue, its two partitions' hash slots on the two primaries, both
    workers claiming from both; every job is claimed and each primary serves one partition's claim path."""
    row = await measure_step("slotq", SLOTS, RATE, PLAN, SETTINGS, tmp_path / "partitions", primaries=2,
                             partitions=2)
    _assert_every_job_claimed_and_streams_followed(row)
    assert _fleet_errors(tmp_path / "partitions") == []
    assert row["partitions"] == 2
    by_queue = row["queue_primary_by_queue"]
    assert list(by_queue) == list(partition_names("slotq:queue", 2))
    assert set(by_queue.values()) == set(row["valkey_cores_by_primary"])        # one partition on each primary
    reported = [{**row, "stream_flush_ms": SETTINGS.stream_flush_ms, **_capacity(row), "capacity_vs_one_valkey": 1.0}]
    assert "the queue split into 2 partitions" in _cluster_table(reported)
    assert all(queue in _queues_table(reported) for queue in by_queue)


def test_the_partitions_option_needs_the_cluster_option() -> None:
    with pytest.raises(SystemExit, match="--partitions applies with --cluster only"):
        main(["bench", "fleet", "--partitions", "3"])
    with pytest.raises(SystemExit, match="--partitions apply to `slotq bench fleet` only"):
        main(["bench", "queue", "--partitions", "3"])
