"""A failing engine is a state, one bad request fails alone, and stats are a consistent snapshot.

Faults come from the engine's own fault-injection hooks (``slotq.engine.fault_injection``), set through
the environment as a test of the whole system would, on the real engine with the tiny model.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from pydantic import ValidationError

from slotq.engine import EngineDead, EngineState, Finished, FinishReason, TextDelta
from slotq.engine.fault_injection import ADMISSION_MARKER, CRASH_AFTER_STEPS, EngineFaults, InjectedFault
from slotq.engine.state import Lifecycle
from tests.support.engine import collect, greedy, run_one, running_engine

# Far enough that all three requests below are submitted before the crash even on a loaded machine
# (the engine thread runs while the test submits).
CRASH_STEP = 200


# ----------------------------------------------------------------------------- the engine thread dies
async def test_engine_crash_ends_every_request_with_engine_dead_and_refuses_new_ones(
        tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CRASH_AFTER_STEPS, str(CRASH_STEP))
    async with running_engine(tiny_model_path, slots=2, ctx=1100) as engine:
        watcher = asyncio.create_task(engine.wait_failed())

        async def consume(handle) -> tuple[int, list[Finished]]:
            n_tokens, finished = 0, []
            async for event in handle:
                if isinstance(event, TextDelta):
                    n_tokens += len(event.token_ids)
                else:
                    finished.append(event)
            return n_tokens, finished

        # Two run, one waits for a slot; none can finish its 1000 tokens before the crash.
        handles = [engine.submit(greedy(f"doomed {i}", 1000)) for i in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*(consume(h) for h in handles)), 30)
        failure = await asyncio.wait_for(watcher, 5)

        assert isinstance(failure, InjectedFault)
        assert engine.state == EngineState.FAILED and engine.failure is failure
        for n_tokens, finished in results:
            assert len(finished) == 1, finished
            fin = finished[0]
            assert fin.finish_reason == FinishReason.ERROR and fin.error is not None
            assert fin.error.code == "engine_dead" and fin.error.retryable
            assert "crashed" in fin.error.message and "InjectedFault" in fin.error.message
            assert n_tokens <= CRASH_STEP          # at most one token per step (the first comes with the prompt)
        assert sum(n for n, _ in results) > 0                       # it did die mid-generation

        with pytest.raises(EngineDead) as info:
            engine.submit(greedy("too late", 5))
        assert info.value.code == "engine_dead" and info.value.retryable
        with pytest.raises(EngineDead):
            await engine.submit_async(greedy("too late", 5))
        assert await asyncio.wait_for(engine.wait_failed(), 1) is failure      # already failed: at once
        stats = engine.stats()
        assert stats.finished == {"error": 3} and stats.slots_busy == 0 and stats.waiting == 0
        await asyncio.wait_for(engine.close(), 10)          # after a failure: works, does not hang
        assert engine.state == EngineState.FAILED          # closing does not hide the failure


async def test_requests_racing_the_crash_never_hang(tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Submitted while the engine dies (some still in its command queue, some after): each one
    either is refused at once or ends with engine_dead."""
    monkeypatch.setenv(CRASH_AFTER_STEPS, "1")
    async with running_engine(tiny_model_path, slots=2) as engine:
        handles, refused = [], 0
        for i in range(40):
            try:
                handles.append(engine.submit(greedy(f"racer {i}", 50, n=1 + i % 2)))
            except EngineDead:
                refused += 1
            if i % 10 == 9:
                await asyncio.sleep(0.005)
        results = await asyncio.wait_for(asyncio.gather(*(collect(h) for h in handles)), 30)
        await asyncio.wait_for(engine.wait_failed(), 5)
    assert len(handles) + refused == 40 and handles
    for handle, (_, _, fin) in zip(handles, results):
        assert len(fin) == handle.request.n
        assert all(f.error is not None and f.error.code == "engine_dead" for f in fin)


async def test_a_clean_close_is_not_a_failure(tiny_model_path: Path) -> None:
    async with running_engine(tiny_model_path, slots=1) as engine:
        watcher = asyncio.create_task(engine.wait_failed())
        _, _, fin = await run_one(engine, greedy("fine", 5))
        assert fin[0].finish_reason == FinishReason.LENGTH
    await asyncio.sleep(0.2)
    assert not watcher.done() and engine.state == EngineState.CLOSED and engine.failure is None
    watcher.cancel()


# ----------------------------------------------------------------------------- one request fails alone
async def test_unexpected_error_admitting_one_request_fails_only_that_request(
        tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADMISSION_MARKER, "BOOM")
    async with running_engine(tiny_model_path, slots=4) as engine:
        good = [greedy(f"fine {i}", 20 + i) for i in range(3)]
        bad = greedy("this one goes BOOM", 20)
        bad_n2 = greedy("BOOM twice", 20, n=2)
        results = await asyncio.gather(*(run_one(engine, r) for r in [good[0], bad, good[1], bad_n2, good[2]]))
        for request, (_, tokens, fin) in zip(good, [results[0], results[2], results[4]]):
            assert fin[0].finish_reason == FinishReason.LENGTH and len(tokens) == request.max_tokens
        for _, tokens, fin in (results[1], results[3]):
            assert tokens == [] and {f.choice for f in fin} == set(range(len(fin)))
            for f in fin:
                assert f.finish_reason == FinishReason.ERROR and f.error is not None
                assert f.error.code == "request_failed" and f.error.retryable
                assert "InjectedFault" in f.error.message and "admitting" in f.error.message
        assert len(results[3][2]) == 2
        assert engine.state == EngineState.RUNNING
        _, tokens, fin = await run_one(engine, greedy("still serving", 7))
        assert fin[0].finish_reason == FinishReason.LENGTH and len(tokens) == 7
        stats = engine.stats()
    assert stats.finished == {"length": 4, "error": 3} and stats.slots_busy == 0


