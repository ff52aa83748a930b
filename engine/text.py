"""Streaming text helpers: UTF-8-safe byte accumulation and stop-string matching.

Pure Python, no model: token pieces arrive as bytes (a multi-byte character can be split across
tokens), and stop strings can be split across tokens too. Both are handled by holding back the
smallest tail that might still change meaning.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field


class Utf8Stream:
    """Turns a stream of byte pieces into text without ever splitting a character.

    An incomplete multi-byte sequence at the end is held until the next piece completes it.
    Invalid bytes become U+FFFD rather than an exception: they are real garbage in the output.
    There is no flush: when generation ends (a length limit, a stop, a cancellation) whatever is
    still held is the start of a character the model never finished, and it is dropped rather
    than emitted as U+FFFD. The tokens that carried it still count as generated; their ids are
    still delivered, so a resumed attempt that replays them completes the character seamlessly.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, piece: bytes) -> str:
        return self._decoder.decode(piece)


@dataclass(slots=True)
class StopMatch:
    """Result of feeding text to a :class:`StopMatcher`."""

    emit: str                      # text safe to send now
    stop: str | None = None        # the stop string found (nothing after it is emitted), else None

    @property
    def stopped(self) -> bool:
        return self.stop is not None


@dataclass
class StopMatcher:
    """Finds stop strings in streamed text and holds back partial matches.

    The stop string itself is never emitted, and the match names it (a client may ask which of its
    stop strings ended the reply: Anthropic's ``stop_sequence``). Text that could be the start of a
    stop string is held until it either completes the match or stops matching.
    """

    stops: list[str]
    _held: str = field(default="", init=False)

    def push(self, text: str) -> StopMatch:
        if not self.stops:
            return StopMatch(emit=text)
        buf = self._held + text
        found = [(at, i) for i, at in enumerate(buf.find(s) for s in self.stops) if at >= 0]
        if found:               # the earliest in the text; of two there, the first in the list
            at, i = min(found)
            self._held = ""
            return StopMatch(emit=buf[:at], stop=self.stops[i])
        keep = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return StopMatch(emit=buf[: len(buf) - keep])

    def flush(self) -> str:
        """Release held text at the end of generation (the partial match never completed)."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best
