"""One job's stream entries as the Responses API's SSE events (pure: no I/O, testable without Redis).

The sequence the ``openai`` SDK reads (``client.responses.create(stream=True)``,
``client.responses.stream``): ``response.created`` and ``response.in_progress``; then per output
item ``response.output_item.added``, its content, and ``response.output_item.done``:

* a reasoning item: ``response.reasoning_text.delta`` pieces and ``response.reasoning_text.done``;
* a message: ``response.content_part.added`` (an ``output_text`` part), ``response.output_text.delta``
  pieces, ``response.output_text.done`` and ``response.content_part.done``;
* a function call (opened with its ``call_id`` and name): ``response.function_call_arguments.delta``
  pieces and ``response.function_call_arguments.done``;

then ``response.completed`` (or ``response.incomplete`` when ``max_output_tokens`` cut the reply)
with the whole Response. A job that fails, is cancelled or passes its deadline ends the stream with
``response.failed`` (the Response's ``error`` names the code); a failed attempt that the job
retries sends nothing, and the stream goes on.

Every event carries ``sequence_number``, counted from 0 over the job's stream read from its start,
so a renderer built with ``starting_after=N`` (resuming) computes the same numbers and sends only
the events after N: the events a client resumes with are exactly the ones it had not had.
"""

from __future__ import annotations

import json
from typing import Any

from slotq.jobs.gateway.chunks import first_entry_error, sse, unfinished_stream
from slotq.jobs.openai.errors import ApiError
from slotq.jobs.protocol.schemas import EntryKind, StreamEntry
from slotq.jobs.protocol.wire import FinishReason, ToolCallDelta, Usage
from slotq.jobs.responses.translate import finished, response_error, wire_param
from slotq.jobs.responses.wire import (
    FunctionCallOut,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningOut,
    ReasoningText,
    Response,
)


