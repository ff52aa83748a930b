"""``python -m bench.step_shapes``: with a KV stream per slot, what one decode step costs for the
shapes that lanes give the running slots.

llama.cpp puts only consecutive sequence ids into one micro-batch, so which slots decode matters,
not only how many. On the bundled model, 8 slots and one spare stream (the worker's defaults), each
stream holding a prompt of ``PROMPT`` tokens, this times one decode token per running sequence for:

- ``8 (0-7)``: every slot, the normal full batch;
- ``9 (0-8)``: every slot plus the spare, as when an interactive job runs in the reserve beside
  eight bulk jobs (``engine/scheduler.py``, rule 6);
- ``8, a gap (0-2, 4-8)``: a job handed back from slot 3 while the interactive job runs in the
  spare (two micro-batches a step until the victim returns).

And for a prompt of ``NEW_PROMPT`` tokens (a short chat turn) beside the full batch, as when a job
lent the reserve for its tenant prefills (``engine/scheduler.py``, rules 1 and 3): one step holding
the 8 decode tokens and the prompt, against the prompt's step alone (the lent job's first token)
followed by the 8 decode tokens' (the others' next token).

The shapes alternate step by step in one process, so their ratios hold on a noisy machine; medians
of ``STEPS`` steps each.
"""

from __future__ import annotations

import statistics
import sys
import time

from bench.overhead_bench import THREADS
from bench.report import markdown_table, progress, write_results
from slotq.engine import EngineConfig, KVLayout, bundled_model_path
from slotq.engine.llama_model import LlamaModel

SLOTS = 8
PROMPT = 120
NEW_PROMPT = 25
STEPS = 60
MIXED, ALONE = "8 decode tokens and a new prompt", "the new prompt alone"
SHAPES = {"8 (0-7)": list(range(8)), "9 (0-8)": list(range(9)), "8, a gap (0-2, 4-8)": [0, 1, 2, 4, 5, 6, 7, 8]}


def main() -> None:
    model = LlamaModel(EngineConfig(model_path=bundled_model_path(), slots=SLOTS, cache_slots=1, ctx=512,
                                    threads=THREADS, kv_layout=KVLayout.SPLIT, prefix_cache=False))
    try:
        progress(f"prefilling {SLOTS + 1} streams with {PROMPT} tokens each")
        positions = {}
        for seq in range(SLOTS + 1):
            tokens = [(7 * i + seq) % (model.n_vocab - 300) + 259 for i in range(PROMPT)]
            assert model.decode(tokens, list(range(PROMPT)), [seq] * PROMPT, [False] * (PROMPT - 1) + [True]) == 0
            positions[seq] = PROMPT
        times: dict[str, list[float]] = {name: [] for name in [*SHAPES, MIXED, ALONE]}
        prompt = [(11 * i) % (model.n_vocab - 300) + 259 for i in range(NEW_PROMPT)]
        progress(f"{STEPS} steps of each shape, alternating")
        for _ in range(STEPS):
            for name, seqs in SHAPES.items():
                started = time.perf_counter()
                ret = model.decode([300] * len(seqs), [positions[s] for s in seqs], seqs, [True] * len(seqs))
                times[name].append(time.perf_counter() - started)
                assert ret == 0, f"llama_decode returned {ret}"
                for s in seqs:
                    positions[s] += 1
            # the new prompt goes into the spare stream and is dropped again, so every round starts alike
            at = list(range(positions[SLOTS], positions[SLOTS] + NEW_PROMPT))
            new = (prompt, at, [SLOTS] * NEW_PROMPT, [False] * (NEW_PROMPT - 1) + [True])
            for name, decoding in ((MIXED, list(range(SLOTS))), (ALONE, [])):
                started = time.perf_counter()
                ret = model.decode([300] * len(decoding) + new[0], [positions[s] for s in decoding] + new[1],
                                   decoding + new[2], [True] * len(decoding) + new[3])
                times[name].append(time.perf_counter() - started)
                assert ret == 0, f"llama_decode returned {ret}"
                model.kv_remove(SLOTS, positions[SLOTS])
                for s in decoding:
                    positions[s] += 1
    finally:
        model.close()
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians["8 (0-7)"]
    rows = [[name, f"{medians[name] * 1000:.1f}", f"{medians[name] / base:.3f}"] for name in SHAPES]
    table = markdown_table(["running slots", "step ms", "x the full batch"], rows)
    table += (f"\n\nSmolLM2-135M Q4_1 (bundled), a KV stream per slot, {PROMPT}-token prompts, {THREADS} threads, "
              f"medians of {STEPS} steps per shape, alternating.")
    mixed, alone = medians[MIXED], medians[ALONE]
    table += "\n\n" + markdown_table(
        [f"a {NEW_PROMPT}-token prompt beside 8 decoding slots", "ms", "x one step holding both"],
        [["one step holding both (the new job's first token, and the others' next)", f"{mixed * 1000:.1f}", "1.000"],
         ["the prompt's step alone (the new job's first token)", f"{alone * 1000:.1f}", f"{alone / mixed:.3f}"],
         ["then the 8 decode tokens' step (the others' next token)", f"{(alone + base) * 1000:.1f}",
          f"{(alone + base) / mixed:.3f}"]])
    print(table)
    if "--no-write" not in sys.argv:
        write_results("step_shapes", {"medians_ms": {k: round(v * 1000, 2) for k, v in medians.items()},
                                      "prompt": PROMPT, "new_prompt": NEW_PROMPT, "steps": STEPS, "threads": THREADS},
                      table, "python -m bench.step_shapes")


if __name__ == "__main__":
    main()
