"""The elastic worker's policy: how many slots to keep active and how far to degrade. Pure.

It sees :class:`Observation`s (memory against its limit, KV use, per-stream decode speed, jobs
running and waiting) and owns two numbers: ``target_slots`` (between ``min_slots`` and the
engine's ``n_seq_max``) and ``level`` (a :class:`Degradation`). It never touches the engine,
Redis or the clock: the worker feeds it and applies what it decides (``slotq.jobs.worker.elastic.loop``), so
tests drive it with hand-made observations, like the scheduler.

Each signal is in one of three states, with a gap between the marks (hysteresis), so a value
hovering near one threshold does not flap:

* **pressure** -- memory >= ``memory_high``; KV >= ``kv_high`` for ``kv_high_for_s``; per-stream
  decode speed < ``min_stream_tokens_per_s``;
* **clear** -- memory < ``memory_low``; KV < ``kv_low``; speed >= 1.25 x the floor (or nothing to
  measure);
* **hold** -- in between: nothing changes.

Under pressure, in this order, one step at a time:

1. fewer active slots (one per ``adapt_cooldown_s``) down to ``min_slots``; a running sequence is
   never stopped, its slot retires when it finishes;
2. at ``min_slots``, pressure held ``degrade_after_s`` takes the next degradation step: smaller
   batch and prefill chunk, then a ``max_tokens`` cap for new jobs, then refusing new jobs (they go
   back to the queue for another worker). A step is taken only for a signal it can relieve: slow
   decoding stops at the smaller batch, KV at the ``max_tokens`` cap, memory goes all the way.
   Memory at ``memory_refuse`` refuses new jobs at once, before memory runs out.

When the signals behind a step are clear for ``recover_after_s`` it is undone, one at a time;
with no step left, no signal under pressure or in hold, and jobs waiting while every active slot
is busy, a slot is added (one per ``adapt_cooldown_s``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from slotq.jobs.worker.elastic.knobs import ElasticKnobs

SPEED_CLEAR_MARGIN = 1.25


class Degradation(IntEnum):
    NONE = 0
    SMALL_BATCH = 1      # batch and prefill chunk x degraded_batch_fraction
    CAP_TOKENS = 2       # and max_tokens of new jobs capped at degraded_max_tokens
    REFUSE = 3           # and new jobs refused (handed back to the queue)

    @property
    def label(self) -> str:
        return self.name.lower()


class Signal(IntEnum):
    """Each signal and the deepest degradation step it may cause."""

    MEMORY = Degradation.REFUSE
    KV = Degradation.CAP_TOKENS
    DECODE_SPEED = Degradation.SMALL_BATCH


@dataclass(frozen=True)
class Observation:
    now: float                           # monotonic seconds
    memory_used_bytes: int
    memory_limit_bytes: int
    kv_ratio: float                      # KV cells held by running sequences / all cells
    stream_tokens_per_s: float | None    # decode speed of each stream since the last observation; None: none ran
    jobs_running: int                    # jobs this worker holds
    jobs_waiting: int | None             # jobs waiting in this worker's lanes; None: not read (reads_demand)

    @property
    def memory_ratio(self) -> float:
        return self.memory_used_bytes / self.memory_limit_bytes if self.memory_limit_bytes else 0.0


@dataclass(frozen=True)
class Change:
    """One decision, for the log and the metrics: ``kind`` is ``slots`` or ``degradation``;
    ``cause`` is the signal behind it (``memory``, ``kv``, ``decode_speed``), ``demand`` (jobs
    waiting) or ``clear`` (pressure gone)."""

    kind: str
    old: int
    new: int
    reason: str
    cause: str

    @property
    def worsening(self) -> bool:
        """Fewer slots or a deeper degradation step (logged as a warning)."""
        return self.new < self.old if self.kind == "slots" else self.new > self.old

    def describe(self) -> str:
        if self.kind == "slots":
            return f"active slots {self.old} -> {self.new}: {self.reason}"
        return f"degradation {Degradation(self.old).label} -> {Degradation(self.new).label}: {self.reason}"


@dataclass
class _Reading:
    pressure: dict[Signal, str]     # signal -> why it is under pressure
    clear: set[Signal]


class SlotController:
    def __init__(self, knobs: ElasticKnobs, max_slots: int) -> None:
        if not 1 <= knobs.min_slots <= max_slots:
            raise ValueError(f"min_slots ({knobs.min_slots}) must be between 1 and slots ({max_slots})")
        self.knobs = knobs
        self.max_slots = max_slots
        self.target_slots = max_slots
        self.level = Degradation.NONE
        self.pressure: dict[Signal, str] = {}      # the latest reading, for status and metrics
        self._last_slot_change = float("-inf")
        self._last_level_change = float("-inf")
        self._kv_high_since: float | None = None
        self._pressure_since: float | None = None
        self._clear_since: dict[Signal, float] = {}

    def reads_demand(self, jobs_running: int) -> bool:
        """Whether the next observation's ``jobs_waiting`` can change a decision: only growth on demand
        reads it, and that needs active slots below the maximum, every one busy, and no degradation step.
        The worker asks Redis for the queue's counts (two round trips) only then, not at every tick of
        every worker."""
        return (self.level == Degradation.NONE and self.target_slots < self.max_slots
                and jobs_running >= self.target_slots)

    # ------------------------------------------------------------------ one observation
    def observe(self, obs: Observation) -> list[Change]:
        reading = self._read(obs)
        self.pressure = reading.pressure
        now = obs.now
        self._pressure_since = (self._pressure_since or now) if reading.pressure else None
        for signal in Signal:
            if signal in reading.clear:
                self._clear_since.setdefault(signal, now)
            else:
                self._clear_since.pop(signal, None)

        if Signal.MEMORY in reading.pressure and obs.memory_ratio >= self.knobs.memory_refuse:
            return self._refuse_now(obs, reading)
        if reading.pressure:
            return self._under_pressure(obs, reading)
        return self._relieved(obs, reading)

    def _refuse_now(self, obs: Observation, reading: _Reading) -> list[Change]:
        changes = []
        why = (f"memory at {obs.memory_ratio:.0%} of {_gib(obs.memory_limit_bytes)} >= memory_refuse "
               f"{self.knobs.memory_refuse:.0%}")
        if self.target_slots != self.knobs.min_slots:
            changes.append(self._set_slots(self.knobs.min_slots, why, obs.now, "memory"))
        if self.level != Degradation.REFUSE:
            changes.append(self._set_level(Degradation.REFUSE, why, obs.now, "memory"))
        return changes

    def _under_pressure(self, obs: Observation, reading: _Reading) -> list[Change]:
        why = "; ".join(reading.pressure.values())
        strongest = max(reading.pressure)
        now = obs.now
        if self.target_slots > self.knobs.min_slots:
            if now - self._last_slot_change >= self.knobs.adapt_cooldown_s:
                return [self._set_slots(self.target_slots - 1, why, now, strongest.name.lower())]
            return []
        deepest = Degradation(strongest)          # the furthest any pressing signal may go
        assert self._pressure_since is not None
        held = now - max(self._pressure_since, self._last_level_change, self._last_slot_change)
        if self.level < deepest and held >= self.knobs.degrade_after_s:
            return [self._set_level(Degradation(self.level + 1), f"{why} (held {held:.0f} s at {self.target_slots} "
                                    f"active slots)", now, strongest.name.lower())]
        return self._maybe_recover(obs, reading)

    def _relieved(self, obs: Observation, reading: _Reading) -> list[Change]:
        changes = self._maybe_recover(obs, reading)
        if changes or self.level != Degradation.NONE:
            return changes
        all_clear = len(reading.clear) == len(Signal)
        busy = obs.jobs_running >= self.target_slots
        if (all_clear and busy and (obs.jobs_waiting or 0) > 0 and self.target_slots < self.max_slots
                and obs.now - self._last_slot_change >= self.knobs.adapt_cooldown_s):
            why = (f"{obs.jobs_waiting} jobs waiting, all {self.target_slots} active slots busy, memory "
                   f"{obs.memory_ratio:.0%}, KV {obs.kv_ratio:.0%}")
            return [self._set_slots(self.target_slots + 1, why, obs.now, "demand")]
        return []

    def _maybe_recover(self, obs: Observation, reading: _Reading) -> list[Change]:
        """Undo the current step once every signal that can reach it has been clear long enough."""
        if self.level == Degradation.NONE:
            return []
        relevant = [s for s in Signal if s >= self.level]
        if any(s not in reading.clear for s in relevant):
            return []
        clear_for = obs.now - max(max(self._clear_since[s] for s in relevant), self._last_level_change)
        if clear_for < self.knobs.recover_after_s:
            return []
        names = ", ".join(s.name.lower().replace("_", " ") for s in relevant)
        return [self._set_level(Degradation(self.level - 1), f"{names} clear for {clear_for:.0f} s", obs.now, "clear")]

    # ------------------------------------------------------------------ signals
    def _read(self, obs: Observation) -> _Reading:
        k = self.knobs
        pressure: dict[Signal, str] = {}
        clear: set[Signal] = set()

        mem = obs.memory_ratio
        if mem >= k.memory_high:
            pressure[Signal.MEMORY] = f"memory at {mem:.0%} of {_gib(obs.memory_limit_bytes)} >= {k.memory_high:.0%}"
        elif mem < k.memory_low:
            clear.add(Signal.MEMORY)

        if obs.kv_ratio >= k.kv_high:
            self._kv_high_since = obs.now if self._kv_high_since is None else self._kv_high_since
            if obs.now - self._kv_high_since >= k.kv_high_for_s:
                pressure[Signal.KV] = (f"KV cache at {obs.kv_ratio:.0%} >= {k.kv_high:.0%} for "
                                       f"{obs.now - self._kv_high_since:.0f} s")
        else:
            self._kv_high_since = None
            if obs.kv_ratio < k.kv_low:
                clear.add(Signal.KV)

        speed = obs.stream_tokens_per_s
        floor = k.min_stream_tokens_per_s
        if floor > 0 and speed is not None and speed < floor:
            pressure[Signal.DECODE_SPEED] = f"each stream decodes {speed:.1f} tokens/s < {floor:g}"
        elif floor == 0 or speed is None or speed >= floor * SPEED_CLEAR_MARGIN:
            clear.add(Signal.DECODE_SPEED)
        return _Reading(pressure, clear)

    # ------------------------------------------------------------------ changes
    def _set_slots(self, n: int, reason: str, now: float, cause: str) -> Change:
        change = Change("slots", self.target_slots, n, reason, cause)
        self.target_slots = n
        self._last_slot_change = now
        return change

    def _set_level(self, level: Degradation, reason: str, now: float, cause: str) -> Change:
        change = Change("degradation", self.level, level, reason, cause)
        self.level = level
        self._last_level_change = now
        return change


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
