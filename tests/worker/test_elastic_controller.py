"""Pure tests of the elastic slot controller and of reading memory limits: no model, no Redis.
Observations are made by hand; time is a number the test advances."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from slotq.jobs.worker.elastic.controller import Degradation, Observation, SlotController
from slotq.jobs.worker.elastic.knobs import ElasticKnobs
from slotq.jobs.worker.elastic.memory import cgroup_memory_limit, process_rss_bytes, resolve_memory_limit

MIB = 1 << 20
LIMIT = 1000 * MIB


def knobs(**kw: object) -> ElasticKnobs:
    base: dict[str, object] = {"min_slots": 1, "adapt_cooldown_s": 2, "kv_high_for_s": 5, "degrade_after_s": 5,
                               "recover_after_s": 5, "min_stream_tokens_per_s": 2.0}
    return ElasticKnobs(**(base | kw))


def obs(now: float, *, mem: float = 0.5, kv: float = 0.1, speed: float | None = 20.0, running: int = 0,
        waiting: int | None = 0) -> Observation:
    return Observation(now=now, memory_used_bytes=int(mem * LIMIT), memory_limit_bytes=LIMIT, kv_ratio=kv,
                       stream_tokens_per_s=speed, jobs_running=running, jobs_waiting=waiting)


def run(c: SlotController, start: float, end: float, step: float = 1.0, **kw: object) -> list[str]:
    """Observe the same conditions every ``step`` seconds; the changes' descriptions."""
    out = []
    t = start
    while t <= end:
        out += [ch.describe() for ch in c.observe(obs(t, **kw))]    # type: ignore[arg-type]
        t += step
    return out


def test_memory_pressure_shrinks_one_slot_per_cooldown_down_to_the_minimum() -> None:
    c = SlotController(knobs(min_slots=2), max_slots=6)
    changes = run(c, 0, 20, mem=0.85, running=6)
    slot_changes = [ch for ch in changes if ch.startswith("active slots")]
    assert slot_changes[0].startswith("active slots 6 -> 5: memory at 85% of 0.98 GiB >= 80%")
    assert [ch.split(":")[0] for ch in slot_changes] == [f"active slots {n} -> {n - 1}" for n in (6, 5, 4, 3)]
    assert c.target_slots == 2


def test_hysteresis_between_the_marks_nothing_moves() -> None:
    c = SlotController(knobs(), max_slots=4)
    run(c, 0, 10, mem=0.85)
    shrunk = c.target_slots
    assert shrunk < 4
    assert run(c, 11, 60, mem=0.75, running=shrunk, waiting=10) == []      # 0.70 <= 0.75 < 0.80: hold
    assert c.target_slots == shrunk


def test_grows_back_when_jobs_wait_and_every_active_slot_is_busy() -> None:
    c = SlotController(knobs(), max_slots=4)
    run(c, 0, 20, mem=0.85)
    assert c.target_slots == 1 and c.level > Degradation.NONE
    run(c, 21, 60, mem=0.3)                                       # pressure gone: steps undone first
    assert c.level == Degradation.NONE and c.target_slots == 1
    assert run(c, 61, 70, mem=0.3, running=1, waiting=0) == []        # nothing waiting: no growth
    assert run(c, 71, 80, mem=0.3, running=0, waiting=5) == []        # slots not busy: no growth
    grew = run(c, 81, 100, mem=0.3, running=4, waiting=5)
    assert grew[0].startswith("active slots 1 -> 2: 5 jobs waiting, all 1 active slots busy")
    assert c.target_slots == 4 and len(grew) == 3                  # one per cooldown, up to n_seq_max


