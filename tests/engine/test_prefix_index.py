"""Pure tests of the prefix index: what idle slots hold, the longest match among them and the
running slots, its ties, and a property against a brute-force reference. How the scheduler uses
the matches (rules 4, 7 and 8) is tested through the scheduler in test_scheduler_kv.py and
test_scheduler_streams.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotq.engine import prefix_index
from slotq.engine.prefix_index import PrefixIndex, PrefixMatch, common_prefix_length

NO_RUNNING: list[tuple[int, list[int], int]] = []


def held(*slots: tuple[int, list[int]]) -> list[tuple[int, list[int], int]]:
    """Running slots whose KV holds all their tokens."""
    return [(slot, tokens, len(tokens)) for slot, tokens in slots]


def _index(*idle: tuple[int, list[int]]) -> PrefixIndex:
    """An index whose idle caches went idle in the order given (the first least recently used)."""
    index = PrefixIndex()
    for slot, tokens in idle:
        index.keep(slot, tokens)
    return index


# ----------------------------------------------------------------------------- empty cases
def test_an_empty_index_matches_nothing() -> None:
    index = PrefixIndex()
    assert not index and len(index) == 0 and index.idle_slots() == []
    assert index.longest_match([1, 2, 3], at_most=2, running=NO_RUNNING) is None


def test_no_shared_first_token_is_no_match() -> None:
    index = _index((0, [5, 6, 7]))
    assert index.longest_match([1, 6, 7], at_most=2, running=held((1, [2, 6, 7]))) is None


def test_empty_tokens_and_a_zero_limit_match_nothing() -> None:
    index = _index((0, [1, 2, 3]), (1, []))
    assert index.longest_match([], at_most=5, running=NO_RUNNING) is None
    assert index.longest_match([1, 2, 3], at_most=0, running=held((2, [1, 2, 3]))) is None


# ----------------------------------------------------------------------------- longest match
def test_the_longest_prefix_wins_among_idle_caches_and_running_slots() -> None:
    index = _index((0, [1, 2, 9]), (1, [1, 2, 3, 4, 8]), (2, [1]))
    match = index.longest_match([1, 2, 3, 4, 5, 6], at_most=5, running=held((3, [1, 2, 3, 7])))
    assert match == PrefixMatch(slot=1, n_tokens=4, idle=True)
    match = index.longest_match([1, 2, 3, 7, 5, 6], at_most=5, running=held((3, [1, 2, 3, 7])))
    assert match == PrefixMatch(slot=3, n_tokens=4, idle=False)


def test_a_match_counts_at_most_the_limit() -> None:
    """The scheduler passes len(tokens) - 1: the last token is computed for fresh logits."""
    index = _index((0, [1, 2, 3, 4]))
    assert index.longest_match([1, 2, 3, 4], at_most=3, running=NO_RUNNING) == PrefixMatch(0, 3, idle=True)


def test_a_match_is_no_longer_than_what_the_slot_holds() -> None:
    index = _index((0, [1, 2]))
    assert index.longest_match([1, 2, 3, 4], at_most=3, running=NO_RUNNING) == PrefixMatch(0, 2, idle=True)


def test_a_running_slot_shorter_than_the_copy_floor_does_not_count() -> None:
    index = _index((0, [1, 2]))
    running = held((1, [1, 2, 3, 4]))
    tokens = [1, 2, 3, 4, 5]
    assert index.longest_match(tokens, at_most=4, running=running, min_running_tokens=5) == PrefixMatch(0, 2, True)
    assert index.longest_match(tokens, at_most=4, running=running, min_running_tokens=4) == PrefixMatch(1, 4, False)


def test_the_copy_floor_does_not_apply_to_idle_caches() -> None:
    index = _index((0, [1, 2]))
    assert index.longest_match([1, 2, 3], at_most=2, running=NO_RUNNING, min_running_tokens=10) == PrefixMatch(
        0, 2, idle=True)


# ----------------------------------------------------------------------------- ties
def test_on_a_tie_an_idle_cache_beats_a_running_slot() -> None:
    """Taking an idle cache over copies nothing; a running slot's cells would be copied."""
    index = _index((5, [1, 2, 3]))
    match = index.longest_match([1, 2, 3, 4], at_most=3, running=held((0, [1, 2, 3, 9])))
    assert match == PrefixMatch(slot=5, n_tokens=3, idle=True)


