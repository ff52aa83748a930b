"""``slotq bench fleet --cluster N,... [--models M] [--partitions P]``: does streaming capacity grow with a Valkey
Cluster's shards?

The fleet benchmark's streaming steps (:data:`~bench.fleet_bench.STREAMING`: a GPU's pace, one token per sequence
per 20 ms step, a 10 ms and the default 100 ms flush) run on one Valkey and on a local Valkey Cluster of each number
of primaries (:class:`~slotq.jobs.redis_cluster.LocalValkeyCluster`, no replicas, the same persistence), side by
side. Each step is :func:`~bench.fleet_bench.measure_step`, on a fresh server or cluster; per flush setting the
backends run one after the other, so a change in the machine's load between them stays small. Everything runs on a
cluster as a user's fleet would: workers, producers and stream readers on ``redis+cluster://`` URLs, the job
streams in hash-tag buckets (:data:`~slotq.jobs.protocol.keys.STREAM_TAGS`), the claim path on its queue's slot.

On a machine with fewer cores than shards, the shards share the cores, so a cluster's capacity is read from CPU
accounting rather than from wall-clock saturation: each primary's ``INFO cpu`` over the window, and capacity =
running jobs / the hottest primary's cores, the busy slots at which that primary would fill its own core (one
Valkey: busy slots per Valkey core), beside its ratio to one Valkey measured in the same run. Each primary's
``INFO commandstats`` beside it says what that core is spent on. The target checked is the issue's
(:data:`CLUSTER_TARGET_RATIO` times one Valkey's capacity at :data:`CLUSTER_TARGET_PRIMARIES` primaries, pickup p99
under 100 ms).

``--models M`` spreads the same load over M models' queues named to land one per primary
(:func:`~bench.fleet_bench.model_queues`); ``--partitions P`` splits each queue into P partitions
(``SLOTQ_QUEUE_PARTITIONS``) on every backend, one Valkey too. With either, a third table says where each queue
landed: its hash slot, its primary and that primary's CPU.

Without ``--quick`` it writes ``bench/results/fleet-cluster.md``, ``fleet-cluster-M-models.md`` with
``--models``, ``fleet-cluster-P-partitions.md`` with ``--partitions`` (``fleet-cluster-M-models-P-partitions.md``
with both). The figures and what they mean for sizing a cluster: docs/benchmarks.md ("On a Valkey Cluster") and
docs/cluster.md ("What it buys").
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from redis.crc import key_slot

from bench.fleet_bench import (
    FULL,
    HOSTS,
    QUICK,
    READ_EVERY,
    SLOTS_PER_WORKER,
    STREAMING,
    STREAMING_RATE,
    STREAMING_SLOTS,
    Plan,
    _capacity,
    _queue_prefix,
    measure_step,
    passes,
)
from bench.report import markdown_table, progress, write_results
from slotq.jobs.protocol.keys import STREAM_TAGS

# ``--cluster``: the target, a streaming capacity of this many times one Valkey's at this many
# primaries (each step's pickup p99 under fleet_bench.PICKUP_P99_LIMIT_MS)
CLUSTER_TARGET_RATIO = 2.5
CLUSTER_TARGET_PRIMARIES = 3


async def run_cluster(quick: bool, primaries: list[int], plan: Plan | None = None,
                      models: int = 1, partitions: int = 1) -> tuple[dict[str, Any], str]:
    """``slotq bench fleet --cluster N,... [--models M] [--partitions P]``: the streaming steps on one Valkey
    and on a local Valkey Cluster of each number of ``primaries``, side by side; per flush setting, the
    backends run one after the other, so a change in the machine's load between them stays small.
    ``models``: the same load spread over that many models' queues on every backend
    (:func:`~bench.fleet_bench.model_queues`); ``partitions``: each queue split into that many partitions on
    every backend (``SLOTQ_QUEUE_PARTITIONS``; one Valkey too, so the baseline pays the partitions' extra
    commands as well)."""
    plan = plan or (QUICK if quick else FULL)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="slotq-fleet-cluster-") as tmp:
        for stream_settings in STREAMING:
            for n in (0, *primaries):
                progress(f"streaming on {_backend_label(n)}: {STREAMING_SLOTS} slots, {STREAMING_RATE:g} "
                         f"enqueues/s, {stream_settings.sim.step_s * 1000:g} ms steps, "
                         f"{stream_settings.stream_flush_ms:g} ms flush")
                row = await measure_step("slotq", STREAMING_SLOTS, STREAMING_RATE, plan, stream_settings,
                                         Path(tmp) / f"streaming-{stream_settings.stream_flush_ms:g}-{n}", primaries=n,
                                         models=models, partitions=partitions)
                row = {**row, "stream_flush_ms": stream_settings.stream_flush_ms, **_capacity(row)}
                progress(f"  pickup p50 {row['pickup_p50_ms']} ms, p99 {row['pickup_p99_ms']} ms, Valkey "
                         f"{row['valkey_cpu_cores']} cores, hottest primary {row['hottest_primary_cores']}, "
                         f"capacity {row['capacity_busy_slots']:,} busy slots")
                rows.append(row)
    for row in rows:
        one = next(r for r in rows if r["primaries"] == 0 and r["stream_flush_ms"] == row["stream_flush_ms"])
        row["capacity_vs_one_valkey"] = round(row["capacity_busy_slots"] / one["capacity_busy_slots"], 2)
    data = {"streaming_by_backend": rows, "settings": STREAMING[0].model_dump(),
            "stream_flush_ms": [s.stream_flush_ms for s in STREAMING], "plan": plan.model_dump(),
            "targets": _cluster_targets(rows)}
    table = f"{_cluster_table(rows)}\n\n{_commandstats_table(rows)}"
    command = f"slotq bench fleet --cluster {','.join(map(str, primaries))}"
    spread = {"models": models, "partitions": partitions}
    if models > 1 or partitions > 1:
        table += f"\n\n{_queues_table(rows)}"
    command += "".join(f" --{name} {count}" for name, count in spread.items() if count > 1)
    name = "-".join(["fleet-cluster", *(f"{count}-{name}" for name, count in spread.items() if count > 1)])
    if not quick:
        write_results(name, data, table, command)
    return data, table


# ---------------------------------------------------------------------- the report
def _backend_label(primaries: int) -> str:
    return "one Valkey" if primaries == 0 else f"a cluster of {primaries} primar{'y' if primaries == 1 else 'ies'}"


def _cluster_targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's target per flush setting, checked on this run's rows at the target's size."""
    out: dict[str, Any] = {}
    for r in rows:
        if r["primaries"] == CLUSTER_TARGET_PRIMARIES:
            out[f"{r['stream_flush_ms']:g}_ms_flush"] = {
                "capacity_vs_one_valkey": r["capacity_vs_one_valkey"],
                f"at_least_{CLUSTER_TARGET_RATIO:g}x": r["capacity_vs_one_valkey"] >= CLUSTER_TARGET_RATIO,
                "pickup_p99_under_100_ms": passes(r),
            }
    return out


