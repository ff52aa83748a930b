"""``python -m bench.kv_copy``: with a KV stream per slot, is copying a cached prefix into another
slot's stream cheaper than computing the prefix again there?

llama.cpp copies across streams only a whole sequence, and does it by copying the source stream's
whole buffer (K and V of every layer, all ``n_ctx_seq`` cells, however few are used) at the start
of the next ``llama_decode``. So the copy's cost is fixed by the stream size, and re-prefill's
grows with the prefix. For each model and prefix length this prints the median time of:

- ``copy``: a cache hit in another slot, ``kv_copy_prefix`` of the first n - 1 tokens into an empty
  slot plus the one-token decode of the last one there (the decode runs the deferred copy);
- ``re-prefill``: a cache miss, decoding all n tokens into an empty slot.

Both run in one process, one after the other, on the same context (split layout, one thread
count), so their ratio holds on a noisy machine.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.overhead_bench import THREADS, write_tiny_model
from bench.report import markdown_table, progress, write_results
from slotq.engine import EngineConfig, KVLayout, bundled_model_path
from slotq.engine.llama_model import LlamaModel

PREFIXES = [32, 128, 512, 1000]
CTX = 1024
REPEATS = 5


def _decode(model: LlamaModel, tokens: list[int], seq: int, start: int) -> float:
    """Decode ``tokens`` at positions ``start``... of ``seq`` in chunks of n_batch: seconds."""
    started = time.perf_counter()
    step = model.info.n_batch
    for i in range(0, len(tokens), step):
        chunk = tokens[i:i + step]
        ret = model.decode(chunk, list(range(start + i, start + i + len(chunk))), [seq] * len(chunk),
                           [False] * (len(chunk) - 1) + [True])
        assert ret == 0, f"llama_decode returned {ret}"
    return time.perf_counter() - started


def measure(model: LlamaModel, n_prefix: int) -> tuple[float, float]:
    """(copy seconds, re-prefill seconds), medians of REPEATS."""
    prefix = [(7 * i) % (model.n_vocab - 300) + 259 for i in range(n_prefix)]
    model.kv_clear()
    _decode(model, prefix, seq=0, start=0)
    copies, prefills = [], []
    for _ in range(REPEATS):
        model.kv_remove(1)
        started = time.perf_counter()
        model.kv_copy_prefix(0, 1, n_prefix - 1)
        _decode(model, prefix[-1:], seq=1, start=n_prefix - 1)
        copies.append(time.perf_counter() - started)
        model.kv_remove(1)
        prefills.append(_decode(model, prefix, seq=1, start=0))
    return statistics.median(copies), statistics.median(prefills)


def main() -> None:
    rows, results = [], []
    with tempfile.TemporaryDirectory(prefix="slotq-kv-copy-") as tmp:
        models = {"tiny (tests/support/tiny_model.py)": write_tiny_model(Path(tmp) / "tiny.gguf"),
                  "SmolLM2-135M Q4_1 (bundled)": bundled_model_path()}
        for name, path in models.items():
            progress(f"{name}: copy vs re-prefill")
            model = LlamaModel(EngineConfig(model_path=path, slots=4, ctx=CTX, threads=THREADS,
                                            kv_layout=KVLayout.SPLIT, prefix_cache=False))
            try:
                for n in PREFIXES:
                    copy_s, prefill_s = measure(model, n)
                    results.append({"model": name, "prefix": n, "copy_ms": round(copy_s * 1000, 2),
                                    "prefill_ms": round(prefill_s * 1000, 2)})
                    rows.append([name, str(n), f"{copy_s * 1000:.2f}", f"{prefill_s * 1000:.1f}",
                                 f"{prefill_s / max(copy_s, 1e-6):.1f}"])
            finally:
                model.close()
    table = markdown_table(["model", "prefix tokens", "copy + last token ms", "re-prefill ms", "re-prefill / copy"],
                           rows)
    table += (f"\n\nStreams of {CTX} cells (the whole stream is copied whatever the prefix length), "
              f"{THREADS} threads, medians of {REPEATS}.")
    print(table)
    if "--no-write" not in sys.argv:
        write_results("kv_copy", {"results": results, "ctx": CTX, "threads": THREADS}, table, "python -m bench.kv_copy")


if __name__ == "__main__":
    main()
