"""Speculative decoding: draft tokens, and the rule that decides where a draft pays.

A generating sequence may add up to ``k`` draft tokens after its real one in the shared
``llama_decode`` (the runner asks for logits at each); the runner then samples those rows in order
and keeps each draft token that equals what it sampled (see ``Runner._verify``). Sampling every row
with the sequence's own chain and stopping at the first mismatch is exact for every sampler: each
kept token was drawn from the model's distribution given the tokens before it, so greedy output is
the same token for token, and a seeded sampler draws the same numbers (one per delivered token).
For a draft that is one token per position -- n-gram lookup, a greedy draft model -- this is the
same test as rejection sampling: a draft token is kept with probability p(draft), and a rejected
one is replaced by a sample from p without it.

Where drafts come from (:class:`Drafter`): :class:`NgramDrafter` looks the sequence's last tokens
up in its own prompt and output (prompt lookup: no second model); a draft model
(``engine/draft_model.py``) drafts for every sequence in one batch of its own.

Where a draft goes (:class:`DraftPlanner`, a pure policy the scheduler consults): a step costs
time that grows with its tokens (:class:`StepCost`, measured on this model and device), and each
draft token is worth the chance that it and every draft token before it are accepted. The planner
adds draft tokens, most likely first, while they raise the step's expected tokens per second by at
least :data:`MIN_GAIN`; so drafting stops where a step is compute-bound (many sequences on a CPU, a
full GPU batch), and a sequence whose drafts miss stops drafting. What the table cannot see (the
delivery of a step's tokens, beside the next decode) is measured: per concurrency, steps with drafts
must deliver more tokens per second than steps without, or the required gain rises there
(:meth:`DraftPlanner.observe_step`). Declining is cheap: an upper bound, a dozen step prices, rules
out a concurrency where no draft can pay before any sequence is asked for a proposal
(:meth:`DraftPlanner.offer_to`), and there only a few sequences a step keep being shadow-tested.
docs/architecture.md, "Speculative decoding", has the figures.

A sequence's acceptance is learned for free where its drafts are n-gram lookups: a draft that was
offered but not sent is still compared with the token the step sampled (a shadow test), so a
sequence that copies its prompt is found out before it ever pays for a draft.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Protocol

import numpy as np

from slotq.engine.sequence import Sequence

MIN_GAIN = 1.1
"""A plan with drafts must promise at least 10 % more tokens per second than the step without them:
the acceptance and step-time estimates are noisy, a wrong draft costs a whole step's share, and
through a worker a step of many tokens also costs a little of the next one (its tokens are
delivered, to Redis and the event loop, while the next decode runs on the same cores)."""

PRIOR_WEIGHT = 2.0
"""How many observations the model-wide acceptance counts for in a sequence's own estimate."""

SEQ_DECAY = 0.95
"""A sequence's acceptance forgets old tests (a window of about 20): a reply that stops copying its
prompt stops drafting within a few steps."""

MODEL_DECAY = 0.995
"""The model-wide acceptance (by match length) moves slowly: about 200 tests."""

GATE_REUSE = 16
"""Steps for which :meth:`DraftPlanner.offer_to` reuses its answer at one concurrency (the step cost
moves by a few per cent a step)."""

DECLINE_SLACK = 1.05
"""While the gate is closed, an offer whose expected kept tokens are within 5 % of the best offer
a full plan found nothing for is declined without pricing (the plan needs 10 % more: MIN_GAIN)."""

GATE_MAX_REUSE = 256
"""Where full plans keep finding nothing that pays at one concurrency, each closes the gate for
twice as many steps as the one before, up to this many: the cost of pricing every sequence's
offer is then spread over hundreds of steps, while probes go on."""

PROBE_SEQS = 4
"""Where no draft can pay, this many sequences a step still propose, in turn, to be shadow-tested."""

REALISED_DECAY = 0.98
"""Steps' realised tokens per second are averaged over about 50 periods of each kind."""

MIN_EVIDENCE_S = 0.2
"""Seconds of steps of each kind, with drafts and without, before their rates are compared."""

PENALTY_UP = 1.25
"""The factor by which one step with drafts, while steps with drafts have realised less than steps
without, raises the required gain at its concurrency: six such steps take it to the cap."""

PENALTY_DOWN = 1.05
"""The factor by which one step with drafts, while they have realised more, lowers it: slower than
it rises, so noise around break-even leans towards not drafting (the default's promise)."""