def test_on_a_tie_among_idle_caches_the_least_recently_used_wins() -> None:
    index = _index((3, [1, 2, 7]), (1, [1, 2, 8]), (2, [1, 2, 9]))
    assert index.longest_match([1, 2, 5], at_most=2, running=NO_RUNNING) == PrefixMatch(3, 2, idle=True)
    index.keep(3, [1, 2, 7])                          # kept again: now the most recently used
    assert index.idle_slots() == [1, 2, 3]
    assert index.longest_match([1, 2, 5], at_most=2, running=NO_RUNNING) == PrefixMatch(1, 2, idle=True)


def test_on_a_tie_among_running_slots_the_first_given_wins() -> None:
    running = held((4, [1, 2, 7]), (0, [1, 2, 8]))
    assert PrefixIndex().longest_match([1, 2, 5], at_most=2, running=running) == PrefixMatch(4, 2, idle=False)


# ----------------------------------------------------------------------------- updates
def test_a_forgotten_cache_matches_no_more() -> None:
    index = _index((0, [1, 2, 3]), (1, [1, 2]))
    index.forget(0)                                   # taken over, or its KV evicted
    assert 0 not in index and 1 in index and index.idle_slots() == [1]
    assert index.longest_match([1, 2, 3, 4], at_most=3, running=NO_RUNNING) == PrefixMatch(1, 2, idle=True)
    index.forget(1)
    assert not index
    assert index.longest_match([1, 2, 3, 4], at_most=3, running=NO_RUNNING) is None


def test_forgetting_a_slot_that_is_no_cache_changes_nothing() -> None:
    index = _index((0, [1]))
    index.forget(7)
    assert index.idle_slots() == [0]


def test_keeping_a_slot_again_replaces_what_it_holds() -> None:
    index = _index((0, [1, 2, 3]))
    index.keep(0, [4, 5])
    assert len(index) == 1
    assert index.longest_match([1, 2, 3], at_most=2, running=NO_RUNNING) is None
    assert index.longest_match([4, 5, 6], at_most=2, running=NO_RUNNING) == PrefixMatch(0, 2, idle=True)


def test_a_returning_cache_is_marked_until_it_is_forgotten_or_kept_again() -> None:
    index = PrefixIndex()
    index.keep(0, [1, 2], returning=True)
    index.keep(1, [1, 3])
    assert index.is_returning(0) and not index.is_returning(1) and not index.is_returning(2)
    index.keep(0, [1, 2])                             # a sequence that ended by itself left it this time
    assert not index.is_returning(0)
    index.keep(1, [1, 3], returning=True)
    index.forget(1)
    assert not index.is_returning(1)


def test_common_prefix_length() -> None:
    assert common_prefix_length([1, 2, 3], [1, 2, 4], 5) == 2
    assert common_prefix_length([1, 2, 3], [1, 2, 3], 2) == 2
    assert common_prefix_length([1, 2], [1, 2, 3], 5) == 2
    assert common_prefix_length([], [1], 5) == 0
    assert common_prefix_length([1], [2], 5) == 0


# ----------------------------------------------------------------------------- property
@dataclass
class _Reference:
    """The index's contract spelled out the slow way: idle caches in a list, least recently used
    first; the best match is the longest, then idle before running, then the earliest."""

    idle: list[tuple[int, list[int]]] = field(default_factory=list)

    def keep(self, slot: int, tokens: list[int]) -> None:
        self.forget(slot)
        self.idle.append((slot, tokens))

    def forget(self, slot: int) -> None:
        self.idle = [(s, t) for s, t in self.idle if s != slot]

    def longest_match(self, tokens: list[int], at_most: int, running: list[tuple[int, list[int]]],
                      min_running_tokens: int) -> PrefixMatch | None:
        def shared(held: list[int]) -> int:
            return max(k for k in range(min(len(held), len(tokens), at_most) + 1) if held[:k] == tokens[:k])

        found = [(shared(held), True, -order, slot) for order, (slot, held) in enumerate(self.idle)]
        found += [(shared(held), False, -order, slot) for order, (slot, held) in enumerate(running)]
        found = [f for f in found if f[0] > 0 and (f[1] or f[0] >= min_running_tokens)]
        if not found:
            return None
        n, idle, _, slot = max(found)
        return PrefixMatch(slot, n, idle)