def test_the_queue_is_asked_what_waits_only_when_growth_could_follow() -> None:
    """The worker reads the queue's counts (two round trips) only when the controller could grow on them:
    below its maximum, every active slot busy, no degradation step; not at every tick of every worker."""
    c = SlotController(knobs(), max_slots=4)
    assert not c.reads_demand(4)                                  # at its maximum: nothing to grow
    run(c, 0, 20, mem=0.85)
    assert c.target_slots == 1 and c.level > Degradation.NONE
    assert not c.reads_demand(1)                                  # degraded: recovery comes first
    run(c, 21, 60, mem=0.3)
    assert c.level == Degradation.NONE
    assert not c.reads_demand(0) and c.reads_demand(1)            # free slots: no demand to read
    assert c.observe(obs(61, mem=0.3, running=1, waiting=None)) == []   # None (not read) is no demand


def test_degradation_steps_in_order_under_sustained_memory_pressure_and_back() -> None:
    c = SlotController(knobs(min_slots=1), max_slots=2)
    levels = []
    for t in range(40):
        for ch in c.observe(obs(t, mem=0.85)):
            levels.append((t, ch.kind, ch.new))
    assert [(k, n) for _, k, n in levels] == [("slots", 1), ("degradation", 1), ("degradation", 2), ("degradation", 3)]
    times = [t for t, _, _ in levels]
    assert times[1] - times[0] >= 5 and times[2] - times[1] >= 5     # each held degrade_after_s
    down = run(c, 40, 80, mem=0.3)
    assert [d.split(":")[0] for d in down] == ["degradation refuse -> cap_tokens",
                                               "degradation cap_tokens -> small_batch",
                                               "degradation small_batch -> none"]
    assert "memory clear for" in down[0]


def test_memory_at_the_refuse_mark_refuses_at_once() -> None:
    c = SlotController(knobs(), max_slots=8)
    changes = c.observe(obs(0, mem=0.95, running=8))
    assert [(ch.kind, ch.new) for ch in changes] == [("slots", 1), ("degradation", Degradation.REFUSE)]
    assert "memory_refuse 92%" in changes[1].reason


def test_each_signal_degrades_only_as_far_as_it_helps() -> None:
    kv = SlotController(knobs(), max_slots=1)
    run(kv, 0, 60, kv=0.95)
    assert kv.level == Degradation.CAP_TOKENS           # a max_tokens cap relieves KV; refusing would not
    slow = SlotController(knobs(), max_slots=1)
    run(slow, 0, 60, speed=0.5)
    assert slow.level == Degradation.SMALL_BATCH        # smaller prefill chunks speed decoding up


def test_kv_counts_only_when_it_stays_high() -> None:
    c = SlotController(knobs(kv_high_for_s=5), max_slots=4)
    assert run(c, 0, 4, kv=0.95) == []                  # high for 4 s: not yet
    assert run(c, 5, 5, kv=0.95)[0].startswith("active slots 4 -> 3: KV cache at 95% >= 90% for 5 s")
    c2 = SlotController(knobs(kv_high_for_s=5), max_slots=4)
    for t in range(20):
        assert c2.observe(obs(t, kv=0.95 if t % 4 else 0.5)) == []        # dips reset the clock


def test_slow_streams_shrink_and_unmeasured_speed_is_no_signal() -> None:
    c = SlotController(knobs(min_stream_tokens_per_s=2.0), max_slots=4)
    assert run(c, 0, 0, speed=1.5)[0].endswith("each stream decodes 1.5 tokens/s < 2")
    assert run(c, 10, 30, speed=None, running=3, waiting=3) != []          # nothing generating: may grow
    off = SlotController(knobs(min_stream_tokens_per_s=0), max_slots=4)
    assert run(off, 0, 30, speed=0.1) == []


def test_recovery_waits_for_every_signal_that_reaches_the_step() -> None:
    c = SlotController(knobs(), max_slots=1)
    run(c, 0, 30, mem=0.85, kv=0.95)
    assert c.level == Degradation.REFUSE
    run(c, 31, 60, mem=0.3, kv=0.95)            # memory clear, KV still high: refuse is undone, the cap stays
    assert c.level == Degradation.CAP_TOKENS