async def test_a_request_whose_event_loop_closed_is_cancelled_and_the_engine_lives(tiny_model_path: Path) -> None:
    """Its events cannot be delivered (call_soon_threadsafe on a closed loop raises): the engine
    cancels it and frees its slot instead of dying or generating for nobody."""
    async with running_engine(tiny_model_path, slots=1) as engine:
        def submit_from_a_loop_that_ends() -> None:
            async def submit() -> None:
                engine.submit(greedy("orphan", 400))
            asyncio.run(submit())

        await asyncio.to_thread(submit_from_a_loop_that_ends)
        for _ in range(3000):
            if engine.stats().finished.get("cancelled") == 1:
                break
            await asyncio.sleep(0.01)
        stats = engine.stats()
        assert stats.finished == {"cancelled": 1} and stats.generated_tokens < 400
        _, tokens, fin = await run_one(engine, greedy("next", 5))
    assert fin[0].finish_reason == FinishReason.LENGTH and len(tokens) == 5


# ----------------------------------------------------------------------------- stats snapshot
async def test_stats_read_in_a_tight_loop_are_always_consistent(tiny_model_path: Path) -> None:
    slots = 4
    requests = [greedy(f"load {i} " + "x" * (i * 7 % 50), 5 + (i * 13) % 60) for i in range(24)]
    received = {"tokens": 0, "finished": 0}
    done = asyncio.Event()

    async def consume(handle) -> None:
        async for event in handle:
            if isinstance(event, TextDelta):
                received["tokens"] += len(event.token_ids)
            else:
                received["finished"] += 1

    async with running_engine(tiny_model_path, slots=slots, ctx=256) as engine:
        reads = 0
        last = engine.stats()

        async def read_stats() -> None:
            nonlocal reads, last
            while not done.is_set():
                s = engine.stats()
                reads += 1
                assert s.slots_total == slots and 0 <= s.slots_busy <= slots and s.waiting >= 0
                assert 0 <= s.kv_cells_used <= s.kv_cells_total
                assert 0.0 <= s.avg_busy_slots_per_decode <= slots
                # Monotonic counters never go back.
                for name in ("decode_steps", "generated_tokens", "prompt_tokens_processed", "decode_seconds"):
                    assert getattr(s, name) >= getattr(last, name), name
                assert sum(s.finished.values()) >= sum(last.finished.values())
                # Published before the events leave the engine thread: what we received is counted.
                assert s.generated_tokens >= received["tokens"]
                assert sum(s.finished.values()) >= received["finished"]
                last = s
                await asyncio.sleep(0)

        reader = asyncio.create_task(read_stats())
        handles = [engine.submit(r) for r in requests]
        await asyncio.gather(*(consume(h) for h in handles))
        final = engine.stats()          # right after the last event: it is already in the snapshot
        done.set()
        await reader

        snapshot = engine._runner.stats
        with pytest.raises(ValidationError, match="frozen"):
            snapshot.slots_busy = 99      # type: ignore[misc]
        mine = engine.stats()
        mine.finished["tampered"] = 1
        assert "tampered" not in engine.stats().finished

    assert reads > 20
    assert final.finished == {"length": len(requests)} and final.slots_busy == 0 and final.waiting == 0
    assert final.generated_tokens == received["tokens"] == sum(r.max_tokens for r in requests)


# ----------------------------------------------------------------------------- pure parts
def test_fault_hooks_are_off_unless_set_and_reject_bad_values() -> None:
    assert not EngineFaults.from_env({}).armed
    assert EngineFaults.from_env({CRASH_AFTER_STEPS: "", ADMISSION_MARKER: ""}) == EngineFaults()
    faults = EngineFaults.from_env({CRASH_AFTER_STEPS: "3"})
    faults.after_decode_step(2)
    with pytest.raises(InjectedFault):
        faults.after_decode_step(3)
    for bad in ("0", "-1", "soon"):
        with pytest.raises(ValueError, match=CRASH_AFTER_STEPS):
            EngineFaults.from_env({CRASH_AFTER_STEPS: bad})


async def test_lifecycle_wakes_every_waiter_once_and_forgets_cancelled_ones() -> None:
    life = Lifecycle()
    waiters = [asyncio.create_task(life.wait_failed()) for _ in range(3)]
    await asyncio.sleep(0)
    waiters[0].cancel()
    await asyncio.sleep(0)
    assert len(life._waiters) == 2
    boom = RuntimeError("boom")
    await asyncio.to_thread(life.fail, boom)         # from another thread, as the engine thread does
    assert await asyncio.wait_for(asyncio.gather(*waiters[1:]), 5) == [boom, boom]
    life.fail(RuntimeError("second"))                # the first failure is the one reported
    life.close()                                     # FAILED is final
    assert life.state == EngineState.FAILED and life.failure is boom
    with pytest.raises(EngineDead, match="RuntimeError: boom"):
        life.raise_unless_running()
