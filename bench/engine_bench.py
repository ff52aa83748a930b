"""``slotq bench engine``: aggregate generated tokens/s of the batching modes on the bundled model.

Workload: C closed-loop clients; each sends ``requests_per_client`` requests one after another
(a new one as soon as its previous one finishes), with output lengths cycling through
``LENGTHS`` (ignore_eos, so lengths are exact). Continuous batching admits a client's next
request at the next step; static batching waits until the whole batch has drained; sequential
is one slot. The raw ceiling is a bare llama_decode loop over C sequences with no sampling and
no scheduling: generated tokens / decode time, what llama-batched-bench reports as S_TG.
Each figure is the median of three rounds; within a round the modes run one after another in a
rotated order, so a busy neighbour on a shared machine does not favour one mode. Each mode decodes
in a process of its own (:mod:`bench.isolated` says why).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from bench.isolated import IsolatedProcess
from bench.report import distinct_prompt, markdown_table, progress, write_results
from slotq.engine import (
    BatchingMode,
    Engine,
    EngineConfig,
    GenerationRequest,
    SamplingParams,
    bundled_model_path,
)
from slotq.engine.llama_model import LlamaModel

CONCURRENCY = [1, 2, 4, 8, 16]
ROUNDS = 3          # medians of 3 interleaved rounds
LENGTHS = [32, 64, 96]
SLOTS = 16
CTX = 256


_loop: asyncio.AbstractEventLoop | None = None
_engine: Engine | None = None
_raw_model: LlamaModel | None = None


def _start_engine(config: EngineConfig) -> None:
    """In a mode's own process: load its engine, on an event loop kept for the calls."""
    global _loop, _engine
    _loop = asyncio.new_event_loop()
    _engine = _loop.run_until_complete(Engine.start(config))


def _load_raw(config: EngineConfig) -> None:
    global _raw_model
    _raw_model = LlamaModel(config)


def _closed_loop(clients: int, per_client: int, lengths: list[int]) -> float:
    """Run the workload on this process's engine; return generated tokens per second of wall time."""
    assert _loop is not None and _engine is not None
    engine = _engine
    generated = 0

    async def client(c: int) -> None:
        nonlocal generated
        for r in range(per_client):
            request = GenerationRequest(prompt=distinct_prompt(c * per_client + r), ignore_eos=True,
                                        max_tokens=lengths[(c + r) % len(lengths)],
                                        sampling=SamplingParams(temperature=0))
            async for event in engine.generate(request):
                if event.kind == "finished":
                    generated += event.usage.completion_tokens

    async def all_clients() -> float:
        started = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(clients)))
        return generated / (time.perf_counter() - started)

    return _loop.run_until_complete(all_clients())


def raw_ceiling(batch: int, steps: int) -> float:
    """Prefill ``batch`` prompts, then ``steps`` decodes of one token per sequence, no sampling:
    generated tokens per second of decode time (llama-batched-bench's S_TG)."""
    model = _raw_model
    assert model is not None
    model.kv_clear()
    prompts = [model.tokenize(distinct_prompt(i)) for i in range(batch)]
    for seq, tokens in enumerate(prompts):
        ret = model.decode(tokens, list(range(len(tokens))), [seq] * len(tokens), [False] * (len(tokens) - 1) + [True])
        assert ret == 0, f"prefill failed: {ret}"
    positions = [len(t) for t in prompts]
    token = prompts[0][-1]
    started = time.perf_counter()
    for step in range(steps):
        ret = model.decode([token] * batch, [p + step for p in positions], list(range(batch)), [True] * batch)
        assert ret == 0, f"decode failed: {ret}"
    return batch * steps / (time.perf_counter() - started)


def raw_process(config: EngineConfig) -> IsolatedProcess:
    """A process holding the bare model, for :func:`raw_ceiling` calls."""
    return IsolatedProcess(_load_raw, config)


async def run(quick: bool) -> tuple[dict[str, Any], str]:
    path = bundled_model_path()
    concurrency = [1, 4] if quick else CONCURRENCY
    lengths = [8, 16] if quick else LENGTHS
    per_client = 1 if quick else 2
    base = dict(model_path=path, ctx=CTX, prefix_cache=False)
    configs = {
        "continuous": EngineConfig(slots=SLOTS, **base),
        "static": EngineConfig(slots=SLOTS, batching=BatchingMode.STATIC, **base),
        "sequential": EngineConfig(slots=1, **base),
    }
    progress("loading the model in one process per mode")
    processes = {mode: IsolatedProcess(_start_engine, config) for mode, config in configs.items()}
    processes["raw"] = raw_process(EngineConfig(slots=SLOTS, **base))
    results: list[dict[str, Any]] = []
    rounds = 1 if quick else ROUNDS
    try:
        for c in concurrency:
            samples: dict[str, list[float]] = {mode: [] for mode in processes}
            for r in range(rounds):            # rotate the order so drift on a shared machine hits every mode
                order = list(samples)[r % len(samples):] + list(samples)[: r % len(samples)]
                for mode in order:
                    progress(f"{mode} at concurrency {c} (round {r + 1}/{rounds})")
                    if mode == "raw":
                        samples[mode].append(processes[mode].call(raw_ceiling, c, sum(lengths) // len(lengths)))
                    else:
                        samples[mode].append(processes[mode].call(_closed_loop, c, per_client, lengths))
            for mode, values in samples.items():
                results.append({"mode": mode, "concurrency": c, "tokens_per_s": round(statistics.median(values), 1)})
    finally:
        for process in processes.values():
            process.close()
    data = {"model": path.stem, "results": results}
    table = _table(results, concurrency)
    if not quick:
        write_results("engine", data, table, "slotq bench engine")
    return data, table


def _table(results: list[dict[str, Any]], concurrency: list[int]) -> str:
    tps = {(r["mode"], r["concurrency"]): r["tokens_per_s"] for r in results}
    rows = []
    for c in concurrency:
        cont, raw, seq, static = (tps[(m, c)] for m in ("continuous", "raw", "sequential", "static"))
        rows.append([str(c), f"{cont:.1f}", f"{static:.1f}", f"{seq:.1f}", f"{raw:.1f}",
                     f"{cont / raw:.2f}", f"{cont / seq:.2f}", f"{cont / static:.2f}"])
    return markdown_table(["concurrency", "continuous tok/s", "static tok/s", "sequential tok/s", "raw ceiling tok/s",
                           "continuous / raw", "continuous / sequential", "continuous / static"], rows)
