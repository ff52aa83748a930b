"""The engine end to end on real llama.cpp with the tiny random-weight model (no mocks).

The tiny model's vocabulary is byte level: every token renders at most one character, so text
offsets and token counts line up, and a 2-character stop string always spans two tokens. Its output
is random-looking bytes; expectations are therefore never hard-coded but derived from a reference
run (alone, without cache, without stop strings) of the same deterministic greedy model.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from pathlib import Path

import pytest

from slotq.engine import (
    BatchingMode,
    Finished,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    TextDelta,
)
from tests.support.engine import collect, collect_choices, greedy, run_one, running_engine

# Eight prompts of different lengths with different output lengths.
MIXED = [
    ("hello world", 60), ("the quick brown fox jumps", 33), ("a", 90), ("lorem ipsum dolor sit amet, consectetur", 17),
    ("zz top", 120), ("Mississippi river", 45), ("0123456789", 75), ("xyzzy plugh", 100),
]


async def wait_for(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)


class EventLog:
    """Consumes several handles concurrently and records, in one list, the order in which their
    events arrive (the engine thread emits them in step order, and the event loop delivers them
    in that order)."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, str, object]] = []
        self.progress: dict[str, int] = defaultdict(int)
        self.finished: dict[str, Finished] = {}
        self.tokens: dict[str, list[int]] = defaultdict(list)

    async def consume(self, name: str, handle) -> None:
        async for ev in handle:
            if isinstance(ev, TextDelta):
                self.progress[name] += len(ev.token_ids)
                self.tokens[name].extend(ev.token_ids)
                self.entries.append((name, "delta", self.progress[name]))
            else:
                self.finished[name] = ev
                self.entries.append((name, "finished", ev.finish_reason))

    def index(self, name: str, kind: str) -> int:
        return next(i for i, (n, k, _) in enumerate(self.entries) if n == name and k == kind)


# ----------------------------------------------------------------------------- batching invariance
async def test_greedy_output_is_identical_alone_and_batched(tiny_model_path: Path) -> None:
    async with running_engine(tiny_model_path, slots=8) as engine:
        alone = [await run_one(engine, greedy(p, n)) for p, n in MIXED]
    async with running_engine(tiny_model_path, slots=8) as engine:
        batched = await asyncio.gather(*(run_one(engine, greedy(p, n)) for p, n in MIXED))
        stats = engine.stats()
    # They really shared decode batches (one after another would be 1.0). Not more: with a KV stream
    # per slot a step is so short that the engine may run a few dozen before the event loop has
    # submitted the last request (seen: 3.0, where all eight admitted together give about 4.4).
    assert stats.avg_busy_slots_per_decode > 2
    assert stats.decode_steps < sum(n for _, n in MIXED) / 2
    for (prompt, n), (a_text, a_tokens, a_fin), (b_text, b_tokens, b_fin) in zip(MIXED, alone, batched):
        assert len(a_tokens) == n and a_fin[0].finish_reason == FinishReason.LENGTH
        assert b_tokens == a_tokens, f"{prompt!r}: batched output differs from the output alone"
        assert b_text == a_text
        assert b_fin[0].usage.completion_tokens == n
    assert len({tuple(t) for _, t, _ in alone}) == len(MIXED)      # the model is not degenerate


# ----------------------------------------------------------------------------- continuous vs static
async def test_late_request_starts_while_others_generate(tiny_model_path: Path) -> None:
    log = EventLog()
    async with running_engine(tiny_model_path, slots=4, ctx=1024) as engine:
        others = {f"o{i}": engine.submit(greedy(f"long request {i}", 600)) for i in range(3)}
        tasks = [asyncio.create_task(log.consume(name, h)) for name, h in others.items()]
        await wait_for(lambda: all(log.progress[n] >= 10 for n in others), what="the others to be generating")
        assert all(log.progress[n] < 600 for n in others)
        late = engine.submit(greedy("late", 8))
        tasks.append(asyncio.create_task(log.consume("late", late)))
        await asyncio.gather(*tasks)
        stats = engine.stats()
    first_late = log.index("late", "delta")
    for name in others:
        assert first_late < log.index(name, "finished"), "the late request waited for the running batch"
        assert log.finished[name].finish_reason == FinishReason.LENGTH and log.progress[name] == 600
    # The late request finished long before the others: it ran inside their batch.
    assert log.index("late", "finished") < min(log.index(n, "finished") for n in others)
    assert stats.generated_tokens == 3 * 600 + 8
    assert stats.decode_steps < 0.4 * stats.generated_tokens