class ResponseEventRenderer:
    def __init__(self, shell: Response, *, starting_after: int | None = None) -> None:
        self.shell = shell
        self.job_id = shell.slotq.job_id if shell.slotq else shell.id
        self.starting_after = starting_after
        self.finished = False
        self._sequence = 0
        self._items: list[OutputItem] = []
        self._open: OutputItem | None = None                 # the item receiving pieces now
        self._call_items: dict[int, FunctionCallOut] = {}    # a tool call's index -> its item

    def opening(self) -> list[str]:
        in_progress = self._dump(self.shell)
        return self._render([self._event("response.created", response=in_progress),
                             self._event("response.in_progress", response=in_progress)])

    def feed(self, entry: StreamEntry) -> list[str]:
        """The events for one entry that the client has not had (the sequence moves on either way)."""
        if entry.kind == EntryKind.CHUNK:
            return self._render(self._pieces(entry))
        if entry.kind == EntryKind.DONE:
            if entry.finish_reason in (FinishReason.CANCELLED, FinishReason.DEADLINE):
                return self.failed(unfinished_stream(self.job_id, entry.finish_reason))
            events = self._close(incomplete=entry.finish_reason == FinishReason.LENGTH)
            total_s = int(entry.timings.total_ms / 1000) if entry.timings else 0
            response = finished(self.shell, self._items, entry.finish_reason, entry.usage or Usage(),
                                self.shell.created_at + total_s)
            response.slotq = self.shell.slotq.model_copy(update={"worker": entry.worker, "attempts": entry.attempt}) \
                if self.shell.slotq else None
            kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
            events.append(self._event(kind, response=self._dump(response)))
            self.finished = True
            return self._render(events)
        if entry.kind == EntryKind.ERROR:
            if entry.final:
                return self.failed(ApiError.from_job_error(entry.error, self.job_id, wire_param))
            return []                                          # an attempt failed; the job is retried
        return self.failed(ApiError(500, f"job {self.job_id} was retried from the start; its result will be at "
                                         f"/v1/jobs/{self.job_id}", type="server_error", code="stream_restarted"))

    def failed(self, error: ApiError) -> list[str]:
        """The stream ends early: ``response.failed``, the Response's ``error`` naming the code."""
        self.finished = True
        events = self._close(incomplete=True)
        response = self.shell.model_copy(update={
            "status": "failed", "output": self._items,
            "error": response_error(error)})
        events.append(self._event("response.failed", response=self._dump(response)))
        return self._render(events)

    def first_error(self, entry: StreamEntry) -> ApiError | None:
        return None if self.starting_after is not None else first_entry_error(entry, self.job_id, wire_param)

    # ------------------------------------------------------------------ building events
    def _pieces(self, entry: StreamEntry) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if entry.reasoning:
            if not isinstance(self._open, ReasoningOut):
                events += self._add(ReasoningOut(id=f"rs_{self.job_id}", content=[], status="in_progress"))
            events.append(self._event("response.reasoning_text.delta", item_id=self._open_id, output_index=self._index,
                                      content_index=0, delta=entry.reasoning))
            self._reasoning_part().text += entry.reasoning
        if entry.text:
            message = self._open
            if not isinstance(message, OutputMessage):
                suffix = "" if not any(isinstance(i, OutputMessage) for i in self._items) else f"_{len(self._items)}"
                message = OutputMessage(id=f"msg_{self.job_id}{suffix}", status="in_progress", content=[])
                events += self._add(message)
                message.content.append(OutputText(text=""))
                events.append(self._event("response.content_part.added", item_id=message.id,
                                          output_index=self._index, content_index=0,
                                          part=message.content[0].model_dump()))
            events.append(self._event("response.output_text.delta", item_id=message.id, output_index=self._index,
                                      content_index=0, delta=entry.text, logprobs=[]))
            message.content[0].text += entry.text
        for piece in entry.tool_calls:
            events += self._call_piece(piece)
        return events

    def _call_piece(self, piece: ToolCallDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        item = self._call_items.get(piece.index)
        if item is None:                                      # a call's first piece names it: an item of its own
            item = FunctionCallOut(id=f"fc_{self.job_id}_{piece.index}", call_id=piece.id or "",
                                   name=piece.name or "", arguments="", status="in_progress")
            events += self._add(item)
            self._call_items[piece.index] = item
        if piece.arguments:
            events.append(self._event("response.function_call_arguments.delta", item_id=item.id,
                                      output_index=self._items.index(item), delta=piece.arguments))
            item.arguments += piece.arguments
        return events

    def _reasoning_part(self) -> ReasoningText:
        assert isinstance(self._open, ReasoningOut)
        if not self._open.content:
            self._open.content.append(ReasoningText(text=""))
        return self._open.content[0]

    @property
    def _index(self) -> int:
        return len(self._items) - 1

    @property
    def _open_id(self) -> str:
        assert self._open is not None
        return self._open.id

    def _add(self, item: OutputItem) -> list[dict[str, Any]]:
        events = self._close()
        self._items.append(item)
        self._open = item
        empty = item.model_copy(deep=True)
        if isinstance(empty, OutputMessage | ReasoningOut):
            empty.content = []
        return [*events, self._event("response.output_item.added", output_index=self._index,
                                     item=empty.model_dump())]

    def _close(self, *, incomplete: bool = False) -> list[dict[str, Any]]:
        """Finish the open item and every call still open (a call's pieces may interleave);
        ``incomplete`` when the reply was cut (by ``max_output_tokens``, or its job's end)."""
        events: list[dict[str, Any]] = []
        open_items = [self._open] if self._open is not None else []
        open_items += [call for call in self._call_items.values() if call.status == "in_progress"
                       and call is not self._open]
        for item in open_items:
            index = self._items.index(item)
            if isinstance(item, ReasoningOut):
                text = item.content[0].text if item.content else ""
                events.append(self._event("response.reasoning_text.done", item_id=item.id, output_index=index,
                                          content_index=0, text=text))
            elif isinstance(item, OutputMessage):
                part = item.content[0]
                events.append(self._event("response.output_text.done", item_id=item.id, output_index=index,
                                          content_index=0, text=part.text, logprobs=[]))
                events.append(self._event("response.content_part.done", item_id=item.id, output_index=index,
                                          content_index=0, part=part.model_dump()))
            else:
                events.append(self._event("response.function_call_arguments.done", item_id=item.id,
                                          output_index=index, name=item.name, arguments=item.arguments))
            item.status = "incomplete" if incomplete else "completed"
            events.append(self._event("response.output_item.done", output_index=index, item=item.model_dump()))
        self._open = None
        return events

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    @staticmethod
    def _dump(response: Response) -> dict[str, Any]:
        return json.loads(response.model_dump_json())    # type: ignore[no-any-return]

    def _render(self, events: list[dict[str, Any]]) -> list[str]:
        return [sse(json.dumps(event), event=event["type"]) for event in events
                if self.starting_after is None or event["sequence_number"] > self.starting_after]
