"""``slotq bench prefix``: 16 requests sharing a ~300-token system prompt, with and without the
prefix cache, side by side in one run. Requests arrive together (all 16 submitted at once into
8 slots), so the cache helps both the later admissions and the concurrent ones."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from bench.report import markdown_table, percentile, progress, write_results
from slotq.engine import ChatMessage, Engine, EngineConfig, GenerationRequest, SamplingParams, bundled_model_path

SYSTEM = (
    "You are the support assistant of a company that rents bicycles in a large city. "
    "Customers ask about prices, opening hours, repairs, helmets, child seats, electric bikes, "
    "group tours, insurance, deposits, lost keys, damaged tyres and the return policy. "
    "Prices: a city bike costs 12 euros per day, an electric bike 30 euros per day, a tandem 25 euros. "
    "Helmets are free. Child seats cost 3 euros per day. Group tours start every Saturday at ten, "
    "meet at the main station, last three hours and cost 40 euros per person including the bike. "
    "Insurance costs 4 euros per day and covers theft with a 50 euro excess. The deposit is 100 euros "
    "and is returned when the bike comes back undamaged. Opening hours are eight to eight every day "
    "except public holidays, when the shop opens at ten. Repairs on rented bikes are free; repairs on "
    "customers' own bikes are quoted on the spot. Lost keys cost 15 euros. Always answer politely, "
    "briefly and only with the facts above; if you do not know, say so and suggest calling the shop. "
)
QUESTIONS = ["How much is an e-bike?", "When do tours start?", "Are helmets free?", "What is the deposit?",
             "Do you open on holidays?", "How much is a tandem?", "What does insurance cover?",
             "Can I rent a child seat?", "What if I lose the key?", "Do you repair my own bike?",
             "How long is a tour?", "Where do tours meet?", "What are your hours?", "Is the deposit refunded?",
             "How much per day for a city bike?", "What is the insurance excess?"]


async def _run(engine: Engine, max_tokens: int) -> tuple[list[float], float]:
    async def one(question: str) -> tuple[float, int]:
        started = time.perf_counter()
        first = None
        tokens = 0
        request = GenerationRequest(messages=[ChatMessage(role="system", content=SYSTEM),
                                              ChatMessage(role="user", content=question)],
                                    max_tokens=max_tokens, ignore_eos=True, sampling=SamplingParams(temperature=0))
        async for event in engine.generate(request):
            if event.kind == "delta" and first is None:
                first = time.perf_counter() - started
            elif event.kind == "finished":
                tokens = event.usage.completion_tokens
        return first or 0.0, tokens

    started = time.perf_counter()
    outcomes = await asyncio.gather(*(one(q) for q in QUESTIONS))
    wall = time.perf_counter() - started
    return [o[0] for o in outcomes], sum(o[1] for o in outcomes) / wall


async def run(quick: bool) -> tuple[dict[str, Any], str]:
    max_tokens = 8 if quick else 32
    results = []
    for cache in (False, True):
        config = EngineConfig(model_path=bundled_model_path(), slots=8, ctx=1024, prefix_cache=cache)
        engine = await Engine.start(config)
        try:
            progress(f"prefix cache {'on' if cache else 'off'}")
            ttfts, tps = await _run(engine, max_tokens)
            stats = engine.stats()
        finally:
            await engine.close()
        results.append({"prefix_cache": cache, "ttft_p50_ms": round(percentile(ttfts, 50) * 1000, 1),
                        "tokens_per_s": round(tps, 1), "prompt_tokens_processed": stats.prompt_tokens_processed,
                        "prompt_tokens_cached": stats.prompt_tokens_cached})
    off, on = results
    rows = [[("on" if r["prefix_cache"] else "off"), f"{r['ttft_p50_ms']:.0f}", f"{r['tokens_per_s']:.1f}",
             str(r["prompt_tokens_processed"]), str(r["prompt_tokens_cached"])] for r in results]
    table = markdown_table(
        ["prefix cache", "TTFT p50 ms", "tokens/s", "prompt tokens computed", "prompt tokens from cache"], rows)
    table += (f"\n\nTTFT p50 {off['ttft_p50_ms'] / max(on['ttft_p50_ms'], 1e-9):.1f}x better with the cache; "
              f"throughput {on['tokens_per_s'] / off['tokens_per_s']:.2f}x.")
    data = {"results": results}
    if not quick:
        write_results("prefix", data, table, "slotq bench prefix")
    return data, table
