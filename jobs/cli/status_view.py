"""``slotq status``: the fleet as rich tables, once or refreshed in place (``--watch``): the queue, its
workers, and the models the fleet can load (loaded or not) with their waiting jobs; on a Redis Cluster,
each shard's load too."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from slotq.jobs.aio import wait_until_set
from slotq.jobs.protocol.schemas import ModelInfo, QueueInfo, WorkerInfo
from slotq.jobs.protocol.shard_load import ShardLoad

_DEGRADATION_STYLE = {"none": "green", "small_batch": "yellow", "cap_tokens": "dark_orange", "refuse": "red"}


@dataclass(frozen=True)
class Status:
    """What one look shows: the queue and its workers, on a cluster the load of each shard (none on
    a single Redis), the models of the fleet's catalog, and the keys that hold the queue's demand (one per
    partition): what KEDA's triggers read."""

    queue: QueueInfo
    shards: Sequence[ShardLoad] = ()
    models: Sequence[ModelInfo] = ()
    demand_keys: Sequence[str] = ()


def _age(seconds: float | None) -> str:
    return f"{seconds:.1f} s" if seconds is not None else "-"


def _state(w: WorkerInfo) -> Text:
    if w.draining:
        return Text("draining", style="yellow")
    return Text("ready", style="green") if w.ready else Text("warming up", style="cyan")


def _by_reason(reasons: dict[str, int]) -> str:
    """`` (2 killed_its_worker, 1 tries_exhausted)``, or nothing when no dead letter has a reason."""
    return f" ({', '.join(f'{n} {reason}' for reason, n in reasons.items())})" if reasons else ""


def _speculation(w: WorkerInfo) -> str:
    """``ngram 62% (310/500)``: the draft source and, since the worker started, the share of draft
    tokens verification kept (accepted / drafted); ``off``, or the source alone before its first draft."""
    acceptance = w.spec_acceptance
    if acceptance is None:
        return w.spec
    return f"{w.spec} {acceptance:.0%} ({w.spec_accepted_tokens}/{w.spec_draft_tokens})"


def _mebibytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _shards(shards: Sequence[ShardLoad]) -> Table:
    """One row per primary; the queue's shard, which carries its whole claim path, is marked."""
    buckets = sum(len(shard.stream_slots) for shard in shards)
    table = Table("primary", "replicas", "slots", "keys", "memory", "ops/s (share)", "CPU", "clients",
                  "stream buckets", "slotq keys (share)", "queue", title="cluster shards",
                  caption="CPU: one core's share since the last refresh (--watch). slotq keys: in the queue's slot "
                          "and the stream buckets' slots. queue: ◀ this queue's slot (◀ partition: of a queue split "
                          "into partitions, those whose slot it serves); the models' queues whose slot it serves")
    table.columns[0].no_wrap = True
    for shard in shards:
        table.add_row(
            shard.node, str(shard.replicas), ", ".join(f"{first}-{last}" for first, last in shard.slots),
            str(shard.keys), _mebibytes(shard.used_memory_bytes), f"{shard.ops_per_s} ({_share(shard.ops_share)})",
            _share(shard.cpu_share), str(shard.clients), f"{len(shard.stream_slots)}/{buckets}",
            f"{shard.slotq_keys} ({_share(shard.slotq_keys_share)})",
            Text.assemble(*([(f"◀ slot {shard.queue_slot} ", "bold")] if shard.queue_slot is not None else []),
                          *([(f"◀ partition {', '.join(map(str, shard.partitions))} ", "bold")]
                            if shard.partitions else []),
                          ", ".join(shard.queues)))
    return table


def _models(models: Sequence[ModelInfo]) -> Table:
    """One row per model the fleet can load: where its jobs wait, how many, and who has it loaded."""
    table = Table("model", "kind", "queue", "state", "loaded on", "can load", "queued", "oldest wait", "running",
                  "load", title="models",
                  caption="unloaded: no worker has it loaded; its jobs wait in its queue until a worker that can load "
                          "it (SLOTQ_MODELS) switches to it. load: what loading it cost a worker")
    for m in models:
        state = Text(m.status, style={"loaded": "green", "loading": "cyan"}.get(m.status, "yellow"))
        table.add_row(m.model, m.kind.value, m.queue, state, ", ".join(m.loaded_on) or "-", ", ".join(m.can_load),
                      str(m.queued), _age(m.oldest_queued_age_s), str(m.running),
                      f"{m.load_s:.2f} s" if m.load_s is not None else "-")
    return table