def _queues_on(r: dict[str, Any], node: str) -> int:
    """How many of a step's queues have their hash slot on ``node`` (0 on one Valkey, where slots do not apply)."""
    return sum(primary == node for primary in (r["queue_primary_by_queue"] or {}).values())


def _by_queues_then_cores(r: dict[str, Any]) -> list[str]:
    """A step's primaries, those holding the most queues first, then the busiest."""
    cores: dict[str, float] = r["valkey_cores_by_primary"]
    return sorted(cores, key=lambda node: (-_queues_on(r, node), -cores[node]))


def _queue_mark(queues: int) -> str:
    return "" if not queues else "q" if queues == 1 else f"{queues}q"


def _cluster_table(rows: list[dict[str, Any]]) -> str:
    def cores_split(r: dict[str, Any]) -> str:
        """Each primary's share of the Valkey CPU, the queues' primaries first (marked q, 2q: the queues whose
        hash slot it serves); with its stream buckets."""
        by_node: dict[str, float] = r["valkey_cores_by_primary"]
        buckets: dict[str, int] | None = r["stream_buckets_by_primary"]
        return " / ".join(f"{by_node[node] / r['valkey_cpu_cores']:.0%}" + _queue_mark(_queues_on(r, node))
                          + (f" ({buckets[node]})" if buckets else "") for node in _by_queues_then_cores(r))

    table = markdown_table(
        ["stream flush ms", "Valkey", "running", "pickup p50 / p99 ms", "commands / token",
         "Valkey cores: all / hottest primary", "CPU share per primary (stream buckets)",
         "hottest queue's primary: cores",
         "capacity: busy slots", "vs one Valkey"],
        [[f"{r['stream_flush_ms']:g}", _backend_label(r["primaries"]).removeprefix("a "), f"{r['running_jobs']}",
          f"{r['pickup_p50_ms']:g} / {r['pickup_p99_ms']:g}"
          + (f" ({r['unclaimed_jobs']} unclaimed)" if r["unclaimed_jobs"] else ""),
          f"{r['redis_commands_per_token']}", f"{r['valkey_cpu_cores']:.3f} / {r['hottest_primary_cores']:.3f}",
          cores_split(r), f"{r['queue_primary_cores']:.3f}", f"{r['capacity_busy_slots']:,}",
          f"{r['capacity_vs_one_valkey']:.2f}x"] for r in rows])
    sim = STREAMING[0].sim
    models = rows[0]["models"] if rows else 1
    partitions = rows[0].get("partitions", 1) if rows else 1
    spread = ("" if models == 1 else
              f" spread over {models} models' queues (each worker serving one, the enqueues going to each in turn; "
              f"{rows[0]['workers']} workers of {STREAMING_SLOTS // rows[0]['workers']} slots),")
    if partitions > 1:
        spread += (f" {'each' if models > 1 else 'the'} queue split into {partitions} partitions "
                   f"(SLOTQ_QUEUE_PARTITIONS: a job's partition by its id, every worker claiming from all),")
    return (f"{table}\n\nStreaming at a GPU's pace on one Valkey and on local Valkey Clusters (no replicas), side by "
            f"side: {STREAMING_SLOTS} slots, {STREAMING_RATE:g} enqueues/s of {STREAMING[0].job_tokens}-token jobs,"
            f"{spread} the simulated engine stepping every {sim.step_s * 1000:g} ms with one token per sequence "
            f"({sim.tokens_per_s:g} tokens/s), at most {SLOTS_PER_WORKER} slots per worker in {HOSTS} processes, "
            f"one job in {READ_EVERY} followed by a stream reader; a fresh server or cluster (append-only, fsync every "
            f"second) per step. The shards share this machine's cores, so capacity comes from CPU accounting, not from "
            f"saturating them: capacity = running jobs / the hottest primary's Valkey cores, the busy slots at which "
            f"that primary would fill its own core (one Valkey: busy slots per Valkey core). CPU share: each "
            f"primary's part of the Valkey CPU, the primaries of the queues' hash slots first (q, or 2q for two "
            f"queues: every claim-path key of the queue, its job records and results); in brackets, how many of the "
            f"{len(STREAM_TAGS)} stream buckets it holds.")


