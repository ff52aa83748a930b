"""Shared helpers for the engine tests: start/close an Engine, collect a request's events, build an
engine snapshot (EngineStats) for the views that show one."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slotq.engine import Engine, EngineConfig, EngineStats, Finished, GenerationRequest, SamplingParams, TextDelta

# Small defaults. One thread: llama.cpp's worker threads spin at barriers, so with 2 threads on a
# 2-core machine any other busy process (or a second test run) slows every decode by orders of
# magnitude; one thread degrades gracefully. ctx 512: the default per-sequence context (4096) x 8
# slots would allocate far more KV than any test needs.
DEFAULT_CONFIG: dict[str, Any] = {"threads": 1, "ctx": 512}


def engine_stats(**overrides: Any) -> EngineStats:
    """An engine snapshot of a busy worker (2 of 4 slots, a quarter of its KV), ``overrides`` applied."""
    base: dict[str, Any] = dict(
        model="m", slots_total=4, slots_active=4, slots_busy=2, waiting=1, decode_steps=10, prompt_tokens_processed=100,
        prompt_tokens_cached=50, generated_tokens=40, kv_cells_used=256, kv_cells_cached=0, kv_cells_total=1024,
        avg_busy_slots_per_decode=3.5, preemptions=1, kv_full_events=1, decode_seconds=1.0, generating_steps=8,
        stream_tokens=8.0,
        generating_seconds=0.5, batch_limit=64, prefill_chunk_limit=16, finished={})
    return EngineStats(**(base | overrides))


@asynccontextmanager
async def running_engine(path: Path, **config: Any) -> AsyncIterator[Engine]:
    """``async with running_engine(path, slots=4) as engine: ...`` -- always closed afterwards."""
    engine = await Engine.start(EngineConfig(model_path=path, **{**DEFAULT_CONFIG, **config}))
    try:
        yield engine
    finally:
        await engine.close()


@dataclass
class Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    deltas: int = 0


async def collect(stream: Any) -> tuple[str, list[int], list[Finished]]:
    """Drain a RequestHandle (or any async iterator of events). Returns the concatenated text and
    token ids of all deltas, in arrival order, and the Finished events."""
    text, tokens, finished = [], [], []
    async for event in stream:
        if isinstance(event, TextDelta):
            text.append(event.text)
            tokens.extend(event.token_ids)
        elif isinstance(event, Finished):
            finished.append(event)
        else:  # pragma: no cover - the engine only emits these two kinds
            raise AssertionError(f"unexpected event {event!r}")
    return "".join(text), tokens, finished


async def collect_choices(stream: Any) -> tuple[dict[int, Choice], list[Finished]]:
    """Like :func:`collect` but keeps each choice (n > 1) apart."""
    choices: dict[int, Choice] = {}
    finished: list[Finished] = []
    async for event in stream:
        if isinstance(event, TextDelta):
            c = choices.setdefault(event.choice, Choice())
            c.text += event.text
            c.token_ids.extend(event.token_ids)
            c.deltas += 1
        else:
            finished.append(event)
    return choices, finished


def greedy(prompt: str, max_tokens: int, **kw: Any) -> GenerationRequest:
    """A greedy request with a fixed output length (EOS ignored) unless told otherwise."""
    kw.setdefault("ignore_eos", True)
    sampling = kw.pop("sampling", None) or SamplingParams(temperature=0.0)
    return GenerationRequest(prompt=prompt, max_tokens=max_tokens, sampling=sampling, **kw)


async def run_one(engine: Engine, request: GenerationRequest) -> tuple[str, list[int], list[Finished]]:
    return await collect(engine.submit(request))


async def solo_greedy_tokens(model_path: Path, prompts: list[str], *, max_tokens: int,
                             ctx: int) -> dict[str, list[int]]:
    """Each prompt's greedy tokens (EOS ignored) from an engine of its own, one sequence at a time, with
    the fault tests' worker settings (one-token micro-batches, so a resumed attempt prefills exactly
    what was decoded): the reference a job interrupted and resumed anywhere must match."""
    engine = await Engine.start(EngineConfig(model_path=model_path, slots=1, ctx=ctx, threads=1, ubatch=1))
    try:
        out = {}
        for prompt in prompts:
            handle = engine.submit(GenerationRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True,
                                                     sampling=SamplingParams(temperature=0)))
            out[prompt] = [t async for ev in handle if isinstance(ev, TextDelta) for t in ev.token_ids]
        return out
    finally:
        await engine.close()
