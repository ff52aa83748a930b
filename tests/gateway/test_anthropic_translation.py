"""The Messages API's pure parts: a request -> the job it runs, and a job's stream entries -> the
events the ``anthropic`` SDK reads (the real SDK against a real gateway: test_gateway_anthropic.py)."""

from __future__ import annotations

import json

import pytest

from slotq.jobs.anthropic.errors import anthropic_body, speaks_anthropic
from slotq.jobs.anthropic.translate import to_count_job, to_job_request
from slotq.jobs.anthropic.wire import CountTokensRequest, MessagesRequest
from slotq.jobs.gateway.message_events import MessageEventRenderer
from slotq.jobs.openai.errors import ApiError
from slotq.jobs.protocol.schemas import EntryKind, StreamEntry
from slotq.jobs.protocol.wire import ErrorInfo, FinishReason, ToolCallDelta, Usage

TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def messages(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 16,
                                           "messages": [{"role": "user", "content": "hi"}]} | fields)


def test_a_conversation_with_a_tool_loop_becomes_chat_messages():
    job = to_job_request(messages(system=[{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}],
                                  tools=[TOOL], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                          {"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                      "content": [{"type": "text", "text": "timeout"}]},
                                     {"type": "text", "text": "Try again?"}]}]))
    roles = [(m.role, m.content) for m in job.messages or []]
    assert roles == [("system", "Be\n\nbrief."), ("user", "Weather in Paris?"), ("assistant", "Let me look."),
                     ("tool", "Error: timeout"), ("user", "Try again?")]
    [call] = job.messages[2].tool_calls or []
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == ("toolu_1", "get_weather",
                                                                                   {"city": "Paris"})
    assert job.messages[3].tool_call_id == "toolu_1"
    assert job.tools and job.tools[0].function.parameters == TOOL["input_schema"]


@pytest.mark.parametrize(("choice", "tool_choice", "parallel"), [
    ({"type": "auto"}, "auto", False),
    ({"type": "any", "disable_parallel_tool_use": False}, "required", True),
    ({"type": "none"}, "none", False),
])
def test_tool_choice(choice, tool_choice, parallel):
    job = to_job_request(messages(tools=[TOOL], tool_choice=choice))
    assert (job.tool_choice, job.parallel_tool_calls) == (tool_choice, parallel)


def test_a_named_tool_choice_and_what_counting_makes_of_it():
    forced = {"tools": [TOOL], "tool_choice": {"type": "tool", "name": "get_weather"}}
    job = to_job_request(messages(**forced, stop_sequences=["END"], metadata={"user_id": "u"}, lane="bulk"),
                         idempotency_key="from-header")
    assert job.tool_choice.function.name == "get_weather" and job.stop == ["END"]
    assert (job.lane, job.idempotency_key) == ("bulk", "from-header")
    assert job.metadata == {"user_id": "u"}
    conversation = {"model": "m", "messages": [{"role": "user", "content": "x"}], **forced}
    count = to_count_job(CountTokensRequest.model_validate(conversation))
    assert (count.max_tokens, count.tool_choice, count.sampling.temperature) == (1, "auto", 0.0)


def test_output_config_format_is_the_json_schema():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    job = to_job_request(messages(output_config={"format": {"type": "json_schema", "schema": schema}}))
    assert job.sampling.json_schema == schema


@pytest.mark.parametrize(("fields", "named"), [
    ({"top_k": -1}, "top_k"),
    ({"tools": [{"name": "bad name", "input_schema": {}}]}, "tools[0].name"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}]},
     "messages[0].content[0].tool_use_id"),
])
def test_job_errors_name_the_messages_field(fields, named):
    """What only the job checks (its bounds, a tool's name) is reported under the request's names."""
    with pytest.raises(ApiError) as refused:
        to_job_request(messages(**fields))
    assert refused.value.param == named and refused.value.status == 400


def test_a_forced_tool_choice_needs_tools():
    with pytest.raises(ValueError, match="tool_choice: type 'any' needs tools"):
        messages(tool_choice={"type": "any"})
    assert to_job_request(messages(tools=[], tool_choice={"type": "auto"})).tools is None   # an empty list: none


def test_errors_in_anthropics_shape_by_status():
    assert speaks_anthropic("/v1/messages") and speaks_anthropic("/v1/messages/count_tokens")
    assert not speaks_anthropic("/v1/messagesx") and not speaks_anthropic("/v1/chat/completions")
    assert anthropic_body(ApiError(429, "slow down", code="queue_full")) == {
        "type": "error", "error": {"type": "rate_limit_error", "message": "slow down", "code": "queue_full"}}
    assert [anthropic_body(ApiError(status, "x"))["error"]["type"] for status in (400, 401, 404, 409, 500, 503)] == [
        "invalid_request_error", "authentication_error", "not_found_error", "invalid_request_error", "api_error",
        "overloaded_error"]


# ---------------------------------------------------------------------- the event stream
def entry(n: int, kind: EntryKind = EntryKind.CHUNK, **fields) -> StreamEntry:
    return StreamEntry(id=f"100-{n}", kind=kind, attempt=1, **fields)


