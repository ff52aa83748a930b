"""``slotq bench step-costs``: the engine thread's per-step costs, before and after batching them.

Each engine step, every sequence waits for the engine thread's Python. This times, in CPU time
(``time.process_time``, the best of several repeats), the pieces issue 43 found on that thread, at
64 and 256 sequences, each beside the code it replaced (commit 45647eb, kept here as the baseline,
so both run side by side in one process on the same data):

* ``logprobs``: one step's top-20 logprobs for every row, over a 151,936-token vocabulary (Qwen's;
  synthetic logits): before, a float64 log-softmax, an ``argpartition`` and 21 validated pydantic
  models per row, one row at a time; after, :class:`slotq.engine.logprobs.StepLogprobs` for the
  block and :func:`~slotq.engine.logprobs.as_event` per row.
* ``masks``: one step's JSON-schema masks for 64 or 256 constrained sequences (each at its own
  point of the object) over a synthetic 151,936-token vocabulary (256 byte tokens and random
  words; llguidance's tokenizer built from it): before, each matcher masking its row in turn
  (45647eb's ``TokenMatcher.mask``); after, :class:`~slotq.engine.constraints.StepMasks` for all rows. The
  masks are filled by llguidance's threads, so the wall time is given beside the CPU time.
* ``prefix``: one admission's prefix lookups (the longest prefix among the running slots' KV and
  the idle caches, then the running sequence still computing a longer one) while 64 or 256 running
  sequences share a 2,048-token system prompt (token ids below the tiny model's 4,096): before,
  every running sequence's tokens sliced and compared one by one in Python; after, a dict walk of
  chained block hashes (:mod:`slotq.engine.prefix_index`), its first lookup (hashing every running
  sequence once) and a later one (the hashes kept) timed apart.
* ``stats``: the stats the engine publishes every step, with 64 or 256 slots each holding a
  copy of a shared 2,048-cell prompt and 200 cells of their own (a quarter of them idle caches):
  before, two scans of the KV ledger and a validated :class:`~slotq.engine.stats.EngineStats`;
  after, counts kept as the ledger changes copied into a :class:`~slotq.engine.stats.StatsSnapshot`
  (the model is built when read).
* ``replies``: a worker's reply of 16,384 pieces gathered by ``Replies.add``: before, one string
  concatenation per piece (quadratic), after, a list joined when read.
* ``call triggers``: what watching for a call costs a native ``tool_choice: auto`` reply while it
  is plain text (64 or 256 such sequences, one 4-byte piece each per step, Hermes format): before,
  each piece through its :class:`~slotq.engine.reply_parser.ReplyParser` only (calls were checked
  after the reply); after, also through its :class:`~slotq.engine.tools.CallTrigger`, which arms the
  call's grammar at its marker. Plain-text requests without tools pay neither. Once armed, a call's
  tokens cost a constrained row's mask each (the ``masks`` rows).

No model is loaded and nothing is asserted: the numbers are the result.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import llguidance
import numpy as np

from bench.report import markdown_table, progress, write_results
from slotq.engine.constraints import Constraint, StepMasks, TokenMatcher, constraint_for
from slotq.engine.events import TokenLogprob, TopLogprob
from slotq.engine.grammar_knobs import GrammarKnobs
from slotq.engine.logprobs import StepLogprobs, as_event, token_text
from slotq.engine.prefix_index import PrefixIndex, PrefixMatch
from slotq.engine.reply_parser import ReplyParser, ToolCallFormat
from slotq.engine.request import SamplingParams
from slotq.engine.scheduler import Scheduler, SchedulerConfig
from slotq.engine.stats import EngineCounters, EngineStats
from slotq.engine.tools import CallTrigger
from slotq.jobs.worker.resume import Replies

SEQUENCES = (64, 256)
QWEN_VOCAB = 151_936
TOP = 20
REPLY_PIECES = 16_384
SYSTEM_PROMPT = 2_048
TINY_VOCAB = 4_096


def wall_ms(repeats: int, work: Callable[..., object], *args: Any) -> float:
    """The least wall time of ``repeats`` runs of ``work(*args)``, in ms."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        work(*args)
        best = min(best, time.perf_counter() - started)
    return best * 1000


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