async def test_static_mode_late_request_waits_for_the_batch(tiny_model_path: Path) -> None:
    log = EventLog()
    async with running_engine(tiny_model_path, slots=4, ctx=1024, batching=BatchingMode.STATIC) as engine:
        # One request with n=3: its three sequences are queued atomically, so they form one batch.
        batch = engine.submit(greedy("long request", 600, n=3))
        task = asyncio.create_task(log.consume("batch", batch))
        await wait_for(lambda: log.progress["batch"] >= 30, what="the batch to be generating")
        assert engine.stats().slots_busy == 3
        late = engine.submit(greedy("late", 8))
        await wait_for(lambda: engine.stats().waiting == 1, what="the late request to be queued")
        assert engine.stats().slots_busy == 3              # a free slot, but static mode does not use it
        await asyncio.gather(task, log.consume("late", late))
    assert log.progress["batch"] == 3 * 600
    last_batch_finish = max(i for i, (n, k, _) in enumerate(log.entries) if n == "batch" and k == "finished")
    assert log.index("late", "delta") > last_batch_finish, "static mode admitted into a running batch"


# ----------------------------------------------------------------------------- cancellation
async def test_cancel_mid_generation_frees_the_slot_others_continue(tiny_model_path: Path) -> None:
    prompts = [f"cancel test {i}" for i in range(4)]
    async with running_engine(tiny_model_path, slots=4) as engine:
        reference = await asyncio.gather(*(run_one(engine, greedy(p, 300)) for p in prompts[1:]))
    log = EventLog()
    async with running_engine(tiny_model_path, slots=4) as engine:
        handles = {f"r{i}": engine.submit(greedy(p, 300)) for i, p in enumerate(prompts)}
        tasks = [asyncio.create_task(log.consume(n, h)) for n, h in handles.items()]
        # Every request generating (the submits race the engine thread, which may start r0 first).
        await wait_for(lambda: all(log.progress[n] >= 10 for n in handles), what="every request to generate")
        assert engine.stats().slots_busy == 4
        handles["r0"].cancel()
        await tasks[0]
        fin = log.finished["r0"]
        assert fin.finish_reason == FinishReason.CANCELLED
        assert 10 <= fin.usage.completion_tokens < 300
        assert engine.stats().slots_busy <= 3
        # The freed slot is usable at once: a new request starts while the others still run.
        tasks.append(asyncio.create_task(log.consume("new", engine.submit(greedy("new one", 5)))))
        await asyncio.gather(*tasks)
        stats = engine.stats()
    for i, (_, ref_tokens, _) in enumerate(reference, start=1):
        name = f"r{i}"
        assert log.finished[name].finish_reason == FinishReason.LENGTH
        assert log.tokens[name] == ref_tokens                  # unaffected by the cancellation
        assert log.index("new", "delta") < log.index(name, "finished")
    assert stats.slots_busy == 0 and stats.waiting == 0
    assert stats.finished == {"cancelled": 1, "length": 4}


async def test_leaving_the_iteration_cancels_and_waiting_requests_cancel(tiny_model_path: Path) -> None:
    # Long enough (several hundred ms of decoding) that the cancellation always arrives first.
    async with running_engine(tiny_model_path, slots=1, ctx=4096) as engine:
        running = engine.submit(greedy("first", 4000))
        queued = engine.submit(greedy("second", 400))
        n = 0
        async for _ in running:
            n += 1
            if n == 5:
                break                                          # abandons the handle
        queued.cancel()                                        # still waiting for the only slot
        text, tokens, fin = await collect(queued)
        assert fin[0].finish_reason == FinishReason.CANCELLED and tokens == []
        await wait_for(lambda: engine.stats().finished.get("cancelled", 0) == 2, timeout=10,
                       what="the abandoned request to be cancelled")
        assert engine.stats().slots_busy == 0
        assert engine.stats().generated_tokens < 4000


