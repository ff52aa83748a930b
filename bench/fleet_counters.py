"""What the fleet benchmark reads at the start and end of each measured window: Valkey's own
counters (``INFO commandstats``, calls and time: commands run inside Lua scripts count, each under its own
name, and a script's time includes theirs;
``INFO cpu``; on a cluster, of every primary: the commands summed, each primary's CPU apart) and the
CPU time of the benchmark's processes and of the whole machine (``/proc``), so a result can say
whether Valkey or the simulator's Python side ran out of CPU first, and how late each process's
event loop ran."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from slotq.jobs.protocol.connection import is_cluster

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
NOT_COUNTED = {"info"}           # the benchmark's own reads of these counters


@dataclass(frozen=True)
class Counters:
    wall: float
    commands: dict[str, int]     # command name -> calls, summed over the primaries
    commands_by_node: dict[str, dict[str, int]]   # "host:port" of each primary -> command name -> calls
    usec_by_node: dict[str, dict[str, int]]       # the same, -> microseconds spent in the command
    valkey_cpu_s: dict[str, float]   # "host:port" of each primary (the one server's) -> its CPU seconds
    python_cpu_s: float          # the benchmark's Python processes (driver and fleet hosts)
    machine_busy_s: float        # every process on the machine, summed over cores


@dataclass(frozen=True)
class Window:
    seconds: float
    commands: dict[str, int]
    commands_by_node: dict[str, dict[str, int]]
    usec_by_node: dict[str, dict[str, int]]
    valkey_cores_by_node: dict[str, float]
    python_cores: float
    machine_busy_cores: float

    @property
    def total_commands(self) -> int:
        return sum(self.commands.values())

    @property
    def valkey_cores(self) -> float:
        """Every primary's CPU together (the one server's on a single Valkey)."""
        return sum(self.valkey_cores_by_node.values())


async def read(redis: Redis, python_pids: list[int]) -> Counters:
    """The counters now; on a cluster, each primary's (replicas serve no command of the benchmark)."""
    stats, cpu = await _info_by_node(redis, "commandstats"), await _info_by_node(redis, "cpu")
    by_node = {node: {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in node_stats.items()}
               for node, node_stats in stats.items()}
    usec_by_node = {node: {name.removeprefix("cmdstat_"): int(v["usec"]) for name, v in node_stats.items()}
                    for node, node_stats in stats.items()}
    commands: dict[str, int] = {}
    for node_commands in by_node.values():
        for command, calls in node_commands.items():
            commands[command] = commands.get(command, 0) + calls
    return Counters(wall=time.monotonic(), commands=commands, commands_by_node=by_node, usec_by_node=usec_by_node,
                    valkey_cpu_s={node: float(c["used_cpu_sys"]) + float(c["used_cpu_user"])
                                  for node, c in cpu.items()},
                    python_cpu_s=sum(_process_cpu_s(pid) for pid in python_pids), machine_busy_s=_machine_busy_s())


async def _info_by_node(redis: Redis, section: str) -> dict[str, dict[str, Any]]:
    """``INFO section`` of every primary, by its ``host:port``."""
    if is_cluster(redis):
        # one node at a time: redis-py keys a reply by node only when it asked several (not a 1-primary cluster)
        cluster = cast(RedisCluster, redis)
        await cluster.initialize()
        return {str(node.name): await cluster.info(section, target_nodes=node) for node in cluster.get_primaries()}
    where = redis.connection_pool.connection_kwargs
    return {f"{where.get('host', 'localhost')}:{where.get('port', 6379)}": await redis.info(section)}


def window(start: Counters, end: Counters) -> Window:
    seconds = end.wall - start.wall
    return Window(seconds=seconds, commands=_delta(start.commands, end.commands),
                  commands_by_node={node: _delta(start.commands_by_node.get(node, {}), calls)
                                    for node, calls in end.commands_by_node.items()},
                  usec_by_node={node: _delta(start.usec_by_node.get(node, {}), usec)
                                for node, usec in end.usec_by_node.items()},
                  valkey_cores_by_node={node: (cpu_s - start.valkey_cpu_s.get(node, 0.0)) / seconds
                                        for node, cpu_s in end.valkey_cpu_s.items()},
                  python_cores=(end.python_cpu_s - start.python_cpu_s) / seconds,
                  machine_busy_cores=(end.machine_busy_s - start.machine_busy_s) / seconds)


def _delta(start: dict[str, int], end: dict[str, int]) -> dict[str, int]:
    """Calls per command between two readings (the benchmark's own INFO left out)."""
    return {name: calls - start.get(name, 0) for name, calls in end.items()
            if name not in NOT_COUNTED and calls > start.get(name, 0)}


class LagProbe:
    """How late this process's event loop runs a timer: the delay every claim, enqueue and write
    of the process waits on top of Redis. Run :meth:`run` as a task; :meth:`take_max_ms` returns
    the worst lag since the previous call."""

    def __init__(self, period_s: float = 0.05) -> None:
        self.period_s = period_s
        self._max_s = 0.0

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            await asyncio.sleep(self.period_s)
            self._max_s = max(self._max_s, time.monotonic() - started - self.period_s)

    def take_max_ms(self) -> float:
        worst, self._max_s = self._max_s, 0.0
        return worst * 1000


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (0 once it has gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS      # utime, stime (fields 14 and 15)


def _machine_busy_s() -> float:
    """CPU seconds the machine spent busy (not idle or waiting for I/O), all cores."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]
    return (sum(values[:8]) - idle) / CLOCK_TICKS
