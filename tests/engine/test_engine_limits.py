"""The engine's runtime limits and warm-up, on the tiny model: set_limits caps the sequences that
hold a slot without stopping running ones; warm_up runs one real decode."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.support.engine import collect, greedy, running_engine


async def test_active_slot_cap_holds_and_running_sequences_finish(tiny_model_path: Path) -> None:
    async with running_engine(tiny_model_path, slots=4) as engine:
        handles = [engine.submit(greedy(f"seq {i}", 400)) for i in range(2)]
        while engine.stats().slots_busy < 2:
            await asyncio.sleep(0.001)
        applied = engine.set_limits(active_slots=1, n_batch=64, prefill_chunk=16)
        assert (applied.active_slots, applied.n_batch, applied.prefill_chunk) == (1, 64, 16)
        handles += [engine.submit(greedy(f"late {i}", 50)) for i in range(3)]
        busy: list[int] = []

        async def watch() -> None:
            while True:
                stats = engine.stats()
                if stats.slots_active == 1:
                    busy.append(stats.slots_busy)
                await asyncio.sleep(0.001)

        watcher = asyncio.create_task(watch())
        results = await asyncio.gather(*(collect(h) for h in handles))
        watcher.cancel()
        assert [len(tokens) for _, tokens, _ in results] == [400, 400, 50, 50, 50]   # nobody was stopped
        assert busy[0] == 2                        # the two running ones kept their slots...
        tail = busy[busy.index(1):] if 1 in busy else []
        assert tail and max(tail) == 1             # ...and once down to the cap, never above it
        stats = engine.stats()
        assert (stats.slots_active, stats.batch_limit, stats.prefill_chunk_limit) == (1, 64, 16)
        assert stats.generating_steps > 0 and stats.generating_seconds > 0
        full = engine.set_limits(active_slots=99, n_batch=10**6, prefill_chunk=10**6)
        assert full == engine.full_limits


async def test_warm_up_runs_one_real_decode(tiny_model_path: Path) -> None:
    async with running_engine(tiny_model_path, slots=2) as engine:
        seconds = await engine.warm_up()
        stats = engine.stats()
        assert seconds > 0 and stats.decode_steps >= 1 and stats.generated_tokens == 1
        assert stats.finished == {"length": 1}
