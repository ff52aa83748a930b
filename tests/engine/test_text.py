"""Unit tests of the streaming text helpers (no model)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from slotq.engine.text import StopMatcher, Utf8Stream


def feed(matcher: StopMatcher, pieces: list[str]) -> tuple[str, bool, list[str]]:
    """Push pieces like the runner does: stop pushing once a stop string is found, flush at the
    end otherwise. Returns (all emitted text, stopped, per-push emits)."""
    emits: list[str] = []
    stopped = False
    for piece in pieces:
        m = matcher.push(piece)
        emits.append(m.emit)
        if m.stopped:
            stopped = True
            break
    out = "".join(emits)
    if not stopped:
        out += matcher.flush()
    return out, stopped, emits


# ----------------------------------------------------------------------------- Utf8Stream
def test_utf8_multibyte_split_across_pieces_is_held_until_complete() -> None:
    s = Utf8Stream()
    euro = "€".encode()                       # 3 bytes: e2 82 ac
    assert s.push(b"a" + euro[:1]) == "a"
    assert s.push(euro[1:2]) == ""
    assert s.push(euro[2:] + b"b") == "€b"


def test_utf8_four_byte_char_one_byte_at_a_time() -> None:
    s = Utf8Stream()
    data = "x🦙y".encode()
    out = [s.push(data[i:i + 1]) for i in range(len(data))]
    assert out == ["x", "", "", "", "🦙", "y"]


def test_utf8_invalid_bytes_in_the_text_become_replacement_chars_not_exceptions() -> None:
    s = Utf8Stream()
    assert s.push(b"ok\xff") == "ok\ufffd"
    # A truncated sequence followed by more text is garbage in the middle: replaced.
    assert s.push(b"\xe2\x82") == ""
    assert s.push(b"A") == "\ufffdA"
    # A truncated sequence at the very end is held and never comes out as U+FFFD.
    assert s.push("Пр".encode()[:3]) == "П"


@settings(max_examples=200, deadline=None)
@given(text=st.text(), cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_utf8_any_split_reassembles_exactly_and_never_breaks_a_char(text: str, cuts: list[int]) -> None:
    data = text.encode("utf-8")
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    s = Utf8Stream()
    parts = [s.push(data[a:b]) for a, b in zip(points, points[1:])]
    assert "".join(parts) == text
    assert all("\ufffd" not in p for p in parts) or "\ufffd" in text


@settings(max_examples=300, deadline=None)
@given(text=st.text(min_size=1), stop_at=st.integers(min_value=0, max_value=10_000),
       cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_utf8_stopping_mid_character_emits_the_complete_characters_only(text: str, stop_at: int,
                                                                       cuts: list[int]) -> None:
    """Generation cut at any byte (a length stop between the tokens of one character): the
    output is exactly the characters that were complete, with no U+FFFD for the unfinished one."""
    data = text.encode("utf-8")
    end = stop_at % (len(data) + 1)
    points = sorted({c % (end + 1) for c in cuts} | {0, end})
    s = Utf8Stream()
    out = "".join(s.push(data[a:b]) for a, b in zip(points, points[1:]))
    complete, size = "", 0
    for char in text:
        size += len(char.encode("utf-8"))
        if size > end:
            break
        complete += char
    assert out == complete


# ----------------------------------------------------------------------------- StopMatcher
def test_no_stops_passes_text_through() -> None:
    m = StopMatcher([])
    assert m.push("abc").emit == "abc"
    assert m.flush() == ""


def test_stop_found_in_one_push_is_cut_and_not_emitted() -> None:
    m = StopMatcher(["STOP"])
    r = m.push("hello STOP world")
    assert r.stopped
    assert r.emit == "hello "


def test_stop_split_across_pushes() -> None:
    m = StopMatcher(["</end>"])
    r1 = m.push("answer</e")
    assert (r1.emit, r1.stopped) == ("answer", False)      # "</e" held back: could be the stop
    r2 = m.push("nd> trailing")
    assert r2.stopped
    assert r2.emit == ""
    assert "</end>" not in r1.emit + r2.emit


def test_partial_match_released_by_flush() -> None:
    m = StopMatcher(["###"])
    r = m.push("text ##")
    assert (r.emit, r.stopped) == ("text ", False)
    assert m.flush() == "##"
    assert m.flush() == ""                                   # flush empties the buffer


def test_partial_match_that_diverges_is_released() -> None:
    m = StopMatcher(["abc"])
    assert m.push("xab").emit == "x"
    r = m.push("d")                                          # "abd" can no longer become "abc"
    assert (r.emit, r.stopped) == ("abd", False)
    assert m.flush() == ""


def test_diverging_partial_keeps_a_new_partial() -> None:
    m = StopMatcher(["aab"])
    assert m.push("a").emit == ""
    assert m.push("a").emit == ""
    assert m.push("a").emit == "a"                           # "aaa": still ends with "aa"
    r = m.push("b")
    assert r.stopped and r.emit == ""


def test_multiple_stops_earliest_wins() -> None:
    m = StopMatcher(["world", "lo"])
    r = m.push("hello world")
    assert r.stopped and r.emit == "hel" and r.stop == "lo"           # the match names the stop string


def test_two_stops_at_one_place_name_the_first_listed() -> None:
    assert StopMatcher(["ab", "abc"]).push("xabc").stop == "ab"
    assert StopMatcher(["abc", "ab"]).push("xabc").stop == "abc"
    assert StopMatcher(["abc"]).push("xab").stop is None


def test_multiple_stops_partial_of_one_then_other_completes() -> None:
    m = StopMatcher(["\n\n", "User:"])
    assert m.push("reply\n").emit == "reply"
    r = m.push("Us")                                         # "\n" diverges from "\n\n"; "Us" held
    assert (r.emit, r.stopped) == ("\n", False)
    r = m.push("er: next")
    assert r.stopped and r.emit == "" and r.stop == "User:"


def test_stop_char_by_char() -> None:
    m = StopMatcher(["END"])
    out, stopped, _ = feed(m, list("some text END more"))
    assert stopped
    assert out == "some text "


_alphabet = st.sampled_from("abc\n é")


@st.composite
def _stops(draw: st.DrawFn) -> list[str]:
    """1-3 stop strings, none a substring of another. (With nested stops such as ["abcd", "bc"]
    the cut legitimately depends on where the stream is split: "bc" completes first when the
    text arrives as "abc" + "d", "abcd" starts first when it arrives whole.)"""
    stops = draw(st.lists(st.text(_alphabet, min_size=1, max_size=4), min_size=1, max_size=3, unique=True))
    return [s for s in stops if not any(s != o and s in o for o in stops)]


@settings(max_examples=400, deadline=None)
@given(text=st.text(_alphabet, max_size=40), stops=_stops(),
       cuts=st.lists(st.integers(min_value=0, max_value=1000), max_size=10))
def test_stop_matcher_property_any_split_cuts_at_first_stop(text: str, stops: list[str], cuts: list[int]) -> None:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(points, points[1:])]
    out, stopped, emits = feed(StopMatcher(stops), pieces)
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    expected = text[: min(hits)] if hits else text
    assert out == expected
    assert stopped == bool(hits)
    # Nothing emitted ever contains a stop string (emitted text is final: no take-backs).
    assert not any(s in out for s in stops)
