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
full GPU batch), and a sequence whose drafts miss stops drafting. docs/architecture.md,
"Speculative decoding", has the figures.

A sequence's acceptance is learned for free where its drafts are n-gram lookups: a draft that was
offered but not sent is still compared with the token the step sampled (a shadow test), so a
sequence that copies its prompt is found out before it ever pays for a draft.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Protocol

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


@dataclass
class _NgramIndex:
    """For each n in [n_min, n_max]: the n tokens before a position -> the latest such position."""

    maps: dict[int, dict[tuple[int, ...], int]]
    indexed: int = 0          # positions below this are in the maps

    def extend(self, tokens: list[int]) -> None:
        """Index every position that has a token after its n-gram (the tail's n-gram has no
        continuation yet, so it is indexed once the next token arrives)."""
        end = len(tokens) - 1
        for n, mapping in self.maps.items():
            for i in range(max(self.indexed, n), end + 1):
                mapping[tuple(tokens[i - n:i])] = i
        self.indexed = max(self.indexed, end + 1)


class NgramDrafter:
    """Prompt lookup: the sequence's last ``n`` tokens (longest n first, ``n_max`` down to
    ``n_min``) are looked up in its own earlier tokens, prompt and output; the tokens that followed
    their latest occurrence are the draft. A copy of the prompt (a rewrite, an extraction, a quoted
    summary) drafts itself; free text rarely finds a long match, and the planner learns that. Each
    new token costs ``n_max - n_min + 1`` dict writes."""

    prior = 0.5     # shadow tests (see the module docstring) replace it within a few tokens

    def __init__(self, n_min: int = 2, n_max: int = 4) -> None:
        self.n_min, self.n_max = n_min, n_max
        self._indexes: dict[Sequence, _NgramIndex] = {}

    def propose(self, seq: Sequence, k_max: int) -> Proposal:
        index = self._indexes.get(seq)
        if index is None:
            index = self._indexes[seq] = _NgramIndex({n: {} for n in range(self.n_max, self.n_min - 1, -1)})
        tokens = seq.tokens
        index.extend(tokens)
        for n, mapping in index.maps.items():
            if len(tokens) <= n:
                continue
            start = mapping.get(tuple(tokens[-n:]))
            if start is not None:
                draft = tokens[start:start + k_max]
                return Proposal(len(draft), draft, match=_agreement(tokens, start))
        return Proposal(0)

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

    def micro_batches(self, lengths: list[int]) -> list[int]:
        """The token counts of the micro-batches a batch of sequences with ``lengths`` tokens runs as."""
        if not self.split_streams:
            total = sum(lengths)
            return [self.ubatch] * (total // self.ubatch) + ([total % self.ubatch] if total % self.ubatch else [])
        left = sorted(n for n in lengths if n > 0)
        runs: list[int] = []
        while left:
            take = min(left[0], max(1, self.ubatch // len(left)))
            runs.append(take * len(left))
            left = [n - take for n in left if n > take]
        return runs

    def step_seconds(self, lengths: list[int]) -> float:
        """A step whose sequences contribute ``lengths`` tokens each."""
        return sum(self.decode_seconds(n) for n in self.micro_batches(lengths)) + self.overhead_s

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

    def plan(self, offers: Iterable[tuple[Sequence, Proposal]], *, prompt_lengths: list[int], n_generating: int,
             budget: int) -> dict[Sequence, int]:
        """Draft tokens per sequence for a step with ``n_generating`` decode tokens (each yields a
        token) and prompt chunks of ``prompt_lengths``, at most ``budget`` draft tokens in all.
        ``offers`` are what each generating sequence's drafter could propose (``n`` already capped
        by the sequence's limits); a proposal without tokens costs :attr:`draft_seconds` to make.

        The drafting sequences all get the same room k (or their whole offer, if shorter): unequal
        lengths would split the step into more micro-batches (:class:`StepCost`). The plan tried
        are: the j sequences most likely to be accepted, each with room k, for every k and j; the
        one with the most expected tokens per second wins if it beats no drafts by MIN_GAIN."""
        eligible: list[tuple[float, int, Sequence, bool]] = []
        for seq, proposal in offers:
            k = min(proposal.n, self.k_max)
            if k >= self.k_min:
                eligible.append((self.acceptance(seq, proposal.match), k, seq, proposal.tokens is None))
        if not eligible or budget < self.k_min or n_generating == 0:
            return {}
        eligible.sort(key=lambda e: -e[0])
        gains = [list(accumulate(p ** depth for depth in range(1, k + 1))) for p, k, _, _ in eligible]
        best_rate = n_generating / self.cost.step_seconds(prompt_lengths + [1] * n_generating) * MIN_GAIN
        best: tuple[int, int] = (0, 0)
        for j in _prefix_sizes(len(eligible)):
            for room in range(self.k_min, self.k_max + 1):
                rooms = [min(room, k) for _, k, _, _ in eligible[:j]]
                if sum(rooms) > budget:
                    break
                expected = n_generating + sum(g[r - 1] for g, r in zip(gains, rooms))
                seconds = self.cost.step_seconds(prompt_lengths + [1] * (n_generating - j) + [1 + r for r in rooms])
                made = [r for r, e in zip(rooms, eligible) if e[3]]
                if made:
                    seconds += self.draft_seconds(max(made), len(made))
                if expected / seconds > best_rate:
                    best_rate, best = expected / seconds, (j, room)
                if room >= max(k for _, k, _, _ in eligible[:j]):
                    break           # every offer is used up: a larger room changes nothing
        j, room = best
        return {seq: min(room, k) for _, k, seq, _ in eligible[:j]}

    def observe(self, seq: Sequence, tested: int, accepted: int, match: int = 0) -> None:
        """Verification (or a shadow test) compared ``tested`` draft positions of a proposal whose
        copy agreed over ``match`` tokens; ``accepted`` matched."""
        if tested <= 0:
            return
        self._seqs.setdefault(seq, _Acceptance()).add(tested, accepted, SEQ_DECAY)
        self._by_match.setdefault(_match_class(match), _Acceptance()).add(tested, accepted, MODEL_DECAY)

    def forget(self, seq: Sequence) -> None:
        self._seqs.pop(seq, None)


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


def _match_class(match: int) -> int:
    return min(match.bit_length(), 6)