def _logprobs_after(step: StepLogprobs, rows: np.ndarray, sampled: list[int]) -> list[TokenLogprob]:
    results = step.compute(list(rows), [TOP] * len(rows), [lambda token: b"tok"] * len(rows))
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
                    "after_ms": cpu_ms(repeats, _logprobs_after, StepLogprobs(), rows, sampled)})
    return out


# ------------------------------------------------------------------ masks
SCHEMA = {"type": "object", "required": ["name", "n", "tags"], "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 40}, "n": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}}}}
WALK = b'{"name":"a queue of jobs","n":1234,"tags":["red","blue"]}'


class _ByteTokenizer:
    """A synthetic vocabulary for llguidance: the 256 bytes, then distinct random ASCII words (the
    shape of a BPE vocabulary), the last token the end of text. Encodes byte by byte."""

    def __init__(self, n_vocab: int) -> None:
        rng = np.random.default_rng(0)
        words: dict[bytes, None] = {}
        while len(words) < n_vocab - 257:
            words[bytes(rng.integers(97, 123, int(rng.integers(2, 9))).tolist())] = None
        self.tokens = [bytes([b]) for b in range(256)] + list(words) + [b"<eos>"]
        self.eos_token_id = n_vocab - 1
        self.bos_token_id = None
        self.special_token_ids = [n_vocab - 1]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def _matchers(n: int, tokenizer: llguidance.LLTokenizer, constraint: Constraint) -> list[TokenMatcher]:
    knobs = GrammarKnobs()
    out = []
    for i in range(n):
        matcher = TokenMatcher(llguidance.LLMatcher(tokenizer, constraint.grammar, log_level=0,
                                                    limits=knobs.parser_limits()), constraint, knobs, QWEN_VOCAB)
        for byte in WALK[:i % (len(WALK) - 1)]:             # each at its own point of the object
            matcher.accept(byte)
        out.append(matcher)
    return out


def _masks_before(masks: StepMasks, matchers: list[TokenMatcher], rows: np.ndarray) -> None:
    """45647eb's ``TokenMatcher.mask``, one row after another: llguidance's mask into the matcher's
    words, every bit unpacked, and -inf written through a boolean index."""
    masks.apply([])                 # no row left marked by a run of the batched path
    bitmask = np.zeros((QWEN_VOCAB + 31) // 32, dtype=np.int32)
    for matcher, row in zip(matchers, rows, strict=True):
        matcher._matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
        matcher.raise_if_error()
        allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little", count=QWEN_VOCAB)
        row[allowed == 0] = -np.inf


def _bench_masks(quick: bool) -> list[dict[str, Any]]:
    progress(f"masks: building llguidance's tokenizer for {QWEN_VOCAB} tokens")
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer(QWEN_VOCAB)))
    constraint = constraint_for(SamplingParams(json_schema=SCHEMA))
    assert constraint is not None
    out = []
    for n in SEQUENCES:
        progress(f"masks: {n} constrained rows x {QWEN_VOCAB}")
        matchers = _matchers(n, tokenizer, constraint)
        logits = np.random.default_rng(n).normal(0, 1, (n, QWEN_VOCAB)).astype(np.float32)
        before_rows, after_rows = logits.copy(), logits.copy()
        masks = StepMasks(QWEN_VOCAB)
        _masks_before(masks, matchers, before_rows)
        masks.apply([(matcher, after_rows[i]) for i, matcher in enumerate(matchers)])
        assert np.array_equal(before_rows, after_rows)                 # the same masks, or the numbers mean nothing
        masks.apply([])
        repeats = 3 if quick else 7
        rows = logits.copy()
        pairs = [(matcher, rows[i]) for i, matcher in enumerate(matchers)]
        for clock, name in ((cpu_ms, "CPU"), (wall_ms, "wall")):
            out.append({"item": f"JSON-schema masks, 151,936 vocab ({name} time)", "sequences": n,
                        "before_ms": clock(repeats, _masks_before, masks, matchers, rows),
                        "after_ms": clock(repeats, masks.apply, pairs)})
        masks.apply([])
    return out


