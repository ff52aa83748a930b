"""One job's stream entries as the Messages API's SSE events (pure: no I/O, testable without Redis).

The sequence the ``anthropic`` SDK reads: ``message_start`` and a ``ping``; then per content block
``content_block_start``, its ``content_block_delta`` events (``thinking_delta``, ``text_delta``,
``input_json_delta``) and ``content_block_stop``; then ``message_delta`` (``stop_reason`` and usage)
and ``message_stop``. ``message_start`` goes out with the job's first entry, whose first chunk says
the prompt's tokens; until then the stream has only keep-alive comments. Both usages carry all four
of Anthropic's counts (``input_tokens``, ``cache_creation_input_tokens``, always 0, ``cache_read_input_tokens``,
``output_tokens``), as Anthropic sends them and as the SDK's ``MessageDeltaUsage`` declares them
(cumulative): the SDK's accumulated Message then has the usage a non-streamed one has.
Blocks come in the order the reply wrote them: its thinking, its text, each tool call (a
``tool_use`` block opened with the call's id and name, its arguments' JSON in pieces).
A job that fails, is cancelled or passes its deadline ends the stream with an ``error`` event in
Anthropic's shape; a failed attempt that the job retries is a ``ping``, and the stream goes on.

Resuming works as for chat chunks (:mod:`slotq.jobs.gateway.chunks`): the renderer reads the job's
stream from its start, so block indices stay right, and sends only the events of entries after
``Last-Event-ID``. The events of one entry go out together, and only the last carries the entry's
stream id, so a client cut off inside a group resumes before it and misses none of it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from slotq.jobs.anthropic.errors import anthropic_body
from slotq.jobs.anthropic.translate import message_id, stop_reason, usage_out, wire_param
from slotq.jobs.anthropic.wire import Usage
from slotq.jobs.gateway.chunks import first_entry_error, parse_stream_id, sse, unfinished_stream
from slotq.jobs.openai.errors import ApiError
from slotq.jobs.protocol.schemas import EntryKind, StreamEntry
from slotq.jobs.protocol.streams import merge_tool_call_deltas
from slotq.jobs.protocol.wire import FinishReason
from slotq.jobs.protocol.wire import Usage as JobUsage

BlockKind = Literal["thinking", "text", "tool_use"]
Event = tuple[str, dict[str, Any]]     # (event type, its data)


def error_event(error: ApiError, *, id: str | None = None) -> str:
    """The SDK raises ``APIStatusError`` on an ``error`` event, with this body."""
    return sse(json.dumps(anthropic_body(error)), id=id, event="error")


class MessageEventRenderer:
    def __init__(self, job_id: str, model: str, *, after: str | None = None) -> None:
        self.job_id = job_id
        self.model = model
        self.after = parse_stream_id(after) if after else None
        self.finished = False
        self._started = self.after is not None           # message_start sent (a resumed stream had it)
        self._blocks = 0                                  # blocks started so far
        self._open: BlockKind | None = None               # the kind of the block open now
        self._call_blocks: dict[int, int] = {}            # a tool call's index -> its block's index

    def opening(self) -> list[str]:
        """Nothing before the first entry: ``message_start`` waits for the prompt's count."""
        return []

    def _start(self, entry: StreamEntry) -> list[str]:
        """``message_start`` (and a ``ping``) before the events of the stream's first chunk (or done
        entry): its usage is the prompt's as that entry says it."""
        self._started = True
        usage = Usage(input_tokens=0, output_tokens=0)           # (a chunk from a worker that did not say)
        if entry.prompt_tokens is not None:
            usage = usage_out(JobUsage(prompt_tokens=entry.prompt_tokens,
                                       cached_prompt_tokens=entry.cached_prompt_tokens))
        elif entry.kind == EntryKind.DONE and entry.usage is not None:
            usage = usage_out(entry.usage.model_copy(update={"completion_tokens": 0}))
        message: dict[str, Any] = {
            "id": message_id(self.job_id), "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": usage.model_dump()}
        return self._render([("message_start", {"type": "message_start", "message": message}),
                             ("ping", {"type": "ping"})], None)

    def feed(self, entry: StreamEntry) -> list[str]:
        """The events for one entry that the client has not seen yet (the state moves on either way),
        after ``message_start`` when it is the stream's first."""
        # An error says nothing of the prompt: a retried attempt's is a ping and the start waits on; a
        # final one ends the stream with only its error event, as Anthropic's own errors before a message.
        opening = self._start(entry) if not self._started and entry.kind in (EntryKind.CHUNK, EntryKind.DONE) else []
        return [*opening, *self._feed(entry)]

    def _feed(self, entry: StreamEntry) -> list[str]:
        new = self.after is None or parse_stream_id(entry.id) > self.after
        if entry.kind == EntryKind.CHUNK:
            events = self._pieces(entry)
        elif entry.kind == EntryKind.DONE:
            if entry.finish_reason in (FinishReason.CANCELLED, FinishReason.DEADLINE):
                return self._end_with(unfinished_stream(self.job_id, entry.finish_reason), entry.id, show=new)
            events = self._close()
            usage = usage_out(entry.usage) if entry.usage is not None else None
            events.append(("message_delta", {
                "type": "message_delta", "delta": {"stop_reason": stop_reason(entry.finish_reason, entry.stop_sequence),
                                                   "stop_sequence": entry.stop_sequence},
                "usage": usage.model_dump() if usage else {"output_tokens": 0}}))
            events.append(("message_stop", {"type": "message_stop"}))
            self.finished = True
        elif entry.kind == EntryKind.ERROR:
            if entry.final:
                return self._end_with(ApiError.from_job_error(entry.error, self.job_id, wire_param), entry.id,
                                      show=new)
            events = [("ping", {"type": "ping"})]          # an attempt failed; the job is retried, the stream goes on
        else:                                              # a restart: only jobs of n > 1 have one
            return self._end_with(ApiError(500, f"job {self.job_id} was retried from the start; its result will be "
                                                f"at /v1/jobs/{self.job_id}", type="server_error",
                                           code="stream_restarted"), entry.id)
        return self._render(events, entry.id) if new else []

    def failed(self, error: ApiError) -> list[str]:
        """The stream could not be read to its final entry (gone, or Redis out of reach)."""
        return self._end_with(error, None)

    def first_error(self, entry: StreamEntry) -> ApiError | None:
        return None if self.after is not None else first_entry_error(entry, self.job_id, wire_param)

    # ------------------------------------------------------------------ building events
    def _pieces(self, entry: StreamEntry) -> list[Event]:
        events: list[Event] = []
        if entry.reasoning:
            events += self._into("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": entry.reasoning}))
        if entry.text:
            events += self._into("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": entry.text}))
        for call in merge_tool_call_deltas(entry.tool_calls):
            if call.id is not None:           # a call's first piece names it: a block of its own
                events += self._close()
                events += self._into("tool_use", {"type": "tool_use", "id": call.id, "name": call.name or "",
                                                  "input": {}})
                self._call_blocks[call.index] = self._blocks - 1
            if call.arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments},
                                          self._call_blocks.get(call.index, self._blocks - 1)))
        return events

    def _into(self, kind: BlockKind, block: dict[str, Any]) -> list[Event]:
        """Open a block of ``kind`` unless one is open (a tool call's block is never continued)."""
        if self._open == kind and kind != "tool_use":
            return []
        events = self._close()
        self._open = kind
        self._blocks += 1
        return [*events, ("content_block_start", {"type": "content_block_start", "index": self._blocks - 1,
                                                  "content_block": block})]

    def _delta(self, delta: dict[str, Any], index: int | None = None) -> Event:
        return ("content_block_delta", {"type": "content_block_delta",
                                        "index": self._blocks - 1 if index is None else index, "delta": delta})

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        self._open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self._blocks - 1})]

    def _render(self, events: list[Event], id: str | None) -> list[str]:
        return [sse(json.dumps(data), event=name, id=id if i == len(events) - 1 else None)
                for i, (name, data) in enumerate(events)]

    def _end_with(self, error: ApiError, id: str | None, *, show: bool = True) -> list[str]:
        self.finished = True
        return [error_event(error, id=id)] if show else []