def _share(share: float | None) -> str:
    return f"{share:.0%}" if share is not None else "-"


def _demand(keys: Sequence[str]) -> str | None:
    """Where KEDA reads the queue's demand: one trigger's listName, or of a queue split into partitions one
    trigger per partition, their values summed (deploy/kubernetes/cluster/partitioned)."""
    if len(keys) > 1:
        return f"demand: KEDA's listNames, one trigger each, summed: {', '.join(keys)}"
    return f"demand: KEDA's listName {keys[0]}" if keys else None


def render(info: QueueInfo, *, shards: Sequence[ShardLoad] = (), models: Sequence[ModelInfo] = (),
           demand_keys: Sequence[str] = (), at: float | None = None) -> RenderableType:
    lanes = Table("lane", "queued", "oldest wait", "deferred", "running", "preempted", title=f"queue {info.queue}",
                  caption=_demand(demand_keys))
    for lane in info.lanes:
        lanes.add_row(lane.lane, str(lane.queued), _age(lane.oldest_queued_age_s), str(lane.deferred),
                      str(lane.running), str(lane.preempted))
    workers = Table("worker", "model", "load", "state", "busy / active / max slots", "KV used", "tokens/s",
                    "per stream", "drafts kept", "memory", "degradation",
                    caption="load: what loading its model cost (engine start + warm-up); a worker of several "
                            "models loads one at a time (1 of N)")
    for w in info.workers:
        kv = f"{(w.kv_cells_used - w.kv_cells_cached) / w.kv_cells_total:.0%}" if w.kv_cells_total else "-"
        active = w.slots_active if w.slots_active is not None else w.slots_total
        workers.add_row(
            w.id, w.model if w.models == 1 else f"{w.model} (1 of {w.models})",
            f"{w.load_s:.2f} s" if w.load_s is not None else "-", _state(w),
            f"{w.slots_busy} / {active} / {w.slots_total}", kv, f"{w.tokens_per_s:.1f}",
            f"{w.stream_tokens_per_s:.1f}" if w.stream_tokens_per_s else "-",
            _speculation(w),
            f"{w.memory_ratio:.0%}" if w.memory_ratio is not None else "-",
            Text(w.degradation, style=_DEGRADATION_STYLE.get(w.degradation, "")))
    active_total = sum(w.slots_active if w.slots_active is not None else w.slots_total for w in info.workers)
    summary = (f"fleet: {info.slots_busy}/{active_total} active slots busy ({info.slots_total} max) across "
               f"{len(info.workers)} workers, {sum(w.ready for w in info.workers)} ready; "
               f"{info.dead_letters} dead letters{_by_reason(info.dead_letters_by_reason)}; "
               f"{info.interrupted_attempts} attempts interrupted (no try "
               f"spent), {info.failed_attempts} failed (a try each)")
    if at is not None:
        summary += f"; updated {time.strftime('%H:%M:%S', time.localtime(at))}"
    return Group(lanes, workers, Text(summary), *([_models(models)] if models else []),
                 *([_shards(shards)] if shards else []))


async def watch(read: Callable[[], Awaitable[Status]], *, interval_s: float, console: Console | None = None,
                rounds: int | None = None, stop: asyncio.Event | None = None) -> None:
    """Redraw the view in place every ``interval_s`` until ``stop`` is set (or after ``rounds``).

    The command sets ``stop`` from its Ctrl-C handler rather than letting asyncio cancel the
    loop: a cancellation that lands inside a Redis read's own timeout can be swallowed (Python
    3.11), which left the view running after Ctrl-C."""
    console = console or Console()
    stop = stop or asyncio.Event()
    async def draw() -> RenderableType:
        status = await read()
        return render(status.queue, shards=status.shards, models=status.models, demand_keys=status.demand_keys,
                      at=time.time())

    with Live(await draw(), console=console, auto_refresh=False, redirect_stderr=False) as live:
        done = 1
        while rounds is None or done < rounds:
            if await wait_until_set(stop, interval_s):
                return
            live.update(await draw(), refresh=True)
            done += 1
