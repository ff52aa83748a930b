"""Log probabilities of generated tokens, from the raw logits row of the step that produced them.

The row is read before the sampler chain and the constraint mask touch it (the mask writes -inf
into the row in place), so a token's logprob is the model's own distribution at that position:
before temperature, penalties, logit bias and constraints. That is what OpenAI reports and what
llama-server reports by default (``post_sampling_probs`` false). Only requests that ask pay for it:
one log-softmax over the vocabulary and one partial sort per generated token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from slotq.engine.events import TokenLogprob, TopLogprob

SIGNIFICANT_DIGITS = 7       # a float32 logit carries about 7; more digits would only lengthen the stream
_Entry = TypeVar("_Entry", bound=TopLogprob)


class RowLogprobs:
    """The log-softmax of one logits row, copied before sampling, and its ``top`` best tokens.

    ``token_bytes`` gives a token's bytes as they appear in generated text (the model's cached
    pieces), so alternatives are named exactly as the chosen token is."""

    def __init__(self, logits: np.ndarray, top: int, token_bytes: Callable[[int], bytes]) -> None:
        peak = float(logits.max())
        self._logprobs = logits - np.float32(peak)              # a new array: the mask may write the row later
        self._logprobs -= np.float32(np.log(np.exp(self._logprobs, dtype=np.float64).sum()))
        self._token_bytes = token_bytes
        self._top: list[TopLogprob] = []
        if top > 0:
            best = np.argpartition(self._logprobs, -top)[-top:]
            order = sorted(best.tolist(), key=lambda t: (-self._logprobs[t], t))
            self._top = [self._describe(t, TopLogprob) for t in order]

    def of(self, token: int) -> TokenLogprob:
        """The sampled ``token``'s entry, with the row's best alternatives."""
        return self._describe(token, TokenLogprob, top=self._top)

    def _describe(self, token: int, kind: type[_Entry], **extra: Any) -> _Entry:
        piece = self._token_bytes(token)
        return kind(id=token, token=token_text(piece), token_bytes=list(piece),
                    logprob=float(f"{self._logprobs[token]:.{SIGNIFICANT_DIGITS}g}"), **extra)


def token_text(piece: bytes) -> str:
    """A token's text as OpenAI shows it: its UTF-8 text, or ``bytes:\\xe2\\x80`` when the piece is
    only part of a character (its bytes still say exactly what it is)."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


__all__ = ["RowLogprobs", "token_text"]
