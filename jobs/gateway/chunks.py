"""One job's stream entries as SSE events: OpenAI's streaming chunks, or slotq's own entries
(pure: no I/O, testable without Redis).

Each stream entry becomes one SSE event whose ``id`` is the entry's Redis stream id, so a client
that reconnects with ``Last-Event-ID`` gets exactly the events after it. The renderer always reads
the job's stream from the start and suppresses what the client already has: usage and the
per-choice state stay right however many times a stream is resumed.

Events without an id: the opening role chunks (only when not resuming), and after the final entry
the usage chunk and ``data: [DONE]`` (sent again to a client that resumes from the final entry).
A stream ends early with an ``error`` event when the job fails, is cancelled, passes its deadline,
or restarts (a retried ``n > 1`` job whose earlier text is void: the job goes on, and its result is
at ``GET /v1/jobs/{id}``).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from slotq.jobs.openai.errors import ApiError, public_param
from slotq.jobs.openai.translate import (
    Kind,
    TextOffsets,
    answered_model,
    chat_logprobs,
    completion_id,
    finish_reason,
    text_logprobs,
    usage_out,
)
from slotq.jobs.openai.wire import (
    ChatChunkChoice,
    ChatCompletionChunk,
    Delta,
    FunctionDelta,
    TextChoice,
    TextCompletionChunk,
    ToolCallDeltaOut,
)
from slotq.jobs.protocol.schemas import EntryKind, StreamEntry
from slotq.jobs.protocol.streams import merge_tool_call_deltas
from slotq.jobs.protocol.wire import FinishReason, TokenLogprob, Usage

DONE = "data: [DONE]\n\n"


def sse(data: str, *, id: str | None = None, event: str | None = None) -> str:
    head = (f"event: {event}\n" if event else "") + (f"id: {id}\n" if id else "")
    return f"{head}data: {data}\n\n"


def comment(text: str) -> str:
    return f": {text}\n\n"


def parse_stream_id(value: str) -> tuple[int, int]:
    """A Redis stream id ``ms-seq`` as a comparable pair; ValueError if it is not one."""
    ms, _, seq = value.partition("-")
    if not (ms.isdigit() and seq.isdigit()):
        raise ValueError(f"{value!r} is not a stream event id (expected digits-digits, e.g. 1733000000000-0)")
    return int(ms), int(seq)


def unfinished_stream(job_id: str, reason: FinishReason) -> ApiError:
    """A stream that ended without a reply: its job was cancelled or passed its deadline."""
    if reason == FinishReason.DEADLINE:
        return ApiError.deadline(f"job {job_id}: the deadline passed; the partial result is at /v1/jobs/{job_id}")
    return ApiError(409, f"job {job_id} was cancelled", code="job_cancelled")


def first_entry_error(entry: StreamEntry, job_id: str,
                      param: Callable[[str | None], str | None] = public_param) -> ApiError | None:
    """A fresh stream whose first entry already ends the job (rejected by the worker, expired,
    cancelled): answered as an HTTP error instead of a stream (any renderer's ``first_error``)."""
    if not entry.final:
        return None
    if entry.kind == EntryKind.ERROR:
        return ApiError.from_job_error(entry.error, job_id, param)
    if entry.kind == EntryKind.DONE and entry.finish_reason in (FinishReason.CANCELLED, FinishReason.DEADLINE):
        return unfinished_stream(job_id, entry.finish_reason)
    return None


def _carries_nothing(piece: ChatChunkChoice | TextChoice) -> bool:
    """A chat chunk entry whose tokens all went to text held back (a tool call's wrapper, a stop
    string's possible start) would be a chunk with an empty ``content`` and nothing else: it is not
    sent (llama-server sends none either; a resumed stream skips it alike)."""
    return (isinstance(piece, ChatChunkChoice) and piece.logprobs is None
            and not (piece.delta.content or piece.delta.reasoning_content or piece.delta.tool_calls))


class ChunkRenderer:
    def __init__(self, kind: Kind, job_id: str, model: str, created: int, *, n: int, include_usage: bool,
                 after: str | None = None, param: Callable[[str | None], str | None] = public_param) -> None:
        self.kind = kind
        self.param = param          # a job field's name as the request spelled it, for errors
        self.job_id = job_id
        self.model = model                        # asked for; then as answered_model names it once an entry says
        self.fingerprint: str | None = None        # the served model's GGUF fingerprint (system_fingerprint)
        self.created = created
        self.n = n
        self.include_usage = include_usage
        self.after = parse_stream_id(after) if after else None
        self.finished = False
        self._usage: dict[int, Usage] = {}
        self._offsets: dict[int, TextOffsets] = {}     # completions' text_offset, per choice, from the first entry

    def opening(self) -> list[str]:
        if self.after is not None or self.kind != "chat":
            return []
        return [self._chunk([ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""))])
                for i in range(self.n)]

    def feed(self, entry: StreamEntry) -> list[str]:
        """The events for one entry that the client has not seen yet."""
        position = parse_stream_id(entry.id)
        new = self.after is None or position > self.after
        events: list[str] = []
        if entry.model is not None:               # done and error entries name the model that served the job
            self.model, self.fingerprint = answered_model(self.model, entry.model), entry.model_fingerprint
        if entry.kind == EntryKind.CHUNK:
            piece = self._reply_piece(entry)          # built even when not sent: completions' text offsets move on
            if new and not _carries_nothing(piece):
                events.append(self._chunk([piece], id=entry.id))
        elif entry.kind == EntryKind.DONE:
            if entry.usage is not None:
                self._usage[entry.choice] = entry.usage
            if entry.finish_reason in (FinishReason.CANCELLED, FinishReason.DEADLINE):
                return self._end_with(unfinished_stream(self.job_id, entry.finish_reason), entry.id, show=new)
            if new:
                events.append(self._chunk([self._choice(entry.choice, reason=finish_reason(entry.finish_reason))],
                                          id=entry.id))
            if entry.final:
                self.finished = True
                if self.after is None or position >= self.after:
                    events += [self._usage_chunk()] if self.include_usage else []
                    events.append(DONE)
        elif entry.kind == EntryKind.ERROR:
            if entry.final:
                return self._end_with(ApiError.from_job_error(entry.error, self.job_id, self.param), entry.id, show=new)
            if new and entry.error is not None:
                events.append(comment(f"attempt {entry.attempt} failed ({entry.error.code}); the job is retried "
                                      "and the stream continues"))
        elif entry.kind == EntryKind.RESTART:
            self._usage.clear()
            self._offsets.clear()
            return self._end_with(ApiError(
                500, f"job {self.job_id} was retried from the start (n > 1 cannot resume, nor a stream trimmed by "
                     f"SLOTQ_STREAM_MAXLEN); "
                     f"the text streamed so far is void. The job goes on: its result will be at /v1/jobs/{self.job_id}",
                type="server_error", code="stream_restarted"), entry.id)
        return events

    def failed(self, error: ApiError) -> list[str]:
        """The stream could not be read to its final entry (gone, or Redis out of reach)."""
        return self._end_with(error, None)

    def first_error(self, entry: StreamEntry) -> ApiError | None:
        return None if self.after is not None else first_entry_error(entry, self.job_id, self.param)

    # ------------------------------------------------------------------ building events
    def _end_with(self, error: ApiError, id: str | None, *, show: bool = True) -> list[str]:
        self.finished = True
        return [error_event(error, id=id)] if show else []

    def _reply_piece(self, entry: StreamEntry) -> ChatChunkChoice | TextChoice:
        """A chunk entry as a chunk's choice: text, and (chat) reasoning and tool call pieces."""
        if self.kind != "chat" or not (entry.reasoning or entry.tool_calls):
            return self._choice(entry.choice, text=entry.text, logprobs=entry.logprobs)
        calls = [ToolCallDeltaOut(index=d.index, id=d.id, type="function" if d.id is not None else None,
                                  function=FunctionDelta(name=d.name, arguments=d.arguments))
                 for d in merge_tool_call_deltas(entry.tool_calls)]
        return ChatChunkChoice(index=entry.choice, delta=Delta(content=entry.text or None,
                                                               reasoning_content=entry.reasoning or None,
                                                               tool_calls=calls or None),
                               logprobs=None if entry.logprobs is None else chat_logprobs(entry.logprobs))

    def _choice(self, index: int, *, text: str | None = None, reason: str | None = None,
                logprobs: list[TokenLogprob] | None = None) -> ChatChunkChoice | TextChoice:
        if self.kind == "chat":
            return ChatChunkChoice(index=index, delta=Delta(content=text), finish_reason=reason,
                                   logprobs=None if logprobs is None else chat_logprobs(logprobs))
        return TextChoice(index=index, text=text or "", finish_reason=reason, logprobs=None if logprobs is None else
                          text_logprobs(logprobs, self._offsets.setdefault(index, TextOffsets())))

    def _usage_chunk(self) -> str:
        first = self._usage.get(0) or next(iter(self._usage.values()), Usage())
        total = Usage(prompt_tokens=first.prompt_tokens,
                      completion_tokens=sum(u.completion_tokens for u in self._usage.values()),
                      cached_prompt_tokens=sum(u.cached_prompt_tokens for u in self._usage.values()),
                      reasoning_tokens=sum(u.reasoning_tokens for u in self._usage.values()))
        return self._chunk([], usage=total)

    def _chunk(self, choices: list[ChatChunkChoice | TextChoice], *, id: str | None = None,
               usage: Usage | None = None) -> str:
        """A chunk of the renderer's kind; ``_choice`` and ``_reply_piece`` build its choices of that kind."""
        chunk_id, usage_obj = completion_id(self.kind, self.job_id), usage_out(usage) if usage is not None else None
        chunk: ChatCompletionChunk | TextCompletionChunk
        if self.kind == "chat":
            chunk = ChatCompletionChunk(id=chunk_id, created=self.created, model=self.model, usage=usage_obj,
                                        system_fingerprint=self.fingerprint,
                                        choices=[c for c in choices if isinstance(c, ChatChunkChoice)])
        else:
            chunk = TextCompletionChunk(id=chunk_id, created=self.created, model=self.model, usage=usage_obj,
                                        system_fingerprint=self.fingerprint,
                                        choices=[c for c in choices if isinstance(c, TextChoice)])
        return sse(chunk.model_dump_json(exclude=None if self.include_usage else {"usage"}), id=id)


class NativeRenderer:
    """slotq's own events for ``GET /v1/jobs/{id}/events``: ``event:`` is the entry kind (chunk,
    done, error, restart), ``data:`` the entry as JSON, ``id:`` its stream id. Like the chunk
    renderer it reads from the start and skips what the client has, so a client resuming after
    the final entry gets a clean end rather than a wait."""

    def __init__(self, job_id: str, after: str | None = None) -> None:
        self.job_id = job_id
        self.after = parse_stream_id(after) if after else None
        self.finished = False

    def opening(self) -> list[str]:
        return []

    def feed(self, entry: StreamEntry) -> list[str]:
        self.finished = entry.final
        if self.after is not None and parse_stream_id(entry.id) <= self.after:
            return []
        return [sse(entry.model_dump_json(exclude={"id"}), id=entry.id, event=entry.kind.value)]

    def failed(self, error: ApiError) -> list[str]:
        self.finished = True
        return [error_event(error, event="gateway_error")]


def error_event(error: ApiError, *, id: str | None = None, event: str | None = None) -> str:
    """OpenAI's SDKs raise ``APIError`` when a stream carries ``{"error": {...}}``."""
    return sse(json.dumps(error.body()), id=id, event=event)