MAX_PENALTY = 4.0
"""At most this penalty: a plan must then promise 4.4x the plain step, which only long, sure copies do."""

PENALTY_FORGET = 0.995
"""Each step without drafts takes this share of the penalty's excess back (about 140 steps to halve
it), so a concurrency where drafts once lost is tried again after a while."""

IDLE_FACTOR = 4.0
"""A period longer than this many times its step's own time waited for work: it prices nothing."""

INDEX_TABLE_SIZE = 1 << 14
"""Slots of an n-gram index's hash table (int32: 64 KiB a sequence). A 32k-token context puts two
positions in a slot on average, so a chain walk rarely passes more than a few strangers."""

INDEX_CHAIN = 16
"""Candidates a lookup checks, latest first: past them an older, longer agreement is missed."""

INDEX_CHUNK = 4096
"""Tokens an index takes in one proposal: a 32k-token prompt is indexed over its first 8 steps
(under 1 ms each) rather than in one."""

VECTORISE_FROM = 32
"""Runs of at least this many new tokens are indexed with numpy; fewer (a step's), one by one."""

_HASH_MULTIPLIER = 0x9E3779B1

MATCH_CAP = 64
"""An n-gram draft's agreement is counted up to this many tokens back."""


@dataclass
class Proposal:
    """What a drafter could add after a sequence's last token: ``n`` tokens, known already
    (``tokens``, an n-gram lookup: free) or made on demand by :meth:`Drafter.draft` (a draft model)."""

    n: int
    tokens: list[int] | None = None
    match: int = 0      # tokens before the draft that agree with what it was copied from (0: not a copy)


