"""Log probabilities of generated tokens, from the raw logits rows of the step that produced them.

The rows are read before the sampler chain and the constraint mask touch them (the mask writes
-inf into a row in place), so a token's logprob is the model's own distribution at that position:
before temperature, penalties, logit bias and constraints. That is what OpenAI reports and what
llama-server reports by default (``post_sampling_probs`` false). Only requests that ask pay for it.

All the rows of one step that need logprobs are computed in one call (:class:`StepLogprobs`): one
float32 log-softmax over the ``[rows x vocab]`` block and one ``argpartition`` of it for the top
alternatives (no full sort), so the numpy overhead is paid once per step, not once per sequence.
The results are slotted dataclasses (:class:`TokenLogprobs`, :class:`Alternative`) rather than a
pydantic model per alternative; :func:`as_event` is the one place they become the engine's event
type.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from slotq.engine.events import TokenLogprob, TopLogprob

SIGNIFICANT_DIGITS = 7       # a float32 logit carries about 7; more digits would only lengthen the stream
TokenBytes = Callable[[int], bytes]
_CHUNK_ROWS = 8               # rows per exp temporary (8 x 151k float32: about 5 MB)
_TOP_GROUP = 64               # vocabulary entries per group in top_tokens


@dataclass(frozen=True, slots=True)
class Alternative:
    """One token and its log probability at a position (the raw logits' log-softmax)."""

    id: int
    token: str          # its text; a piece that is not whole UTF-8 reads 'bytes:\\xe2\\x80' (see token_text)
    token_bytes: bytes  # its bytes as they appear in generated text
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A generated token's entry and the row's ``top`` most likely tokens, most likely first."""

    chosen: Alternative
    top: tuple[Alternative, ...]


class RowLogprobs:
    """One row of a step's log-softmax and its best tokens, most likely first (ties: lower id).

    ``raw`` is the row's own copy of the raw logits and ``shift`` its log-sum-exp, so a token's
    logprob is ``raw[token] - shift``: the full log-softmax row is never written out, only read
    for the sampled token. ``token_bytes`` gives a token's bytes as they appear in generated text
    (the model's cached pieces), so alternatives are named exactly as the chosen token is."""

    __slots__ = ("_raw", "_shift", "_token_bytes", "_top")

    def __init__(self, raw: np.ndarray, shift: float, top_ids: list[int], token_bytes: TokenBytes) -> None:
        self._raw = raw
        self._shift = np.float32(shift)
        self._token_bytes = token_bytes
        self._top = tuple(self._describe(token) for token in top_ids)

    def of(self, token: int) -> TokenLogprobs:
        """The sampled ``token``'s entry, with the row's best alternatives."""
        return TokenLogprobs(self._describe(token), self._top)

    def _describe(self, token: int) -> Alternative:
        piece = self._token_bytes(token)
        logprob = float(self._raw[token] - self._shift)
        return Alternative(token, token_text(piece), piece, float(f"{logprob:.{SIGNIFICANT_DIGITS}g}"))


class StepLogprobs:
    """Computes a step's logprobs in one call (:meth:`compute`), in blocks it keeps from step to
    step: the copy of the raw rows and the ``exp`` scratch. A new ``[rows x vocab]`` array per step
    (150 MB at 256 rows of 151k) would be page-faulted in every time, which cost as much as the
    arithmetic. A step's :class:`RowLogprobs` read the kept copy, so they are valid until the next
    :meth:`compute` (the runner reads them within the step)."""

    def __init__(self) -> None:
        self._rows = np.empty((0, 0), dtype=np.float32)
        self._scratch = np.empty((0, 0), dtype=np.float32)

    def compute(self, rows: Sequence[np.ndarray], tops: Sequence[int],
                token_bytes: Sequence[TokenBytes]) -> list[RowLogprobs]:
        """The log-softmax of each of a step's raw logits ``rows`` (float32 rows of one vocabulary,
        copied here: the constraint masks may write them later) and row ``i``'s ``tops[i]`` best
        tokens, named with ``token_bytes[i]``. Vectorised over the whole block: a stable
        log-sum-exp (each row's peak subtracted before ``exp``, in float32) and one top-k for the
        largest ``top`` of the step (:func:`top_tokens`); each row keeps its own first ``tops[i]``."""
        if len(rows) == 0 or len(rows) != len(tops) or len(tops) != len(token_bytes):
            raise ValueError(f"rows: expected one row per entry of tops ({len(tops)}) and of token_bytes "
                             f"({len(token_bytes)}), got {len(rows)}")
        n, n_vocab = len(rows), len(rows[0])
        if self._rows.shape[0] < n or self._rows.shape[1] != n_vocab:
            self._rows = np.empty((n, n_vocab), dtype=np.float32)
            self._scratch = np.empty((min(n, _CHUNK_ROWS), n_vocab), dtype=np.float32)
        block = self._rows[:n]
        np.stack(rows, out=block)
        top_ids, peaks = top_tokens(block, max(tops))
        shifts = np.empty(n, dtype=np.float32)
        for start in range(0, n, _CHUNK_ROWS):          # a few rows' temporary at a time: it stays in cache
            chunk = slice(start, start + _CHUNK_ROWS)
            scratch = self._scratch[:len(block[chunk])]
            np.subtract(block[chunk], peaks[chunk, None], out=scratch)
            np.exp(scratch, out=scratch)
            shifts[chunk] = peaks[chunk] + np.log(scratch.sum(axis=1))
        return [RowLogprobs(block[i], float(shifts[i]), top_ids[i][:k], token_bytes[i]) for i, k in enumerate(tops)]


def top_tokens(rows: np.ndarray, k: int) -> tuple[list[list[int]], np.ndarray]:
    """Each row's ``k`` largest entries' ids, largest first (ties: lower id), and each row's
    maximum. Without a sort of the vocabulary, nor an ``argpartition`` of it (which writes an int64
    index per entry): the vocabulary is dealt into ``n`` groups, group ``g`` holding the ids ``g,
    g + n, g + 2n, ...`` (``_TOP_GROUP`` of them), so each group's maximum is an elementwise
    maximum of contiguous slices (one vectorised pass, which also gives the row's maximum). The
    ``k`` best entries lie in the ``k`` groups of largest maxima (an entry outside them has ``k``
    group maxima at least as large above it), so only those ``k * _TOP_GROUP`` candidates are ranked."""
    n_rows, n_vocab = rows.shape
    n_groups = n_vocab // _TOP_GROUP
    dealt = n_groups * _TOP_GROUP
    if k == 0 or k >= n_groups:
        peaks = rows.max(axis=1)
        if k == 0:
            return [[] for _ in range(n_rows)], peaks
        candidates = np.broadcast_to(np.arange(n_vocab), rows.shape)
    else:
        group_max = rows[:, :dealt].reshape(n_rows, _TOP_GROUP, n_groups).max(axis=1)
        best_groups = np.argpartition(group_max, -k, axis=1)[:, -k:]
        candidates = (best_groups[:, :, None] + n_groups * np.arange(_TOP_GROUP)).reshape(n_rows, -1)
        peaks = group_max.max(axis=1)
        if n_vocab > dealt:                                 # the ids left over: always candidates
            rest = np.arange(dealt, n_vocab)
            candidates = np.concatenate([candidates, np.broadcast_to(rest, (n_rows, len(rest)))], axis=1)
            peaks = np.maximum(peaks, rows[:, dealt:].max(axis=1))
    values = np.take_along_axis(rows, candidates, axis=1)
    best = np.argpartition(values, -k, axis=1)[:, -k:]
    ids = np.take_along_axis(candidates, best, axis=1)
    order = np.lexsort((ids, -np.take_along_axis(values, best, axis=1)), axis=1)   # largest first, ties by id
    return np.take_along_axis(ids, order, axis=1).tolist(), peaks


def as_event(entry: TokenLogprobs) -> TokenLogprob:
    """``entry`` as the engine's event type: the one place the two meet. The values were made here,
    so they are not validated again (``model_construct``)."""
    return TokenLogprob.model_construct(
        id=entry.chosen.id, token=entry.chosen.token, token_bytes=list(entry.chosen.token_bytes),
        logprob=entry.chosen.logprob,
        top=[TopLogprob.model_construct(id=alt.id, token=alt.token, token_bytes=list(alt.token_bytes),
                                        logprob=alt.logprob) for alt in entry.top])


def token_text(piece: bytes) -> str:
    """A token's text as OpenAI shows it: its UTF-8 text, or ``bytes:\\xe2\\x80`` when the piece is
    only part of a character (its bytes still say exactly what it is)."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


__all__ = ["Alternative", "RowLogprobs", "StepLogprobs", "TokenLogprobs", "as_event", "token_text", "top_tokens"]
