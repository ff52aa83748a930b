"""The engine on both KV layouts (engine.config.KVLayout): which one ``auto`` picks, prefix reuse
across slots and n > 1 forks (cross-stream copies in the split layout) giving the greedy output of
a cold run, and the per-stream cap of the split layout refusing a sequence that cannot fit.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from slotq.engine import EngineConfig, KVLayout, PromptTooLong
from tests.support.engine import collect_choices, greedy, run_one, running_engine

PREFIX = " ".join("alpha beta gamma delta epsilon zeta eta theta iota kappa".split() * 8)[:300]


def test_auto_splits_when_every_slot_gets_its_full_context(tiny_model_path: Path) -> None:
    def layout(**kw: object) -> KVLayout:
        return EngineConfig(model_path=tiny_model_path, slots=8, ctx=256, **kw).resolved_kv_layout  # type: ignore[arg-type]

    assert layout() == KVLayout.SPLIT
    assert layout(kv_cells=8 * 256) == KVLayout.SPLIT          # no cells left for the cache slot: it is dropped
    assert EngineConfig(model_path=tiny_model_path, slots=8, ctx=256, kv_cells=8 * 256).kv_sequences == 8
    assert EngineConfig(model_path=tiny_model_path, slots=8, ctx=256).kv_sequences == 9
    assert layout(kv_cells=512) == KVLayout.UNIFIED            # a pool smaller than slots x ctx is shared
    assert layout(kv_cells=512, kv_layout="split") == KVLayout.SPLIT
    assert layout(kv_layout="unified") == KVLayout.UNIFIED


@pytest.mark.parametrize("layout", ["split", "unified"])
async def test_prefix_copied_from_a_running_slot_gives_the_cold_output(tiny_model_path: Path, layout: str) -> None:
    """B arrives while A (same 300-character prefix) is still generating: B's slot gets A's prefix
    as a KV copy (across streams in the split layout) and generates what a cold run generates."""
    exact = {"flash_attention": "off", "kv_type": "f32"}
    long_runner = greedy(PREFIX + " the first one runs long", 150)
    newcomer = greedy(PREFIX + " and a different ending", 40)
    async with running_engine(tiny_model_path, slots=4, ctx=512, prefix_cache=False, kv_layout=layout,
                              **exact) as engine:
        _, cold_tokens, _ = await run_one(engine, newcomer)
    async with running_engine(tiny_model_path, slots=4, ctx=512, kv_layout=layout, **exact) as engine:
        assert engine.info.kv_layout == layout
        first = engine.submit(long_runner)
        async for event in first:                   # A has its prompt in KV and is generating
            if event.kind == "text":
                break
        _, warm_tokens, fin = await run_one(engine, newcomer)
        first.cancel()
    assert fin[0].usage.cached_prompt_tokens >= 290
    assert warm_tokens == cold_tokens


@pytest.mark.parametrize("layout", ["split", "unified"])
async def test_n_greedy_forks_equal_separate_runs(tiny_model_path: Path, layout: str) -> None:
    request = greedy("one prompt, three greedy choices", 30, n=3)
    async with running_engine(tiny_model_path, slots=4, prefix_cache=False, kv_layout=layout) as engine:
        _, alone, _ = await run_one(engine, greedy("one prompt, three greedy choices", 30))
        choices, finished = await collect_choices(engine.submit(request))
        stats = engine.stats()
    assert sorted(f.choice for f in finished) == [0, 1, 2]
    assert [f.usage.cached_prompt_tokens > 0 for f in sorted(finished, key=lambda f: f.choice)] == [False, True, True]
    assert all(choices[c].token_ids == alone for c in range(3))
    assert stats.kv_full_events == 0


async def test_split_layout_caps_a_sequence_at_its_stream(tiny_model_path: Path) -> None:
    """Forced split with a pool smaller than slots x ctx: each slot owns kv_cells / slots cells,
    and a request that would outgrow its stream is refused at submit, naming the cause."""
    async with running_engine(tiny_model_path, slots=4, ctx=1024, kv_cells=1024, kv_layout="split") as engine:
        assert engine.info.n_ctx_seq == 256 and engine.ctx_per_seq == 256
        with pytest.raises(PromptTooLong, match="owns a KV stream of 256 cells"):
            engine.submit(greedy("too long for one stream", 300))
        _, tokens, fin = await run_one(engine, greedy("fits in one stream", 200))
    assert len(tokens) == 200 and fin[0].error is None


async def test_split_layout_runs_every_slot_at_full_context(tiny_model_path: Path) -> None:
    """Four sequences of nearly a whole stream each run together: no KV-full, no preemption."""
    async with running_engine(tiny_model_path, slots=4, ctx=256) as engine:
        assert engine.info.kv_layout == KVLayout.SPLIT
        results = await asyncio.gather(*(run_one(engine, greedy(f"stream {i}", 240)) for i in range(4)))
        stats = engine.stats()
    assert all(len(tokens) == 240 for _, tokens, _ in results)
    assert stats.kv_full_events == 0 and stats.preemptions == 0
    assert stats.kv_cells_total == (4 + 1) * 256      # one cache slot (EngineKnobs.cache_slots) by default


async def test_the_most_slots_llama_cpp_holds_start_with_no_cache_slot_left(tiny_model_path: Path) -> None:
    """256 slots are llama.cpp's limit (LLAMA_MAX_SEQ): the default cache slot must not ask for a 257th
    sequence, which llama.cpp refuses (a `--slots 256` worker failed to start)."""
    async with running_engine(tiny_model_path, slots=256, ctx=64) as engine:
        assert engine.info.n_seq_max == 256 and engine.config.usable_cache_slots == 0
        _, tokens, fin = await run_one(engine, greedy("the last slot", 8))
    assert len(tokens) == 8 and fin[0].error is None


@pytest.mark.parametrize("cache_slots", [1, 0])
async def test_a_handed_back_request_resumes_from_its_cells_in_a_cache_slot(tiny_model_path: Path,
                                                                             cache_slots: int) -> None:
    """As a worker hands a bulk job back for an interactive one: the bulk request is cancelled after
    some tokens, the interactive one runs, then the bulk one resumes with its delivered tokens. With
    a cache slot the interactive request takes the spare stream, the resumed one reuses its own
    cells (prompt + delivered, all but one token) and still generates what an uninterrupted run does."""
    exact = {"flash_attention": "off", "kv_type": "f32"}
    bulk = greedy(PREFIX + " a long bulk job", 60)
    async with running_engine(tiny_model_path, slots=2, cache_slots=cache_slots, ctx=512, **exact) as engine:
        assert engine.info.n_seq_max == 2 + cache_slots and engine.stats().slots_total == 2
        _, uninterrupted, _ = await run_one(engine, bulk)
        neighbour = engine.submit(greedy("the neighbour keeps its slot busy", 400))
        first, delivered = engine.submit(bulk), []
        async for event in first:
            delivered += getattr(event, "token_ids", [])
            if len(delivered) >= 10:
                break
        first.cancel()
        await run_one(engine, greedy("an interactive job", 8))
        _, rest, fin = await run_one(engine, greedy(PREFIX + " a long bulk job", 60, resume_tokens=delivered))
        neighbour.cancel()
    assert delivered + rest == uninterrupted
    cached = fin[0].usage.cached_prompt_tokens
    if cache_slots:
        assert cached >= 290 + len(delivered) - 1, cached
    else:
        assert cached < 290, cached