# ------------------------------------------------------------------ prefix
def _slow_common_prefix(a: list[int], b: list[int], at_most: int) -> int:
    n = min(len(a), len(b), at_most)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _prefix_before(running: list[tuple[int, list[int], int]], idle: dict[int, list[int]],
                   tokens: list[int]) -> tuple[PrefixMatch | None, int]:
    """45647eb's two lookups: each running slot's computed tokens sliced and compared token by
    token, then each idle cache, then every running sequence's whole tokens again."""
    at_most = len(tokens) - 1
    best: PrefixMatch | None = None
    for slot, held in ((slot, seq_tokens[:n]) for slot, seq_tokens, n in running):
        n = _slow_common_prefix(held, tokens, at_most)
        if n > (best.n_tokens if best else 0):
            best = PrefixMatch(slot, n, idle=False)
    for slot, held in idle.items():
        n = _slow_common_prefix(held, tokens, at_most)
        if n > 0 and (best is None or n > best.n_tokens or (n == best.n_tokens and not best.idle)):
            best = PrefixMatch(slot, n, idle=True)
    wait_n = 0
    for _, seq_tokens, _ in running:
        wait_n = max(wait_n, _slow_common_prefix(seq_tokens, tokens, at_most))
    return best, wait_n


def _prefix_after(index: PrefixIndex, running: list[tuple[int, list[int], int]],
                  tokens: list[int]) -> tuple[PrefixMatch | None, int]:
    best = index.longest_match(tokens, at_most=len(tokens) - 1, running=running)
    wait = index.longest_running_match(tokens, at_most=len(tokens) - 1,
                                       running=[(slot, seq_tokens, len(seq_tokens)) for slot, seq_tokens, _ in running])
    return best, wait.n_tokens if wait else 0


def _bench_prefix(quick: bool) -> list[dict[str, Any]]:
    out = []
    for n in SEQUENCES:
        progress(f"prefix: {n} running sequences sharing {SYSTEM_PROMPT} tokens")
        rng = np.random.default_rng(n)
        system = rng.integers(0, TINY_VOCAB, SYSTEM_PROMPT).tolist()
        running = [(slot, system + rng.integers(0, TINY_VOCAB, 200).tolist(), SYSTEM_PROMPT + 150)
                   for slot in range(n)]
        idle = {n + i: system + rng.integers(0, TINY_VOCAB, 100).tolist() for i in range(4)}
        newcomer = system + rng.integers(0, TINY_VOCAB, 64).tolist()

        def fresh_index(idle: dict[int, list[int]] = idle) -> PrefixIndex:
            index = PrefixIndex()
            for slot, held in idle.items():
                index.keep(slot, held)
            return index
        warm = fresh_index()
        expected = _prefix_before(running, idle, newcomer)
        assert _prefix_after(warm, running, newcomer) == expected      # the same answer, or the numbers mean nothing
        repeats = 3 if quick else 7
        before = cpu_ms(repeats, _prefix_before, running, idle, newcomer)
        first = min(cpu_ms(1, _prefix_after, fresh_index(), running, newcomer) for _ in range(repeats))
        out.append({"item": "prefix lookups of one admission, first (hashing)", "sequences": n,
                    "before_ms": before, "after_ms": first})
        out.append({"item": "prefix lookups of one admission, later", "sequences": n,
                    "before_ms": before, "after_ms": cpu_ms(repeats, _prefix_after, warm, running, newcomer)})
    return out


# ------------------------------------------------------------------ stats
def _scanned_cells(segments: dict[int, list[Any]], exclude: frozenset[int] = frozenset()) -> int:
    """45647eb's ``KVLedger.used_cells``: every segment of every sequence, each step."""
    longest: dict[int, int] = {}
    for seq_id, segs in segments.items():
        if seq_id not in exclude:
            for seg in segs:
                longest[seg.block] = max(longest.get(seg.block, 0), seg.length)
    return sum(longest.values())