# ----------------------------------------------------------------------------- stop strings, length, eos
STOP_PROMPTS = ["hello world", "stop here", "abc", "zz top", "the quick brown fox", "xyz", "Mississippi"]


def _first_two_char_window(text: str, start: int = 3) -> str | None:
    for i in range(start, len(text) - 1):
        w = text[i:i + 2]
        if all(c.isascii() and c.isprintable() and not c.isspace() for c in w):
            return w
    return None


async def test_stop_string_spanning_two_tokens(tiny_model_path: Path) -> None:
    async with running_engine(tiny_model_path, slots=4) as engine:
        found = None
        for prompt in STOP_PROMPTS:
            ref_text, ref_tokens, _ = await run_one(engine, greedy(prompt, 80))
            stop = _first_two_char_window(ref_text)
            if stop is not None:
                found = prompt, stop, ref_text, ref_tokens
                break
        assert found, "no printable 2-character window in any greedy output"
        prompt, stop, ref_text, ref_tokens = found
        cut = ref_text.find(stop)
        text, tokens, fin = await run_one(engine, greedy(prompt, 80, stop=[stop]))
        assert fin[0].finish_reason == FinishReason.STOP and fin[0].stop_sequence == stop
        assert text == ref_text[:cut]
        assert stop not in text
        assert tokens == ref_tokens[: len(tokens)]            # generation stopped right at the stop
        assert len(tokens) < 80
        # The stop string really spans two tokens: the last one carries only its tail.
        last = engine.model.token_bytes(tokens[-1])
        assert 0 < len(last) < len(stop.encode()) and stop.encode().endswith(last)

        # Several stops: the one that appears first wins.
        later = ref_text[cut + 4: cut + 6]
        if len(later) == 2 and later not in ref_text[: cut + 2]:
            text2, _, fin2 = await run_one(engine, greedy(prompt, 80, stop=[later, stop]))
            assert text2 == ref_text[:cut] and fin2[0].finish_reason == FinishReason.STOP
            assert fin2[0].stop_sequence == stop                    # the Finished event names the one that matched


async def test_partial_stop_match_at_the_end_is_released(tiny_model_path: Path) -> None:
    async with running_engine(tiny_model_path, slots=2) as engine:
        ref_text, ref_tokens, _ = await run_one(engine, greedy("partial", 40))
        tail = ref_text[-1]
        unused = next(c for c in "#$%&@^~|" if c not in ref_text)
        text, tokens, fin = await run_one(engine, greedy("partial", 40, stop=[tail + unused]))
    assert fin[0].finish_reason == FinishReason.LENGTH
    assert text == ref_text                                     # the held last character came out
    assert tokens == ref_tokens


async def test_max_tokens_gives_length(tiny_model_path: Path) -> None:
    async with running_engine(tiny_model_path, slots=2) as engine:
        handle = engine.submit(greedy("count", 13))
        deltas = [ev async for ev in handle if isinstance(ev, TextDelta)]
    (fin,) = handle.finished
    assert fin.finish_reason == FinishReason.LENGTH
    assert fin.usage.completion_tokens == 13
    assert sum(len(d.token_ids) for d in deltas) == 13
    assert [d.n_tokens for d in deltas if d.token_ids] == list(range(1, 14))


