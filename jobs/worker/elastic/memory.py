"""How much memory this worker uses, and against what limit.

Used: the process's resident set (``/proc/self/statm``), which includes the model's mmapped weights
once touched, the KV cache and Python itself; with the engine in a process of its own
(``SLOTQ_ENGINE_PROCESS``), that process's resident set too, where the model and the KV cache live.

Limit, the smallest that applies: ``SLOTQ_MEMORY_LIMIT_MB``; the memory cgroup's limit (a container's
``resources.limits.memory``, the kernel's OOM line): cgroup v2 ``memory.max``, or v1
``memory.limit_in_bytes``, found through ``/proc/self/cgroup`` (or at the mount's root inside a
container's cgroup namespace); the machine's physical memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

UNLIMITED = 1 << 62         # cgroup v1 reports "no limit" as a number near 2**63


@dataclass(frozen=True)
class MemoryLimit:
    bytes: int
    source: str          # for the start-up log line: where the limit came from


def process_rss_bytes(statm: Path = Path("/proc/self/statm")) -> int:
    resident_pages = int(statm.read_text().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def worker_rss_bytes(engine_pid: int | None) -> int:
    """This process's resident set, plus its engine process's when it has one (gone: nothing)."""
    used = process_rss_bytes()
    if engine_pid is not None:
        try:
            used += process_rss_bytes(Path(f"/proc/{engine_pid}/statm"))
        except OSError:
            pass
    return used


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cgroup_memory_limit(cgroup_root: Path = Path("/sys/fs/cgroup"),
                        self_cgroup: Path = Path("/proc/self/cgroup")) -> MemoryLimit | None:
    """The memory cgroup limit of this process, or None when there is none (or no cgroup fs)."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    candidates: list[Path] = []
    for line in lines:
        _id, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":                                   # v2: "0::/path"
            candidates += [cgroup_root / rel / "memory.max", cgroup_root / "memory.max"]
        elif "memory" in controllers.split(","):                # v1: "4:memory:/path"
            candidates += [cgroup_root / "memory" / rel / "memory.limit_in_bytes",
                           cgroup_root / "memory" / "memory.limit_in_bytes"]
    for file in candidates:
        try:
            raw = file.read_text().strip()
        except OSError:
            continue
        if raw == "max":
            return None
        value = int(raw)
        return MemoryLimit(value, f"cgroup {file}") if value < UNLIMITED else None
    return None


def resolve_memory_limit(configured_mb: int | None) -> MemoryLimit:
    """The smallest of the configured limit, the cgroup limit and physical memory."""
    options = [MemoryLimit(physical_memory_bytes(), "physical memory")]
    cgroup = cgroup_memory_limit()
    if cgroup is not None:
        options.append(cgroup)
    if configured_mb is not None:
        options.append(MemoryLimit(configured_mb << 20, "SLOTQ_MEMORY_LIMIT_MB"))
    return min(options, key=lambda m: m.bytes)