def test_settings_bounds() -> None:
    with pytest.raises(ValueError, match="memory_low"):
        ElasticKnobs(memory_low=0.9, memory_high=0.8)
    with pytest.raises(ValueError, match="min_slots"):
        SlotController(knobs(min_slots=5), max_slots=4)
    from slotq.jobs.worker.settings import WorkerSettings
    with pytest.raises(ValueError, match=r"min_slots \(9\) must be <= slots \(8\)"):
        WorkerSettings(min_slots=9, slots=8)


def test_observation_ratio() -> None:
    o = obs(0, mem=0.5)
    assert o.memory_ratio == pytest.approx(0.5)
    assert replace(o, memory_limit_bytes=0).memory_ratio == 0.0


# ---------------------------------------------------------------------- memory limits
def test_cgroup_v2_limit(tmp_path: Path) -> None:
    (tmp_path / "kubepods" / "pod1").mkdir(parents=True)
    (tmp_path / "kubepods" / "pod1" / "memory.max").write_text("2147483648\n")
    (tmp_path / "self").write_text("0::/kubepods/pod1\n")
    limit = cgroup_memory_limit(tmp_path, tmp_path / "self")
    assert limit is not None and limit.bytes == 2 << 30 and "memory.max" in limit.source
    (tmp_path / "kubepods" / "pod1" / "memory.max").write_text("max\n")
    assert cgroup_memory_limit(tmp_path, tmp_path / "self") is None


def test_cgroup_v1_limit_and_namespace_root(tmp_path: Path) -> None:
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("1073741824\n")
    (tmp_path / "self").write_text("5:cpu,cpuacct:/x\n4:memory:/docker/abc\n")   # path hidden by the namespace
    limit = cgroup_memory_limit(tmp_path, tmp_path / "self")
    assert limit is not None and limit.bytes == 1 << 30
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup_memory_limit(tmp_path, tmp_path / "self") is None          # "no limit"


def test_limit_is_the_smallest_and_rss_is_real() -> None:
    assert resolve_memory_limit(64).bytes == 64 * MIB
    assert resolve_memory_limit(64).source == "SLOTQ_MEMORY_LIMIT_MB"
    assert resolve_memory_limit(None).bytes >= 64 * MIB

    def growth_with_ballast() -> int:
        before = process_rss_bytes()
        ballast = b"\x01" * (64 * MIB)
        grown = process_rss_bytes() - before
        del ballast
        return grown

    # other threads of a test process (an engine an earlier test closed) may free memory meanwhile: in
    # two test processes one try saw 39 MiB of the 64
    assert any(growth_with_ballast() >= 60 * MIB for _ in range(5))


# ---------------------------------------------------------------------- what a job gets
def test_verdicts_per_degradation_step() -> None:
    from slotq.jobs.worker.elastic.admission import RUN_AS_ASKED, WORKER_OVERLOADED, verdict

    def v(level: Degradation, max_tokens: int = 512, resuming: bool = False):
        return verdict(level, max_tokens=max_tokens, resuming=resuming, cap_tokens=128, worker_id="w1",
                       why="memory at 93%")

    assert v(Degradation.NONE) is RUN_AS_ASKED and v(Degradation.SMALL_BATCH) is RUN_AS_ASKED
    capped = v(Degradation.CAP_TOKENS)
    assert capped.cap is not None and (capped.cap.requested, capped.cap.applied) == (512, 128)
    assert "memory at 93%" in capped.cap.reason
    assert v(Degradation.CAP_TOKENS, max_tokens=100) is RUN_AS_ASKED           # already under the cap
    refused = v(Degradation.REFUSE)
    assert refused.refuse is not None and refused.refuse.code == WORKER_OVERLOADED and refused.refuse.retryable
    assert "back to the queue" in refused.refuse.message
    assert v(Degradation.REFUSE, resuming=True) is RUN_AS_ASKED                # a started job is finished