async def test_a_length_stop_inside_a_character_holds_it_back(tiny_model_path: Path) -> None:
    """The tiny model writes random bytes, so many max_tokens cuts fall inside a multi-byte
    character. The cut text is then the complete characters only (no U+FFFD for the unfinished
    one), a prefix of what a longer run writes, and the cut tokens still count in usage. A crashed
    attempt resumed from such a cut completes the character: one seamless text."""
    prompts, n = ["héllo wörld", "日本語", "Привет"], 40
    async with running_engine(tiny_model_path, slots=8, prefix_cache=False) as engine:
        held_back: list[tuple[str, int, str]] = []
        fulls: dict[str, tuple[str, list[int], list[Finished]]] = {}
        for prompt in prompts:
            full_text, full_tokens, _ = fulls[prompt] = await run_one(engine, greedy(prompt, n))
            cuts = await asyncio.gather(*(run_one(engine, greedy(prompt, k)) for k in range(1, n)))
            for k, (text, tokens, fin) in enumerate(cuts, start=1):
                assert tokens == full_tokens[:k] and fin[0].usage.completion_tokens == k
                assert full_text.startswith(text), (k, text, full_text)
                every_byte = b"".join(engine.model.token_bytes(t) for t in tokens).decode("utf-8", "replace")
                if every_byte != text:                  # the cut fell inside a character
                    assert every_byte == text + "\ufffd"
                    held_back.append((prompt, k, text))
        assert len(held_back) >= 3, "no cut fell inside a character: the test proves nothing"
        resumed = await asyncio.gather(*(run_one(engine, greedy(prompt, n, resume_tokens=fulls[prompt][1][:k]))
                                         for prompt, k, _ in held_back))
    for (prompt, k, text), (more, more_tokens, _) in zip(held_back, resumed):
        assert more_tokens == fulls[prompt][1][k:]
        assert text + more == fulls[prompt][0]


async def test_ignore_eos(tiny_model_path: Path) -> None:
    async with running_engine(tiny_model_path, slots=2) as engine:
        eos = engine.model.eos_token
        favour_eos = SamplingParams(temperature=0.0, logit_bias={eos: 100.0})
        text, tokens, fin = await run_one(engine, greedy("eos", 30, ignore_eos=False, sampling=favour_eos))
        assert fin[0].finish_reason == FinishReason.STOP
        assert (text, tokens) == ("", [])                      # EOS itself is not text
        text, tokens, fin = await run_one(engine, greedy("eos", 30, ignore_eos=True, sampling=favour_eos))
        assert fin[0].finish_reason == FinishReason.LENGTH
        assert len(tokens) == 30 and eos not in tokens


# ----------------------------------------------------------------------------- many requests, KV bookkeeping
@pytest.mark.parametrize("prefix_cache", [False, True])
async def test_hundred_requests_through_four_slots(tiny_model_path: Path, prefix_cache: bool) -> None:
    requests = [greedy(f"request {i}: " + "word " * (i % 7), 1 + (i * 7) % 40) for i in range(100)]
    # cache_slots=0: these prompts share under min_copy_tokens, which a cache slot's rule 7 recomputes
    async with running_engine(tiny_model_path, slots=4, ctx=512, prefix_cache=prefix_cache, cache_slots=0) as engine:
        results = await asyncio.gather(*(run_one(engine, r) for r in requests))
        stats = engine.stats()
    for request, (_, tokens, fin) in zip(requests, results):
        assert len(fin) == 1 and fin[0].finish_reason == FinishReason.LENGTH
        assert len(tokens) == request.max_tokens == fin[0].usage.completion_tokens
    assert stats.finished == {"length": 100}
    assert stats.slots_busy == 0 and stats.waiting == 0
    assert stats.generated_tokens == sum(r.max_tokens for r in requests)
    if prefix_cache:
        # Idle caches stay behind (at most one per slot, each within the per-sequence context).
        assert 0 < stats.kv_cells_used <= 4 * 512
        assert stats.prompt_tokens_cached > 0
    else:
        assert stats.kv_cells_used == 0
        assert stats.prompt_tokens_cached == 0


# ----------------------------------------------------------------------------- resume
@pytest.mark.parametrize("k", [1, 10, 39])
async def test_resume_continues_seamlessly(tiny_model_path: Path, k: int) -> None:
    n = 40
    async with running_engine(tiny_model_path, slots=2) as engine:
        full = engine.submit(greedy("resume me please", n))
        deltas = [ev async for ev in full if isinstance(ev, TextDelta)]
        tokens = [t for d in deltas for t in d.token_ids]
        full_text = "".join(d.text for d in deltas)
        delivered_text = "".join(d.text for d in deltas[:k])          # one token per delta
        assert len(tokens) == n and all(len(d.token_ids) == 1 for d in deltas[:k])

        resumed = engine.submit(greedy("resume me please", n, resume_tokens=tokens[:k]))
        more = [ev async for ev in resumed if isinstance(ev, TextDelta)]
    (fin,) = resumed.finished
    assert [t for d in more for t in d.token_ids] == tokens[k:]
    assert delivered_text + "".join(d.text for d in more) == full_text
    assert [d.n_tokens for d in more if d.token_ids] == list(range(k + 1, n + 1))
    assert fin.finish_reason == FinishReason.LENGTH
    assert fin.usage.completion_tokens == n