class Drafter(Protocol):
    """Proposes draft tokens for running sequences. Engine thread only."""

    prior: float
    """The chance a draft token is accepted, before any was tested (the planner's starting estimate)."""

    def propose(self, seq: Sequence, k_max: int) -> Proposal:
        """What could follow ``seq.tokens`` (at most ``k_max`` tokens; ``n`` 0 for nothing)."""
        ...

    def draft(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Drafts for proposals made without tokens: at most ``n`` tokens continuing each
        sequence's tokens, in the order given."""
        ...

    def draft_seconds(self, depth: int, n_seqs: int) -> float:
        """The time :meth:`draft` takes to draft ``depth`` tokens for ``n_seqs`` sequences (0 for free lookups)."""
        ...

    def prepare(self) -> None:
        """On the engine thread, before its first step: time what needs timing. Every llama.cpp
        call runs on that one thread: a decode from another thread (with llama.cpp's OpenMP build)
        starts a second team of worker threads, and every later step ran twice as slow."""
        ...

    def forget(self, seq: Sequence) -> None:
        """``seq`` finished: drop what was kept for it."""
        ...

    def close(self) -> None:
        """The engine closed: free what the drafter holds (a draft model's context)."""
        ...


class _NgramIndex:
    """Where each ``n_min``-gram of a sequence's tokens occurred, as a hash chain (zlib's matcher):
    ``head`` maps a hash of the n-gram before a position to the latest such position, ``prev`` each
    position to the one before it with the same hash. Positions are those of the token that followed
    the n-gram, so the draft starts there. A lookup walks the chain from the latest occurrence and
    checks each candidate against the tokens themselves (hashes collide), so longer agreements are
    found without a map per n. Its memory is bounded: ``head`` is :data:`INDEX_TABLE_SIZE` int32
    (64 KiB), ``prev`` 4 bytes per indexed token (plus ``array``'s few per cent of spare room)."""

    def __init__(self, n_min: int) -> None:
        self.n_min = n_min
        self.head = np.full(INDEX_TABLE_SIZE, -1, dtype=np.int32)
        self.prev = array("i", [-1] * n_min)     # positions before the first n-gram have none
        self.indexed = n_min                     # positions below this are in the chains

    def nbytes(self) -> int:
        """The bytes the index holds (its table and chain)."""
        return self.head.nbytes + self.prev.buffer_info()[1] * self.prev.itemsize

    def _hash(self, tokens: list[int], end: int) -> int:
        """The table slot of the ``n_min`` tokens before ``end``."""
        h = tokens[end - self.n_min]
        for token in tokens[end - self.n_min + 1:end]:
            h = ((h * _HASH_MULTIPLIER) ^ token) & 0xFFFFFFFF
        return h & (INDEX_TABLE_SIZE - 1)

    def extend(self, tokens: list[int], limit: int = INDEX_CHUNK) -> None:
        """Index up to ``limit`` more positions that have a token after their n-gram (the tail's
        n-gram has no continuation yet, so it is indexed once the next token arrives): a long
        prompt is indexed over several steps, a few per step one token at a time, a long run at once
        with numpy."""
        end = min(len(tokens) - 1, self.indexed + limit - 1)
        if end < self.indexed:
            return
        if end - self.indexed < VECTORISE_FROM:
            for i in range(self.indexed, end + 1):
                h = self._hash(tokens, i)
                self.prev.append(int(self.head[h]))
                self.head[h] = i
        else:
            self._extend_vectorised(tokens, end)
        self.indexed = end + 1

    def _extend_vectorised(self, tokens: list[int], end: int) -> None:
        """:meth:`extend` of positions ``indexed`` to ``end`` at once: the same hashes, in numpy;
        within the run each position's predecessor is the one before it among equal hashes (a
        stable sort), the run's first of each hash links to the table, the last becomes its head."""
        start, n = self.indexed, self.n_min
        count = end - start + 1
        window = np.asarray(tokens[start - n:end], dtype=np.uint64)
        keys = window[:count].copy()
        for k in range(1, n):
            keys = ((keys * np.uint64(_HASH_MULTIPLIER)) ^ window[k:k + count]) & np.uint64(0xFFFFFFFF)
        keys = (keys & np.uint64(INDEX_TABLE_SIZE - 1)).astype(np.int64)
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        positions = (order + start).astype(np.int32)
        first = np.ones(count, dtype=bool)
        first[1:] = sorted_keys[1:] != sorted_keys[:-1]
        before = np.empty(count, dtype=np.int32)
        before[1:] = positions[:-1]
        before[first] = self.head[sorted_keys[first]]
        chain = np.empty(count, dtype=np.int32)
        chain[order] = before
        self.prev.frombytes(chain.tobytes())
        last = np.ones(count, dtype=bool)
        last[:-1] = first[1:]
        self.head[sorted_keys[last]] = positions[last]

    def lookup(self, tokens: list[int], n_max: int) -> int:
        """The latest indexed position whose preceding tokens agree with the last ``n_max`` tokens,
        else the latest with the longest agreement of at least ``n_min`` (among the first
        :data:`INDEX_CHAIN` candidates of the tail's hash); -1 for none."""
        end = len(tokens)
        if end < self.n_min:
            return -1
        best, best_agreement = -1, self.n_min - 1
        position = int(self.head[self._hash(tokens, end)])
        for _ in range(INDEX_CHAIN):
            if position < 0:
                break
            agreement = _agreement(tokens, position, n_max)
            if agreement >= n_max:
                return position
            if agreement > best_agreement:
                best, best_agreement = position, agreement
            position = self.prev[position]
        return best


class NgramDrafter:
    """Prompt lookup: the sequence's last ``n`` tokens (longest n first, ``n_max`` down to
    ``n_min``) are looked up in its own earlier tokens, prompt and output; the tokens that followed
    their latest occurrence are the draft. A copy of the prompt (a rewrite, an extraction, a quoted
    summary) drafts itself; free text rarely finds a long match, and the planner learns that. The
    index (:class:`_NgramIndex`) costs a hash and two array writes per token, 4 bytes per token and
    64 KiB per sequence, and indexes at most :data:`INDEX_CHUNK` tokens a proposal (a long prompt's
    over its first steps)."""

    prior = 0.5     # shadow tests (see the module docstring) replace it within a few tokens

    def __init__(self, n_min: int = 2, n_max: int = 4) -> None:
        self.n_min, self.n_max = n_min, n_max
        self._indexes: dict[Sequence, _NgramIndex] = {}

    def propose(self, seq: Sequence, k_max: int) -> Proposal:
        index = self._indexes.get(seq)
        if index is None:
            index = self._indexes[seq] = _NgramIndex(self.n_min)
        tokens = seq.tokens
        index.extend(tokens)
        start = index.lookup(tokens, self.n_max)
        if start < 0:
            return Proposal(0)
        draft = tokens[start:start + k_max]
        return Proposal(len(draft), draft, match=_agreement(tokens, start))

    def index_bytes(self, seq: Sequence) -> int:
        """What ``seq``'s index holds (0 before its first proposal)."""
        index = self._indexes.get(seq)
        return index.nbytes() if index is not None else 0

    def draft(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        raise RuntimeError("n-gram proposals carry their tokens; nothing is drafted on demand")

    def draft_seconds(self, depth: int, n_seqs: int) -> float:
        return 0.0

    def prepare(self) -> None:
        pass

    def forget(self, seq: Sequence) -> None:
        self._indexes.pop(seq, None)

    def close(self) -> None:
        self._indexes.clear()


def _agreement(tokens: list[int], start: int, cap: int = MATCH_CAP) -> int:
    """How many tokens before the end agree with those before ``start`` (at most ``cap``)."""
    n, end = 0, len(tokens)
    while n < cap and n < start and tokens[end - 1 - n] == tokens[start - 1 - n]:
        n += 1
    return n


class StepCost:
    """Seconds one step takes: its ``llama_decode`` plus the fixed share around it (scheduling,
    sampling, events), on this model and device.

    llama.cpp runs a batch as micro-batches, one graph run each, and each run pays for reading the
    weights. With a KV stream per sequence (``split_streams``) a micro-batch takes the same number
    of tokens from every sequence in it (``split_equal``): sequences of 17, 9, 5 and 1 tokens run
    as 4 x 1, 3 x 4, 2 x 4 and 1 x 8 tokens, four runs. So a step is costed by its micro-batches
    (:meth:`micro_batches`), each from a table of decode times by token count, measured at start
    (:meth:`calibrate`: one sequence's decode of 1, 2, 4, ... tokens) and kept current from every
    real step (:meth:`observe`: the whole table moves toward what it took, by :attr:`rate`).
    Between measured sizes it interpolates; beyond the largest it extrapolates the last slope."""

    def __init__(self, seconds_by_tokens: dict[int, float], *, split_streams: bool = True, ubatch: int = 512,
                 overhead_s: float = 0.0, rate: float = 0.05) -> None:
        if not seconds_by_tokens:
            raise ValueError("StepCost needs at least one measured size")
        self.sizes = sorted(seconds_by_tokens)
        self.seconds = [seconds_by_tokens[n] for n in self.sizes]
        self._keep_monotonic()
        self.split_streams = split_streams
        self.ubatch = ubatch
        self.overhead_s = overhead_s
        self.rate = rate

    def _keep_monotonic(self) -> None:
        """More tokens never take less time: a noisy measurement (a busy neighbour during the
        timing of 2 tokens) must not make 4 look cheaper than 2."""
        for i in range(1, len(self.seconds)):
            self.seconds[i] = max(self.seconds[i], self.seconds[i - 1])

    @classmethod
    def calibrate(cls, decode: Callable[[int], float], max_tokens: int, repeats: int = 3, *,
                  split_streams: bool = True, ubatch: int = 512) -> StepCost:
        """Time ``decode(n)`` (it returns seconds) at n = 1, 2, 4, ... up to ``max_tokens``; the
        fastest of ``repeats`` runs counts (this machine may be shared)."""
        sizes = [1]
        while sizes[-1] * 2 <= max_tokens:
            sizes.append(sizes[-1] * 2)
        return cls({n: min(decode(n) for _ in range(repeats)) for n in sizes}, split_streams=split_streams,
                   ubatch=ubatch)

    def decode_seconds(self, n_tokens: int) -> float:
        """One micro-batch of ``n_tokens``."""
        sizes, secs = self.sizes, self.seconds
        if len(sizes) == 1:
            return secs[0] * n_tokens / sizes[0]
        i = bisect.bisect_left(sizes, n_tokens)
        if i < len(sizes) and sizes[i] == n_tokens:
            return secs[i]
        lo = min(max(i - 1, 0), len(sizes) - 2)      # the segment around n (the last one beyond)
        x0, x1, y0, y1 = sizes[lo], sizes[lo + 1], secs[lo], secs[lo + 1]
        return max(y0 + (y1 - y0) * (n_tokens - x0) / (x1 - x0), secs[0] * 0.5)

    def micro_batches(self, lengths: Iterable[int]) -> list[int]:
        """The token counts of the micro-batches a batch of sequences with ``lengths`` tokens runs as."""
        counts: dict[int, int] = {}
        for n in lengths:
            if n > 0:
                counts[n] = counts.get(n, 0) + 1
        return self.micro_batches_of(counts)

    def micro_batches_of(self, counts: dict[int, int]) -> list[int]:
        """:meth:`micro_batches` of a batch given as {tokens: how many sequences have that many}: its
        cost grows with the distinct lengths, not the sequences (the planner prices many plans a step)."""
        if not self.split_streams:
            total = sum(n * c for n, c in counts.items())
            return [self.ubatch] * (total // self.ubatch) + ([total % self.ubatch] if total % self.ubatch else [])
        left = sorted((n, c) for n, c in counts.items() if n > 0 and c > 0)
        runs: list[int] = []
        while left:
            seqs = sum(c for _, c in left)
            take = min(left[0][0], max(1, self.ubatch // seqs))
            runs.append(take * seqs)
            left = [(n - take, c) for n, c in left if n > take]
        return runs

    def step_seconds(self, lengths: Iterable[int]) -> float:
        """A step whose sequences contribute ``lengths`` tokens each."""
        return sum(self.decode_seconds(n) for n in self.micro_batches(lengths)) + self.overhead_s

    def step_seconds_of(self, counts: dict[int, int]) -> float:
        """:meth:`step_seconds` of a batch given as {tokens: sequences} (see :meth:`micro_batches_of`)."""
        return sum(self.decode_seconds(n) for n in self.micro_batches_of(counts)) + self.overhead_s

    def observe(self, lengths: list[int], decode_s: float, step_s: float | None = None) -> None:
        """A real step: ``decode_s`` in llama_decode for sequences of ``lengths`` tokens; ``step_s``
        all of it (the fixed share is what the step took beyond the decode). The whole table moves
        by one factor, keeping the shape timed at start: a step's time also holds what the rest of
        the process did meanwhile (the event loop handing out the step before's tokens), which
        would otherwise be charged to whichever size ran then, and a plain step that ran slow
        beside a burst of delivery would make the next draft look cheap."""
        predicted = sum(self.decode_seconds(n) for n in self.micro_batches(lengths))
        if predicted > 0 and decode_s > 0:
            ratio = min(max(decode_s / predicted, 0.25), 4.0)     # one stalled step must not rewrite the table
            factor = 1 + self.rate * (ratio - 1)
            self.seconds = [t * factor for t in self.seconds]
        if step_s is not None and step_s >= decode_s:
            self.overhead_s += self.rate * ((step_s - decode_s) - self.overhead_s)


@dataclass
class _Acceptance:
    """A decayed count of draft positions tested and accepted."""

    tested: float = 0.0
    accepted: float = 0.0

    def add(self, tested: int, accepted: int, decay: float) -> None:
        for _ in range(tested):
            self.tested *= decay
            self.accepted *= decay
        self.tested += tested
        self.accepted += accepted


@dataclass
class _Realised:
    """Decayed tokens delivered and seconds taken by steps of one kind (with drafts, or without)."""

    tokens: float = 0.0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = self.tokens * REALISED_DECAY + tokens
        self.seconds = self.seconds * REALISED_DECAY + seconds

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Concurrency:
    """What steps at one concurrency (generating sequences, by powers of two) realised, with drafts and
    without, and the penalty the planner's required gain carries there (1: none)."""

    plain: _Realised = field(default_factory=_Realised)
    drafted: _Realised = field(default_factory=_Realised)
    penalty: float = 1.0


@dataclass
class _Step:
    """A generating step, kept until the next one starts: its period is then known."""

    started: float
    seconds: float
    n_generating: int
    tokens: int
    drafted: bool


@dataclass
class _Gate:
    """:meth:`DraftPlanner.offer_to`'s answer for a concurrency, reused for a few steps."""

    n_generating: int
    best: float                         # the best acceptance it was priced with
    steps_left: int
    open: bool
    declined: tuple[float, int] = (-1.0, 0)     # the best offer (acceptance, room) a full plan found nothing for
    declined_gain: float = 0.0                  # ... at this required gain
    period: int = 0                             # steps a decline closes it for: doubles while full plans decline


@dataclass
class DraftPlanner:
    """Decides how many draft tokens each generating sequence adds to a step (see the module
    docstring). Pure: it sees sequences, proposals, the step cost and what verification reported."""

    cost: StepCost
    k_min: int = 2
    k_max: int = 16
    prior: float = 0.5                  # model-wide acceptance before anything was tested
    draft_seconds: Callable[[int, int], float] = lambda depth, n_seqs: 0.0    # Drafter.draft_seconds
    _by_match: dict[int, _Acceptance] = field(default_factory=dict)
    _seqs: dict[Sequence, _Acceptance] = field(default_factory=dict)
    _by_concurrency: dict[int, _Concurrency] = field(default_factory=dict)
    _last_step: _Step | None = None
    _gate: _Gate = field(default_factory=lambda: _Gate(-1, 0.0, 0, False))
    _probe_next: int = 0                # where the next probe slice starts (see offer_to)

    def model_acceptance(self, match: int = 0) -> float:
        """The model-wide share of tested draft positions that were accepted, for proposals whose
        copy agreed over about ``match`` tokens (by powers of two: 1, 2-3, 4-7 ... 32 and more)."""
        m = self._by_match.get(_match_class(match))
        if m is None:
            return self.prior
        return (m.accepted + PRIOR_WEIGHT * self.prior) / (m.tested + PRIOR_WEIGHT)

    def acceptance(self, seq: Sequence, match: int = 0) -> float:
        """The chance that the next draft token of ``seq``, with a proposal whose copy agreed over
        ``match`` tokens, is accepted given the one before was: the lower of what the model's
        proposals of that agreement and this sequence's recent drafts say. A sequence that copies
        its prompt drafts long once its copy agrees over many tokens, and not just after it
        diverged; one that does not copy does not draft on a chance agreement."""
        by_match = self.model_acceptance(match)
        own = self._seqs.get(seq)
        if own is None:
            return by_match
        return min(by_match, (own.accepted + PRIOR_WEIGHT * by_match) / (own.tested + PRIOR_WEIGHT))

    def required_gain(self, n_generating: int) -> float:
        """How much more tokens per second a plan must promise than the step without drafts:
        :data:`MIN_GAIN`, times the penalty that steps with drafts at this concurrency earned by
        delivering fewer tokens per second, measured, than steps without (:meth:`observe_step`)."""
        bucket = self._by_concurrency.get(n_generating.bit_length())
        return MIN_GAIN * (bucket.penalty if bucket is not None else 1.0)

    def offer_to(self, decoding: list[Sequence]) -> list[Sequence]:
        """The generating sequences whose drafter should propose this step. All of them where a
        draft could pay at this concurrency (:meth:`_could_pay` with the best acceptance any
        agreement class has shown); where none could, a slice of :data:`PROBE_SEQS` of them in
        turn, so proposals keep being shadow-tested (a workload that starts copying is found out)
        at a cost bounded per step whatever the concurrency. The answer for a concurrency is kept
        for :data:`GATE_REUSE` steps while the best acceptance stays the same; a full plan that
        found nothing paying (:meth:`plan`) closes it for longer each time (:data:`GATE_MAX_REUSE`)."""
        n = len(decoding)
        if n == 0:
            return []
        best = self._best_acceptance()
        gate = self._gate
        if gate.n_generating != n or gate.best != best or gate.steps_left <= 0:
            base = self.cost.step_seconds_of({1: n})
            is_open = self._could_pay(n, {}, n, best, self.k_max, n / base * self.required_gain(n))
            same = gate.n_generating == n
            gate = self._gate = _Gate(n, best, GATE_REUSE, is_open, gate.declined if same else (-1.0, 0),
                                      gate.declined_gain if same else 0.0, gate.period if same else 0)
        gate.steps_left -= 1
        if gate.open:
            return decoding
        start = self._probe_next % n
        self._probe_next = start + PROBE_SEQS
        return (decoding[start:] + decoding[:start])[:PROBE_SEQS]

    def _best_acceptance(self) -> float:
        """The best model-wide acceptance of any agreement class (the prior for those not tested),
        rounded so that the gate's answer is reused while it barely moves."""
        return round(max([self.prior] + [self.model_acceptance(1 << (c - 1) if c else 0) for c in self._by_match]), 2)

    def _could_pay(self, n_generating: int, prompts: dict[int, int], n_offers: int, p: float, k_top: int,
                   need_rate: float) -> bool:
        """Whether any plan of :meth:`plan` could reach ``need_rate`` tokens per second, bounded from
        above: every drafting sequence accepted at ``p`` with the longest room ``k_top``, at the
        cost of the shortest room (``k_min``). A dozen step prices, whatever the sequences: what a
        declined step costs."""
        return any(self._could_pay_with(j, n_generating, prompts, p, k_top, need_rate) for j in _prefix_sizes(n_offers))

    def _could_pay_with(self, j: int, n_generating: int, prompts: dict[int, int], p: float, k_top: int,
                        need_rate: float) -> bool:
        """:meth:`_could_pay` for plans that draft for exactly ``j`` sequences."""
        counts = dict(prompts)
        counts[1] = counts.get(1, 0) + n_generating - j
        counts[1 + self.k_min] = counts.get(1 + self.k_min, 0) + j
        return (n_generating + j * _expected(p, k_top)) / self.cost.step_seconds_of(counts) > need_rate

    def plan(self, offers: Iterable[tuple[Sequence, Proposal]], *, prompt_lengths: list[int], n_generating: int,
             budget: int) -> dict[Sequence, int]:
        """Draft tokens per sequence for a step with ``n_generating`` decode tokens (each yields a
        token) and prompt chunks of ``prompt_lengths``, at most ``budget`` draft tokens in all.
        ``offers`` are what each generating sequence's drafter could propose (``n`` already capped
        by the sequence's limits); a proposal without tokens costs :attr:`draft_seconds` to make.

        The drafting sequences all get the same room k (or their whole offer, if shorter): unequal
        lengths would split the step into more micro-batches (:class:`StepCost`). The plan tried
        are: the j sequences most likely to be accepted, each with room k, for every k and j; the
        one with the most expected tokens per second wins if it beats no drafts by
        :meth:`required_gain`. An upper bound (:meth:`_could_pay`) declines first, so a step
        where nothing can pay costs a dozen step prices."""
        eligible: list[tuple[float, int, Sequence, bool]] = []
        for seq, proposal in offers:
            k = min(proposal.n, self.k_max)
            if k >= self.k_min:
                eligible.append((self.acceptance(seq, proposal.match), k, seq, proposal.tokens is None))
        if not eligible or budget < self.k_min or n_generating == 0:
            return {}
        prompts: dict[int, int] = {}
        for n in prompt_lengths:
            prompts[n] = prompts.get(n, 0) + 1
        base = dict(prompts)
        base[1] = base.get(1, 0) + n_generating
        best_rate = n_generating / self.cost.step_seconds_of(base) * self.required_gain(n_generating)
        eligible.sort(key=lambda e: -e[0])
        p_top, k_top = eligible[0][0], max(e[1] for e in eligible)
        gate = self._gate
        if (not prompt_lengths and gate.n_generating == n_generating and not gate.open and gate.steps_left > 0
                and _expected(p_top, k_top) <= _expected(*gate.declined) * DECLINE_SLACK
                and self.required_gain(n_generating) >= gate.declined_gain):
            return {}           # no better offer than a full plan found nothing for, a few steps ago
        sizes = [j for j in _prefix_sizes(len(eligible))
                 if self._could_pay_with(j, n_generating, prompts, p_top, k_top, best_rate)]
        if not sizes:
            return {}
        gains = [list(accumulate(p ** depth for depth in range(1, k + 1))) for p, k, _, _ in eligible]
        best: tuple[int, int] = (0, 0)
        for j in sizes:
            for room in _rooms(self.k_min, self.k_max):
                rooms = [min(room, k) for _, k, _, _ in eligible[:j]]
                if sum(rooms) > budget:
                    break
                expected = n_generating + sum(g[r - 1] for g, r in zip(gains, rooms))
                counts = dict(prompts)
                counts[1] = counts.get(1, 0) + n_generating - j
                for r in rooms:
                    counts[1 + r] = counts.get(1 + r, 0) + 1
                seconds = self.cost.step_seconds_of(counts)
                made = [r for r, e in zip(rooms, eligible) if e[3]]
                if made:
                    seconds += self.draft_seconds(max(made), len(made))
                if expected / seconds > best_rate:
                    best_rate, best = expected / seconds, (j, room)
                if room >= max(k for _, k, _, _ in eligible[:j]):
                    break           # every offer is used up: a larger room changes nothing
        j, room = best
        if j == 0 and not prompt_lengths:       # priced in full, and nothing paid: offer_to probes for a while
            last = self._gate
            period = min(max(last.period * 2, GATE_REUSE), GATE_MAX_REUSE) if last.n_generating == n_generating \
                else GATE_REUSE
            self._gate = _Gate(n_generating, self._best_acceptance(), period, False, (p_top, k_top),
                               self.required_gain(n_generating), period)
        elif j:
            self._gate.declined, self._gate.period = (-1.0, 0), 0
        return {seq: min(room, k) for _, k, seq, _ in eligible[:j]}

    def observe(self, seq: Sequence, tested: int, accepted: int, match: int = 0) -> None:
        """Verification (or a shadow test) compared ``tested`` draft positions of a proposal whose
        copy agreed over ``match`` tokens; ``accepted`` matched."""
        if tested <= 0:
            return
        self._seqs.setdefault(seq, _Acceptance()).add(tested, accepted, SEQ_DECAY)
        self._by_match.setdefault(_match_class(match), _Acceptance()).add(tested, accepted, MODEL_DECAY)

    def observe_step(self, lengths: list[int], decode_s: float, step_s: float, *, started: float,
                     n_generating: int, tokens: int, drafted: bool) -> None:
        """A generating step that began at ``started`` (``time.perf_counter``): ``decode_s`` in
        llama_decode for sequences of ``lengths`` tokens, ``step_s`` on the engine thread, giving
        ``n_generating`` decoding sequences ``tokens`` tokens, ``drafted`` or not. The step cost
        learns from it (:meth:`StepCost.observe`). The step before is priced whole: its period, from
        its start to this one's, holds what its tokens cost to deliver too (the worker's event
        loop shares the process and the cores). Per concurrency, steps with drafts must realise
        more tokens per second than steps without; where they do not, the required gain there
        rises by :data:`PENALTY_UP` (and falls back by :data:`PENALTY_DOWN` as they do, or slowly
        while none are sent)."""
        self.cost.observe(lengths, decode_s, step_s)
        last, self._last_step = self._last_step, _Step(started, step_s, n_generating, tokens, drafted)
        if last is None:
            return
        period = started - last.started
        if period <= 0 or period > IDLE_FACTOR * last.seconds:      # it waited for work between: no price
            return
        bucket = self._by_concurrency.setdefault(last.n_generating.bit_length(), _Concurrency())
        (bucket.drafted if last.drafted else bucket.plain).add(last.tokens, period)
        if not last.drafted:
            bucket.penalty = 1 + (bucket.penalty - 1) * PENALTY_FORGET
        elif bucket.plain.seconds >= MIN_EVIDENCE_S and bucket.drafted.seconds >= MIN_EVIDENCE_S:
            if bucket.drafted.rate < bucket.plain.rate:
                bucket.penalty = min(bucket.penalty * PENALTY_UP, MAX_PENALTY)
            else:
                bucket.penalty = max(1.0, bucket.penalty / PENALTY_DOWN)

    def forget(self, seq: Sequence) -> None:
        self._seqs.pop(seq, None)


def propose_drafts(drafter: Drafter, planner: DraftPlanner, running: Iterable[Sequence],
                   ctx_per_seq: int) -> dict[Sequence, Proposal]:
    """What the drafter could add after the last token of each generating sequence the planner
    wants offers from (:meth:`DraftPlanner.offer_to`), capped so the drafts stay inside the
    sequence's context (the scheduler caps them by max_tokens)."""
    decoding = [seq for seq in running if seq.fork_of is None and seq.is_decoding]
    proposals: dict[Sequence, Proposal] = {}
    for seq in planner.offer_to(decoding):
        room = min(planner.k_max, ctx_per_seq - len(seq.tokens))
        if room > 0:
            proposals[seq] = drafter.propose(seq, room)
    return proposals


def _prefix_sizes(n: int) -> list[int]:
    """How many of the n most likely sequences a plan drafts for: every count up to 8, then powers
    of two and n (a plan's cost is a few micro-batches; finer steps would cost the step's time)."""
    sizes = list(range(1, min(n, 8) + 1))
    size = 16
    while size < n:
        sizes.append(size)
        size *= 2
    if n > 8:
        sizes.append(n)
    return sizes


def _expected(p: float, k: int) -> float:
    """Expected kept tokens of a draft of ``k`` tokens, each kept with chance ``p`` if the one before was."""
    return sum(p ** depth for depth in range(1, k + 1))


def _rooms(k_min: int, k_max: int) -> list[int]:
    """The rooms a plan tries: every one up to 8, then about 1.5x apart (12, 16, 24, 32 ...) and
    ``k_max``: a room between two of them gains a few per cent at most, and each costs a step price
    per plan size."""
    rooms = list(range(k_min, min(k_max, 8) + 1)) or [k_min]
    k = 12
    while k < k_max:
        if k > k_min:
            rooms.append(k)
        k = k * 4 // 3 if k % 3 == 0 else k * 3 // 2
    if k_max > rooms[-1]:
        rooms.append(k_max)
    return rooms


def _match_class(match: int) -> int:
    return min(match.bit_length(), 6)