def _commandstats_table(rows: list[dict[str, Any]]) -> str:
    """Each primary's ``INFO commandstats`` over the window, beside its CPU: what each shard spends its core on."""
    def commands(per_s: dict[str, float]) -> str:
        return ", ".join(f"{name} {calls:,.0f}" for name, calls in list(per_s.items())[:6])

    def times(usec_per_s: dict[str, float]) -> str:
        """The six commands that took the most time, in ms per second; EVALSHA's includes its commands'."""
        return ", ".join(f"{name} {usec / 1000:.1f}" for name, usec in list(usec_per_s.items())[:6])

    lines = []
    for r in rows:
        by_node: dict[str, dict[str, float]] = r["commands_per_s_by_primary"]
        buckets: dict[str, int] | None = r["stream_buckets_by_primary"]
        cores: dict[str, float] = r["valkey_cores_by_primary"]
        for node in _by_queues_then_cores(r):
            queues = _queue_mark(_queues_on(r, node)) if buckets else ""
            role = (f"{queues}, " if queues else "") + (f"{buckets[node]} buckets" if buckets else "everything")
            lines.append([f"{r['stream_flush_ms']:g}", _backend_label(r["primaries"]).removeprefix("a "), role,
                          f"{cores[node]:.3f}", f"{sum(by_node[node].values()):,.0f}", commands(by_node[node]),
                          times(r.get("command_usec_per_s_by_primary", {}).get(node, {}))])
    table = markdown_table(["stream flush ms", "Valkey", "primary", "cores", "commands/s", "busiest commands/s",
                            "most time, ms/s"], lines)
    return (f"{table}\n\nINFO commandstats of each primary over the same windows, calls per second and the time "
            f"they took (ms per second of the window; 1,000 would be a whole core): a script's commands count "
            f"under their own names as well as in its EVALSHA, whose time includes theirs, so commands/s counts "
            f"both. What is not in any command's time (the event loop, parsing, replies, the cluster bus) is "
            f"the rest of the primary's cores.")


def _queues_table(rows: list[dict[str, Any]]) -> str:
    """Where each queue (each model's, each partition) landed on each cluster: its hash slot's primary, and that
    primary's CPU."""
    lines = []
    for r in rows:
        by_queue: dict[str, str] | None = r["queue_primary_by_queue"]
        if not by_queue:
            continue
        order = _by_queues_then_cores(r)
        for queue, node in by_queue.items():
            lines.append([f"{r['stream_flush_ms']:g}", _backend_label(r["primaries"]).removeprefix("a "), queue,
                          f"{key_slot(_queue_prefix(queue).encode())}", f"{order.index(node) + 1} ({node})",
                          f"{r['valkey_cores_by_primary'][node]:.3f}"])
    table = markdown_table(["stream flush ms", "Valkey", "queue", "hash slot", "primary (as above)", "its cores"],
                           lines)
    return (f"{table}\n\nEach queue (each model's, and each partition of a partitioned queue: ``<queue>#<n>``) and "
            f"the primary that serves its hash slot, numbered in the order of the CPU shares above. Models' queue "
            f"names are picked to land one queue per primary (``model-k``, else ``model-k.n`` with the first n that "
            f"lands on the k-th primary); a queue's partitions are named to land one P-th of the slots apart "
            f"(docs/cluster.md).")
