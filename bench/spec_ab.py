"""Speculative decoding's effect on the engine alone, side by side: the bundled model in-process with
``spec=off`` and ``spec=ngram`` (or, with ``--draft-model``, the default ``spec=auto`` drafting with
that GGUF), both loaded at once, each workload's requests sent to one then the other, alternating
which goes first each round, so a shared machine's noise falls on both alike. No Redis and no
gateway: it leaves out delivery (``slotq bench spec`` has it) and starts in seconds, where that
benchmark's workers take minutes on a loaded machine.

    .venv/bin/python -m bench.spec_ab CLIENTS ROUNDS COPY_TOKENS FREE_TOKENS [--draft-model PATH]   # e.g. 4 2 96 48

A draft model written by ``tests/support/tiny_model.write_draft_model`` (random weights, the bundled
model's vocabulary) drafts tokens that are almost never kept: what ``auto`` costs where its drafts
miss, which its planner must bring to ``off``'s speed.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from bench.peers_bench import peer_prompt
from bench.spec_prompts import copy_prompt
from slotq.engine import (
    ChatMessage,
    Engine,
    EngineConfig,
    GenerationRequest,
    SamplingParams,
    TextDelta,
    bundled_model_path,
)
from slotq.engine.config import SpecMode


def _request(workload: str, i: int, max_tokens: int) -> GenerationRequest:
    greedy = SamplingParams(temperature=0.0)
    if workload == "copy-heavy":
        return GenerationRequest(messages=[ChatMessage(role="user", content=copy_prompt(i))], max_tokens=max_tokens,
                                 ignore_eos=True, sampling=greedy)
    return GenerationRequest(prompt=peer_prompt(i), max_tokens=max_tokens, ignore_eos=True, sampling=greedy)


async def _tokens(engine: Engine, request: GenerationRequest) -> int:
    return sum([len(event.token_ids) async for event in engine.submit(request) if isinstance(event, TextDelta)])


async def _batch(engine: Engine, workload: str, clients: int, first: int, max_tokens: int) -> tuple[int, float]:
    """``clients`` requests at once; (tokens, seconds)."""
    started = time.perf_counter()
    counts = await asyncio.gather(*(_tokens(engine, _request(workload, first + k, max_tokens)) for k in range(clients)))
    return sum(counts), time.perf_counter() - started


async def run(clients: int, rounds: int, max_tokens: dict[str, int], draft_model: Path | None = None) -> list[str]:
    def config(spec: SpecMode, draft: Path | None = None) -> EngineConfig:
        return EngineConfig(model_path=bundled_model_path(), spec=spec, draft_model=draft, slots=clients, ctx=2048,
                            threads=2)
    tried = "auto" if draft_model else "ngram"
    engines = {"off": await Engine.start(config(SpecMode.OFF)),
               tried: await Engine.start(config(SpecMode.AUTO, draft_model) if draft_model else config(SpecMode.NGRAM))}
    try:
        totals: dict[tuple[str, str], list[float]] = {}
        for r in range(rounds):
            for workload, n in max_tokens.items():
                for name in (["off", tried] if r % 2 == 0 else [tried, "off"]):
                    tokens, seconds = await _batch(engines[name], workload, clients, 1000 * r + 10, n)
                    total = totals.setdefault((workload, name), [0.0, 0.0])
                    total[0] += tokens
                    total[1] += seconds
        stats = engines[tried].stats()
    finally:
        for engine in engines.values():
            await engine.close()
    lines = []
    for workload in max_tokens:
        off, spec = (totals[(workload, name)][0] / totals[(workload, name)][1] for name in ("off", tried))
        lines.append(f"{clients} clients, {workload}: off {off:.1f} tok/s, {tried} {spec:.1f} tok/s, "
                     f"{tried} / off {spec / off:.2f}")
    lines.append(f"{clients} clients: {tried} drafted {stats.spec_draft_tokens}, kept {stats.spec_accepted_tokens}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for count in ("clients", "rounds", "copy_tokens", "free_tokens"):
        parser.add_argument(count, type=int)
    parser.add_argument("--draft-model", type=Path, help="compare spec=auto drafting with this GGUF, not ngram")
    args = parser.parse_args()
    lines = asyncio.run(run(args.clients, args.rounds, {"copy-heavy": args.copy_tokens, "free-form": args.free_tokens},
                            args.draft_model))
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