# ----------------------------------------------------------------------------- n > 1
async def test_n4_processes_the_prompt_once_and_seeds_per_choice(tiny_model_path: Path) -> None:
    prompt = "four different continuations of this prompt"

    def request(seed: int) -> GenerationRequest:
        sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
        return greedy(prompt, 24, n=4, sampling=sampling)

    async with running_engine(tiny_model_path, slots=4, prefix_cache=False) as engine:
        n_prompt = len(engine.prompt_tokens(request(1)))
        before = engine.stats()
        choices, finished = await collect_choices(engine.submit(request(1234)))
        after = engine.stats()
        again, _ = await collect_choices(engine.submit(request(1234)))
        other, _ = await collect_choices(engine.submit(request(999)))
    assert sorted(f.choice for f in finished) == [0, 1, 2, 3]
    assert all(f.finish_reason == FinishReason.LENGTH and f.usage.completion_tokens == 24 for f in finished)
    assert all(len(choices[c].token_ids) == 24 for c in range(4))
    # The prompt went through llama_decode once; three choices got it as a KV copy.
    assert after.prompt_tokens_processed - before.prompt_tokens_processed == n_prompt
    assert after.prompt_tokens_cached - before.prompt_tokens_cached == 3 * n_prompt
    # Each choice has its own seed (seed + choice): different outputs, reproducible by seed.
    assert len({tuple(choices[c].token_ids) for c in range(4)}) >= 3
    assert all(again[c].token_ids == choices[c].token_ids for c in range(4))
    assert any(other[c].token_ids != choices[c].token_ids for c in range(4))


# ----------------------------------------------------------------------------- prefix cache
async def test_prefix_cache_reuses_a_300_token_prefix_with_identical_output(tiny_model_path: Path) -> None:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
    prefix = " ".join(words[i % len(words)] for i in range(60))[:300]
    first = greedy(prefix + " first suffix", 20)
    second = greedy(prefix + " and another ending", 40)
    async with running_engine(tiny_model_path, slots=2, ctx=512) as engine:
        n_prefix = len(engine.prompt_tokens(greedy(prefix, 1)))
        assert n_prefix >= 300
        await run_one(engine, first)
        before = engine.stats()
        cached_text, cached_tokens, fin = await run_one(engine, second)
        after = engine.stats()
        n_second = len(engine.prompt_tokens(second))
    async with running_engine(tiny_model_path, slots=2, ctx=512, prefix_cache=False) as engine:
        cold_text, cold_tokens, cold_fin = await run_one(engine, second)
    assert cached_tokens == cold_tokens and cached_text == cold_text
    assert after.prompt_tokens_cached - before.prompt_tokens_cached >= 290
    assert fin[0].usage.cached_prompt_tokens >= 290 and cold_fin[0].usage.cached_prompt_tokens == 0
    processed = after.prompt_tokens_processed - before.prompt_tokens_processed
    assert processed == n_second - fin[0].usage.cached_prompt_tokens <= n_second - 290


async def test_the_first_delta_says_the_prompt_as_the_finish_will(tiny_model_path: Path) -> None:
    """A choice's first delta carries its prompt's tokens and those of them cached (a consumer
    reports the prompt up front: Anthropic's message_start); the later deltas carry none."""
    prompt = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma"
    async with running_engine(tiny_model_path, slots=2, ctx=512) as engine:
        for request in (greedy(prompt, 6), greedy(prompt + " again", 6)):       # the second reuses a prefix
            events = [ev async for ev in engine.submit(request)]
            deltas = [ev for ev in events if isinstance(ev, TextDelta)]
            [fin] = [ev for ev in events if isinstance(ev, Finished)]
            assert (deltas[0].prompt_tokens, deltas[0].cached_prompt_tokens) == \
                (fin.usage.prompt_tokens, fin.usage.cached_prompt_tokens)
            assert deltas[0].prompt_tokens == len(engine.prompt_tokens(request))
            assert all(d.prompt_tokens == d.cached_prompt_tokens == 0 for d in deltas[1:])
        assert fin.usage.cached_prompt_tokens > 0