_tokens = st.lists(st.integers(0, 2), max_size=14)     # a small alphabet: many shared prefixes and ties
_slots = st.integers(0, 5)
_ops = st.lists(st.one_of(st.tuples(st.just("keep"), _slots, _tokens, st.booleans()),
                          st.tuples(st.just("forget"), _slots, st.just([]), st.just(False))), max_size=12)
# A running slot: its tokens, how many its KV holds, and tokens appended before a second lookup.
_running = st.lists(st.tuples(_tokens, st.integers(0, 14), st.lists(st.integers(0, 2), max_size=6)), max_size=3)


@settings(max_examples=300, deadline=None)
@given(ops=_ops, running_slots=_running, query=_tokens, at_most=st.integers(0, 15),
       min_running_tokens=st.integers(0, 4), block_tokens=st.sampled_from([1, 2, 3, 16]))
def test_property_matches_a_brute_force_reference(ops: list[tuple[str, int, list[int], bool]],
                                                  running_slots: list[tuple[list[int], int, list[int]]],
                                                  query: list[int], at_most: int, min_running_tokens: int,
                                                  block_tokens: int) -> None:
    """Whatever the block size, the block hashes find exactly the brute force's matches, also on a
    second lookup after the running sequences computed more tokens (their hashes kept and extended)
    and the sequence looked up runs, and after a running sequence left an idle cache."""
    index, reference = PrefixIndex(block_tokens), _Reference()
    returning: set[int] = set()
    for op, slot, tokens, cancelled in ops:
        if op == "keep":
            index.keep(slot, tokens, returning=cancelled)
            reference.keep(slot, tokens)
            returning.discard(slot)
            if cancelled:
                returning.add(slot)
        else:
            index.forget(slot)
            reference.forget(slot)
            returning.discard(slot)
    assert index.idle_slots() == [slot for slot, _ in reference.idle]
    assert {slot for slot in range(6) if index.is_returning(slot)} == returning
    # Running slots are never idle ones (the scheduler forgets a cache when its slot is taken).
    running = [(10 + i, list(tokens), min(n_held, len(tokens))) for i, (tokens, n_held, _) in enumerate(running_slots)]
    for lookup in range(2):
        expected = reference.longest_match(query, at_most, [(slot, t[:n]) for slot, t, n in running],
                                           min_running_tokens)
        assert index.longest_match(query, at_most=at_most, running=running,
                                   min_running_tokens=min_running_tokens) == expected
        expected_running = _Reference().longest_match(query, at_most, [(slot, t) for slot, t, _ in running], 0)
        assert index.longest_running_match(query, at_most=at_most,
                                           running=[(slot, t, len(t)) for slot, t, _ in running]) == expected_running
        if lookup == 0:
            for (_, tokens, _), (_, _, more) in zip(running, running_slots, strict=True):
                tokens.extend(more)
            running = [(slot, tokens, len(tokens)) for slot, tokens, _ in running]
            running.append((20, query, len(query) // 2))     # the sequence looked up was admitted (hashes reused)
    if running:                                          # the first running sequence leaves an idle cache
        slot, tokens, n_held = running.pop(0)
        index.keep(slot, tokens[:n_held])
        reference.keep(slot, tokens[:n_held])
        assert index.longest_match(query, at_most=at_most, running=running, min_running_tokens=min_running_tokens) \
            == reference.longest_match(query, at_most, [(s, t[:n]) for s, t, n in running], min_running_tokens)


def test_colliding_block_hashes_still_give_the_exact_match(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block hashing alike makes every slot look like a full match; the winner's tokens are
    compared, and the lookup falls back to comparing every slot's tokens."""
    monkeypatch.setattr(prefix_index, "block_hash", lambda parent, block: 0)
    index = PrefixIndex(2)
    index.keep(0, [5, 5, 5, 5, 5, 5])
    index.keep(1, [1, 2, 3, 4, 9, 9])
    assert index.longest_match([1, 2, 3, 4, 5, 6], at_most=5, running=held((7, [1, 2, 8, 8]))) == \
        PrefixMatch(1, 4, idle=True)
    assert index.longest_running_match([1, 2, 3], at_most=2, running=held((7, [1, 2, 8, 8]))) == \
        PrefixMatch(7, 2, idle=False)


def test_a_block_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="block_tokens: must be at least 1"):
        PrefixIndex(0)
