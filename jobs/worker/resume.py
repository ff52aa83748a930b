"""Where a job's attempt resumes: what earlier attempts already put in its stream.

Tries count failures, not interruptions (:mod:`slotq.jobs.worker.attempts`), so an attempt starts by
reading the job's stream. Each choice's token ids become the engine request's ``resume_tokens`` (the
next attempt decodes on from the last token delivered, token for token what one attempt would have
made); its text, reasoning, tool-call pieces and log-probabilities are kept to build the result;
a ``RESTART`` entry (a job of several choices starts over) forgets everything before it; and a
final entry means an earlier attempt ended the job and only its finish was lost.

A stream that ``SLOTQ_STREAM_MAXLEN`` trimmed no longer holds its first entries: the tokens it
holds are not the prefix the job delivered, and resuming from them would go on from the wrong
place, silently. :attr:`Delivered.trimmed` says so, and the attempt starts over instead, after a
``RESTART`` entry that tells the stream's readers to discard what came before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slotq.jobs.protocol.schemas import ChoiceResult, EntryKind, StreamEntry, assemble_tool_calls
from slotq.jobs.protocol.streams import StreamOpening
from slotq.jobs.protocol.wire import FinishReason, Timings, TokenLogprob, ToolCallDelta, Usage


@dataclass
class Replies:
    """What each choice's reply said so far, as the stream carries it: its text, its reasoning,
    and the pieces of its tool calls in order.

    Text and reasoning are kept as lists of the pieces that arrived and joined when read: adding a
    piece to a growing string copies the whole reply every time (quadratic in a long reply)."""

    text_pieces: dict[int, list[str]] = field(default_factory=dict)
    reasoning_pieces: dict[int, list[str]] = field(default_factory=dict)
    tool_calls: dict[int, list[ToolCallDelta]] = field(default_factory=dict)
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)    # a job's that asked for them

    def add(self, choice: int, text: str, reasoning: str, tool_calls: list[ToolCallDelta],
            logprobs: list[TokenLogprob] | None = None) -> None:
        self.text_pieces.setdefault(choice, []).append(text)
        if reasoning:
            self.reasoning_pieces.setdefault(choice, []).append(reasoning)
        if tool_calls:
            self.tool_calls.setdefault(choice, []).extend(tool_calls)
        if logprobs is not None:
            self.logprobs.setdefault(choice, []).extend(logprobs)

    def text(self, choice: int) -> str:
        """The text of ``choice`` so far ("" before any)."""
        return "".join(self.text_pieces.get(choice, ()))

    def reasoning(self, choice: int) -> str:
        """The reasoning of ``choice`` so far ("" before any)."""
        return "".join(self.reasoning_pieces.get(choice, ()))

    def choice(self, index: int, finish_reason: FinishReason, usage: Usage, timings: Timings,
               stop_sequence: str | None = None) -> ChoiceResult:
        return ChoiceResult(index=index, text=self.text(index), reasoning=self.reasoning(index),
                            tool_calls=assemble_tool_calls(self.tool_calls.get(index, ())),
                            logprobs=self.logprobs.get(index), finish_reason=finish_reason,
                            stop_sequence=stop_sequence, usage=usage, timings=timings)


@dataclass
class Delivered:
    """What earlier attempts already put in the stream."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    replies: Replies = field(default_factory=Replies)
    done: dict[int, StreamEntry] = field(default_factory=dict)
    final: StreamEntry | None = None
    trimmed: bool = False       # entries of this run (since the last RESTART) were trimmed away: not a prefix

    @property
    def token_count(self) -> int:
        """Tokens the stream holds for the attempt about to run (all choices): what progress is measured by."""
        return sum(len(tokens) for tokens in self.tokens.values())


def delivered_from(opening: StreamOpening) -> Delivered:
    """What the stream an attempt opened (:meth:`StreamWriter.open
    <slotq.jobs.worker.stream_writer.StreamWriter.open>`) holds for it: its entries since the last
    ``RESTART``. Trimmed only where no ``RESTART`` is left: one that is still there keeps every entry
    after it, since trimming drops the oldest first."""
    delivered = Delivered()
    for entry in opening.entries:
        if entry.kind == EntryKind.RESTART:
            delivered = Delivered()
        elif entry.kind == EntryKind.CHUNK:
            delivered.tokens.setdefault(entry.choice, []).extend(entry.token_ids)
            delivered.replies.add(entry.choice, entry.text, entry.reasoning, entry.tool_calls, entry.logprobs)
        elif entry.kind == EntryKind.DONE:
            delivered.done[entry.choice] = entry
        if entry.final:
            delivered.final = entry
    delivered.trimmed = opening.trimmed and all(entry.kind != EntryKind.RESTART for entry in opening.entries)
    return delivered