async def test_reasoning_tokens_are_the_think_blocks(tiny_model_path: Path) -> None:
    """A reply's reasoning tokens are those up to the one that closes its think block (tags
    included); a grammar makes the tiny model write one."""
    grammar = 'root ::= "<think>" [a-z] [a-z] [a-z] "</think>" "ok"'
    request = GenerationRequest(messages=[{"role": "user", "content": "Hi"}], max_tokens=40,
                                sampling=SamplingParams(temperature=0, grammar=grammar))
    async with running_engine(tiny_model_path, slots=1, ctx=512) as engine:
        events = [ev async for ev in engine.submit(request)]
        tokens = [t for ev in events if isinstance(ev, TextDelta) for t in ev.token_ids]
        written = [engine.model.token_bytes(t) for t in tokens]
        [fin] = [ev for ev in events if isinstance(ev, Finished)]
        closed_at = next(n for n in range(1, len(written) + 1) if b"</think>" in b"".join(written[:n]))
        assert len("".join(ev.reasoning for ev in events if isinstance(ev, TextDelta))) == 3
        assert "".join(ev.text for ev in events if isinstance(ev, TextDelta)) == "ok"
        assert fin.usage.reasoning_tokens == closed_at < fin.usage.completion_tokens
        for delivered in (3, closed_at + 1):       # a resumed attempt counts the replayed tokens alike
            resumed = request.model_copy(update={"resume_tokens": tokens[:delivered]})
            [again] = [ev async for ev in engine.submit(resumed) if isinstance(ev, Finished)]
            assert again.usage.reasoning_tokens == closed_at, delivered


async def test_simultaneous_requests_share_a_prefix_still_being_prefilled(tiny_model_path: Path) -> None:
    prefix = " ".join(["omega psi chi phi upsilon tau"] * 12)[:300]
    requests = [greedy(prefix + f" ending number {i}", 30) for i in range(3)]
    async with running_engine(tiny_model_path, slots=4, ctx=512, prefix_cache=False) as engine:
        cold = [await run_one(engine, r) for r in requests]
    async with running_engine(tiny_model_path, slots=4, ctx=512) as engine:
        n_prompts = [len(engine.prompt_tokens(r)) for r in requests]
        warm = await asyncio.gather(*(run_one(engine, r) for r in requests))
        stats = engine.stats()
    for (_, cold_tokens, _), (_, warm_tokens, _) in zip(cold, warm):
        assert warm_tokens == cold_tokens
    # The shared ~300-token prefix went through llama_decode once, not three times.
    assert stats.prompt_tokens_cached >= 2 * 290
    assert stats.prompt_tokens_processed <= sum(n_prompts) - 2 * 290
    assert sorted(f.usage.cached_prompt_tokens for _, _, fins in warm for f in fins)[1:] >= [290, 290]


# ----------------------------------------------------------------------------- KV pressure
PRESSURE = [greedy(f"request number {i} " + "pad " * (i % 5), 180 - 3 * i) for i in range(16)]


async def test_kv_pressure_all_requests_complete(tiny_model_path: Path) -> None:
    async with running_engine(tiny_model_path, slots=8, ctx=256) as engine:   # 8 x 256 cells: no pressure
        reference = await asyncio.gather(*(run_one(engine, r) for r in PRESSURE))
    async with running_engine(tiny_model_path, slots=8, ctx=256, kv_cells=512) as engine:
        assert engine.stats().kv_cells_total == 512
        results = await asyncio.gather(*(run_one(engine, r) for r in PRESSURE))
        stats = engine.stats()
    for r, (_, tokens, fin), (_, ref_tokens, _) in zip(PRESSURE, results, reference):
        assert fin[0].finish_reason == FinishReason.LENGTH and fin[0].error is None
        assert len(tokens) == r.max_tokens
        assert tokens == ref_tokens
    assert stats.finished == {"length": 16}
    # The pool, not the slots, limited concurrency: each request reserves ~200 of the 512 cells.
    assert stats.avg_busy_slots_per_decode < 4
    assert stats.kv_cells_used <= 512