def _stats_before(counters: EngineCounters, scheduler: Scheduler, idle: frozenset[int]) -> EngineStats:
    values = counters.snapshot(scheduler, "bench")._values     # the same fields, then the old work on top
    segments = scheduler.ledger._segments
    used = _scanned_cells(segments)
    return EngineStats(**{**values, "kv_cells_used": used, "kv_cells_cached": used - _scanned_cells(segments, idle)})


def _bench_stats(quick: bool) -> list[dict[str, Any]]:
    out = []
    for n in SEQUENCES:
        progress(f"stats: {n} slots")
        scheduler = Scheduler(SchedulerConfig(n_slots=n, n_batch=2 * n, kv_cells=1_000_000, prefill_chunk=512))
        ledger = scheduler.ledger
        ledger.extend(0, SYSTEM_PROMPT)
        for slot in range(1, n):
            ledger.copy_prefix(0, slot, SYSTEM_PROMPT)
        for slot in range(n):
            for _ in range(200):            # one decoded cell per step
                ledger.extend(slot, 1)
        idle = frozenset(range(0, n, 4))
        for slot in idle:
            ledger.park(slot)
        counters = EngineCounters()
        assert _stats_before(counters, scheduler, idle) == counters.snapshot(scheduler, "bench").stats()
        repeats = 20 if quick else 100
        out.append({"item": "stats published per step", "sequences": n,
                    "before_ms": cpu_ms(repeats, _stats_before, counters, scheduler, idle),
                    "after_ms": cpu_ms(repeats, counters.snapshot, scheduler, "bench")})
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


# ------------------------------------------------------------------ call triggers
TRIGGER_STEPS = 100
PROSE = b"The forecast for Paris is sunny, with a light breeze from the west and no rain until Sunday. " * 4


def _auto_replies(n: int, watched: bool) -> None:
    """``TRIGGER_STEPS`` steps of ``n`` native auto replies writing prose, each piece through the
    reply parser, and (``watched``) the call trigger."""
    hermes = ToolCallFormat.HERMES
    parsers = [ReplyParser(tool_format=hermes, call_id_prefix="call", reasoning=True) for _ in range(n)]
    triggers = [CallTrigger(hermes, reasoning=True, starts_in_reasoning=False) for _ in range(n)] if watched else []
    for step in range(TRIGGER_STEPS):
        piece = PROSE[step * 4 % len(PROSE):][:4]
        text = piece.decode()
        for parser in parsers:
            parser.push(text)
        for trigger in triggers:
            trigger.push(piece)


def _bench_triggers(quick: bool) -> list[dict[str, Any]]:
    repeats = 3 if quick else 7
    out = []
    for n in SEQUENCES:
        progress(f"call triggers: {n} auto replies x {TRIGGER_STEPS} steps")
        out.append({"item": "tool_choice auto, a plain-text step (parser, + call trigger)", "sequences": n,
                    "before_ms": cpu_ms(repeats, _auto_replies, n, False) / TRIGGER_STEPS,
                    "after_ms": cpu_ms(repeats, _auto_replies, n, True) / TRIGGER_STEPS})
    return out


async def run(quick: bool) -> tuple[dict[str, Any], str]:
    measured = [*_bench_logprobs(quick), *_bench_masks(quick), *_bench_prefix(quick), *_bench_stats(quick),
                *_bench_replies(quick), *_bench_triggers(quick)]
    rows = [[m["item"], str(m["sequences"]), f"{m['before_ms']:.3g}", f"{m['after_ms']:.3g}",
             f"{m['before_ms'] / m['after_ms']:.1f}x"] for m in measured]
    table = markdown_table(["per step", "sequences", "before, CPU ms", "after, CPU ms", "speed-up"], rows)
    write_results("step_costs", {"measured": measured}, table, "slotq bench step-costs" + (" --quick" if quick else ""))
    return {"measured": measured}, table