STREAM = [
    entry(1, reasoning="Hm", prompt_tokens=9, cached_prompt_tokens=4),
    entry(2, reasoning=" ok", text="Sure."),
    entry(3, tool_calls=[ToolCallDelta(index=0, id="call_1", name="get_weather", arguments='{"ci')]),
    entry(4, tool_calls=[ToolCallDelta(index=0, arguments='ty": "Paris"}')]),
    entry(5, EntryKind.DONE, finish_reason=FinishReason.TOOL_CALLS, final=True,
          usage=Usage(prompt_tokens=9, completion_tokens=6, cached_prompt_tokens=4)),
]


def events(renderer: MessageEventRenderer, entries: list[StreamEntry]) -> list[str]:
    out = renderer.opening()
    for e in entries:
        out += renderer.feed(e)
    return out


def parsed(raw: list[str]) -> list[tuple[str, str | None, dict]]:
    """(event, id, data) of each SSE event."""
    out = []
    for event in raw:
        fields = dict(line.split(": ", 1) for line in event.strip().splitlines())
        out.append((fields["event"], fields.get("id"), json.loads(fields["data"])))
    return out


def test_blocks_open_deltas_and_close_in_the_order_written():
    seen = parsed(events(MessageEventRenderer("j1", "m"), STREAM))
    assert [(name, data.get("index"), (data.get("delta") or data.get("content_block") or {}).get("type"))
            for name, _id, data in seen] == [
        ("message_start", None, None), ("ping", None, None),
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"), ("content_block_stop", 2, None),
        ("message_delta", None, None), ("message_stop", None, None)]
    assert seen[9][2]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}
    assert "".join(d["delta"]["partial_json"] for n, _i, d in seen if d.get("delta", {}).get("partial_json")) \
        == '{"city": "Paris"}'
    assert seen[-2][2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert seen[-2][2]["usage"] == {"input_tokens": 5, "output_tokens": 6, "cache_creation_input_tokens": 0,
                                   "cache_read_input_tokens": 4}
    assert seen[0][2]["message"]["usage"] == {"input_tokens": 5, "output_tokens": 0,
                                                "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4}


def test_message_start_waits_for_the_first_entry_and_counts_its_prompt():
    renderer = MessageEventRenderer("j1", "m")
    assert renderer.opening() == []                          # nothing known yet: keep-alives until an entry
    retried = parsed(renderer.feed(entry(1, EntryKind.ERROR, error=ErrorInfo(code="worker_lost", message="x",
                                                                             retryable=True))))
    assert [name for name, _id, _d in retried] == ["ping"]   # a retried attempt says nothing of the prompt
    first = parsed(renderer.feed(entry(2, text="Hi", prompt_tokens=7)))
    assert [name for name, _id, _d in first[:3]] == ["message_start", "ping", "content_block_start"]
    assert first[0][2]["message"]["usage"] == {"input_tokens": 7, "output_tokens": 0,
                                                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    ended = parsed(MessageEventRenderer("j1", "m").feed(entry(1, EntryKind.DONE, finish_reason=FinishReason.STOP,
                                                              final=True, usage=Usage(prompt_tokens=3,
                                                                                      completion_tokens=0))))
    assert ended[0][2]["message"]["usage"]["input_tokens"] == 3    # no chunk at all: the done entry's usage


def test_only_the_last_event_of_an_entry_carries_its_id_and_resuming_sends_the_rest():
    full = parsed(events(MessageEventRenderer("j1", "m"), STREAM))
    assert [(name, id) for name, id, _d in full if id] == [
        ("content_block_delta", "100-1"), ("content_block_delta", "100-2"), ("content_block_delta", "100-3"),
        ("content_block_delta", "100-4"), ("message_stop", "100-5")]
    for n in range(1, 6):
        resumed = parsed(events(MessageEventRenderer("j1", "m", after=f"100-{n}"), STREAM))
        upto = next(i for i, (_n, id, _d) in enumerate(full) if id == f"100-{n}") + 1
        assert resumed == full[upto:]


def test_a_stream_past_its_deadline_ends_with_a_timeout_error():
    [(name, _id, data)] = parsed(MessageEventRenderer("j1", "m").failed(ApiError.deadline("too late")))
    assert name == "error" and data["error"] == {"type": "timeout_error", "message": "too late",
                                                 "code": "deadline_exceeded"}


def test_a_failed_job_ends_the_stream_with_an_error_event():
    renderer = MessageEventRenderer("j1", "m")
    retried = renderer.feed(entry(1, EntryKind.ERROR, error=ErrorInfo(code="worker_lost", message="x",
                                                                      retryable=True)))
    assert parsed(retried)[0][0] == "ping" and not renderer.finished
    [failed] = parsed(renderer.feed(entry(2, EntryKind.ERROR, final=True, error=ErrorInfo(
        code="invalid_request", message="stop: too many", retryable=False, field="stop"))))
    assert failed[0] == "error" and renderer.finished
    assert failed[2]["error"]["type"] == "invalid_request_error"
    assert failed[2]["error"]["message"].startswith("stop_sequences: ")