async def test_kv_overcommit_preemption_makes_progress(tiny_model_path: Path) -> None:
    """Overcommitted admission really fills llama.cpp's KV: decode reports no space, sequences are
    preempted and recomputed, and every request still completes with the reference output.

    Exact KV numerics: with CPU flash attention, recomputing a preempted sequence's tokens as one
    prefill batch instead of one decode at a time moves the tiny model's logits by up to ~0.4, enough
    to flip a near-tie argmax 30+ tokens later. Without flash attention and with f32 KV the two paths
    agree to ~1e-4, so any divergence left would be a real recomputation error."""
    exact = {"flash_attention": "off", "kv_type": "f32"}
    async with running_engine(tiny_model_path, slots=8, ctx=256, **exact) as engine:
        reference = await asyncio.gather(*(run_one(engine, r) for r in PRESSURE))
    async with running_engine(tiny_model_path, slots=8, ctx=256, kv_cells=512, kv_overcommit=3.0, **exact) as engine:
        tasks = [asyncio.create_task(run_one(engine, r)) for r in PRESSURE]
        try:
            # 16 requests cannot need more than a few hundred preemptions; thousands means a livelock.
            await wait_for(lambda: all(t.done() for t in tasks) or engine.stats().preemptions > 500,
                           timeout=60, what="the requests")
            stats = engine.stats()
            assert all(t.done() for t in tasks), (f"livelock: {stats.preemptions} preemptions, "
                                                  f"{stats.generated_tokens} tokens generated")
        finally:
            for t in tasks:
                t.cancel()
    assert stats.kv_full_events > 0 and stats.preemptions > 0      # the pressure was real
    for r, t, (_, ref_tokens, _) in zip(PRESSURE, tasks, reference):
        _, tokens, fin = t.result()
        assert fin[0].finish_reason == FinishReason.LENGTH and len(tokens) == r.max_tokens
        assert tokens == ref_tokens                     # recomputation after preemption changed nothing


class StepLog:
    """A receiver (``submit_async(request, receiver)``): keeps each delivery as it came."""

    def __init__(self) -> None:
        self.deliveries: list[list[object]] = []
        self.done = asyncio.Event()

    def receive(self, events: list[object]) -> None:
        self.deliveries.append(list(events))
        if sum(isinstance(e, Finished) for batch in self.deliveries for e in batch) == 2:
            self.done.set()


async def test_a_receiver_gets_each_steps_events_of_its_request_at_once(tiny_model_path):
    """The worker's jobs take their output per step: every choice's token of a step arrives in one
    call, in order, and the finished events with the step that ended them. The same request read
    through a handle yields the same events one at a time."""
    request = greedy("one step, two choices", 12, n=2)
    async with running_engine(tiny_model_path, slots=2) as engine:
        log = StepLog()
        handle = await engine.submit_async(request, log)
        await asyncio.wait_for(log.done.wait(), 60)
        iterated, _ = await collect_choices(engine.submit(request.model_copy(update={"id": "again"})))
    events = [e for batch in log.deliveries for e in batch]
    assert handle.finished == []                       # its events went to the receiver, not to the handle
    assert len(log.deliveries) < len(events)           # not one call per event
    generated = [batch for batch in log.deliveries if any(isinstance(e, TextDelta) and e.token_ids for e in batch)]
    assert all({e.choice for e in batch if isinstance(e, TextDelta)} == {0, 1} for batch in generated)
    assert sum(isinstance(e, Finished) for e in log.deliveries[-1]) == 2      # both ended in the last step
    for choice in (0, 1):
        deltas = [e for e in events if isinstance(e, TextDelta) and e.choice == choice]
        assert [d.n_tokens for d in deltas if d.token_ids] == list(range(1, 13))
        assert "".join(d.text for d in deltas) == iterated[choice].text
