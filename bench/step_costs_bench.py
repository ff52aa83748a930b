"""``slotq bench step-costs``: the engine thread's per-step costs, before and after batching them.

Each engine step, every sequence waits for the engine thread's Python. This times, in CPU time
(``time.process_time``, the best of several repeats), the pieces issue 43 found on that thread, at
64 and 256 sequences, each beside the code it replaced (commit 45647eb, kept here as the baseline,
so both run side by side in one process on the same data):

* ``logprobs``: one step's top-20 logprobs for every row, over a 151,936-token vocabulary (Qwen's;
  synthetic logits): before, a float64 log-softmax, an ``argpartition`` and 21 validated pydantic
  models per row, one row at a time; after, :func:`slotq.engine.logprobs.step_logprobs` for the
  block and :func:`~slotq.engine.logprobs.as_event` per row.
* ``replies``: a worker's reply of 16,384 pieces gathered by ``Replies.add``: before, one string
  concatenation per piece (quadratic), after, a list joined when read.

No model is loaded and nothing is asserted: the numbers are the result.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.report import markdown_table, progress, write_results
from slotq.engine.events import TokenLogprob, TopLogprob
from slotq.engine.logprobs import as_event, step_logprobs, token_text
from slotq.jobs.worker.resume import Replies

SEQUENCES = (64, 256)
QWEN_VOCAB = 151_936
TOP = 20
REPLY_PIECES = 16_384


def cpu_ms(repeats: int, work: Callable[..., object], *args: Any) -> float:
    """The least CPU time of ``repeats`` runs of ``work(*args)``, in ms (the least is the one the machine
    disturbed least; CPU time leaves out the time other processes held the core)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        work(*args)
        best = min(best, time.process_time() - started)
    return best * 1000


# ------------------------------------------------------------------ logprobs
def _logprobs_before(rows: np.ndarray, sampled: list[int]) -> list[TokenLogprob]:
    """45647eb's path: per row, a float64 log-sum-exp, an argpartition of the vocabulary, a sort of
    the top and a validated pydantic model per entry."""
    out = []
    for row, token in zip(rows, sampled, strict=True):
        logprobs = row - np.float32(float(row.max()))
        logprobs -= np.float32(np.log(np.exp(logprobs, dtype=np.float64).sum()))
        best = np.argpartition(logprobs, -TOP)[-TOP:]
        order = sorted(best.tolist(), key=lambda t: (-logprobs[t], t))
        top = [TopLogprob(**_described(t, logprobs)) for t in order]
        out.append(TokenLogprob(**_described(token, logprobs), top=top))
    return out


def _described(token: int, logprobs: np.ndarray) -> dict[str, Any]:
    piece = b"tok"
    return {"id": token, "token": token_text(piece), "token_bytes": list(piece),
            "logprob": float(f"{logprobs[token]:.7g}")}


def _logprobs_after(rows: np.ndarray, sampled: list[int]) -> list[TokenLogprob]:
    results = step_logprobs(np.array(rows), [TOP] * len(rows), [lambda token: b"tok"] * len(rows))
    return [as_event(row.of(token)) for row, token in zip(results, sampled, strict=True)]


def _bench_logprobs(quick: bool) -> list[dict[str, Any]]:
    out = []
    for n in SEQUENCES:
        progress(f"logprobs: {n} rows x {QWEN_VOCAB}")
        rows = np.random.default_rng(n).normal(0, 4, (n, QWEN_VOCAB)).astype(np.float32)
        sampled = rows.argmax(axis=1).tolist()
        repeats = 2 if quick else 5
        out.append({"item": "logprobs (top 20, 151,936 vocab)", "sequences": n,
                    "before_ms": cpu_ms(repeats, _logprobs_before, rows, sampled),
                    "after_ms": cpu_ms(repeats, _logprobs_after, rows, sampled)})
    return out


# ------------------------------------------------------------------ replies
def _replies_before(pieces: list[str]) -> str:
    """45647eb's ``Replies.add``: the reply so far plus the new piece, a new string each time."""
    text: dict[int, str] = {}
    for piece in pieces:
        text[0] = text.get(0, "") + piece
    return text[0]


def _replies_after(pieces: list[str]) -> str:
    replies = Replies()
    for piece in pieces:
        replies.add(0, piece, "", [])
    return replies.text(0)


def _bench_replies(quick: bool) -> list[dict[str, Any]]:
    progress(f"replies: {REPLY_PIECES} pieces")
    pieces = [f"w{i % 97:02d} " for i in range(REPLY_PIECES)]
    repeats = 3 if quick else 7
    return [{"item": f"Replies.add, one reply of {REPLY_PIECES} pieces", "sequences": 1,
             "before_ms": cpu_ms(repeats, _replies_before, pieces),
             "after_ms": cpu_ms(repeats, _replies_after, pieces)}]


async def run(quick: bool) -> tuple[dict[str, Any], str]:
    measured = [*_bench_logprobs(quick), *_bench_replies(quick)]
    rows = [[m["item"], str(m["sequences"]), f"{m['before_ms']:.2f}", f"{m['after_ms']:.2f}",
             f"{m['before_ms'] / m['after_ms']:.1f}x"] for m in measured]
    table = markdown_table(["per step", "sequences", "before, CPU ms", "after, CPU ms", "speed-up"], rows)
    write_results("step_costs", {"measured": measured}, table, "slotq bench step-costs" + (" --quick" if quick else ""))
    return {"measured": measured}, table
