"""The Responses API's pure parts: a request -> the job it runs, a job's result -> the Response
object, a job's stream entries -> the events the ``openai`` SDK reads (the real SDK against a real
gateway: test_gateway_responses.py)."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import ResponseFailedEvent
from pydantic import ValidationError

from slotq.jobs.gateway.response_events import ResponseEventRenderer
from slotq.jobs.openai.errors import ApiError, from_validation
from slotq.jobs.protocol.schemas import ChoiceResult, EntryKind, JobResult, JobStatus, StreamEntry
from slotq.jobs.protocol.wire import ErrorInfo, FinishReason, Timings, ToolCallDelta, ToolCallSpec, Usage
from slotq.jobs.responses.translate import response_shell, to_job_request, to_response
from slotq.jobs.responses.wire import Response, ResponsesRequest

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object",
                                                                   "properties": {"city": {"type": "string"}}}}


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi"} | fields)


def refusal(**fields) -> ApiError:
    """The 400 a request with ``fields`` gets, whether the body's model or the translation refuses it."""
    try:
        to_job_request(request(**fields))
    except ValidationError as exc:
        return from_validation(exc)
    except ApiError as exc:
        return exc
    raise AssertionError(f"{fields} was accepted")


def test_a_tool_loop_in_input_items_becomes_chat_messages():
    job = to_job_request(request(instructions="Be brief.", tools=[TOOL], max_output_tokens=32, input=[
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                        {"type": "input_text", "text": "Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Nice"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
    ]))
    assert [(m.role, m.content) for m in job.messages or []] == [
        ("system", "Be brief."), ("system", "Use tools."), ("user", "Weather in Paris?"),
        ("assistant", "Let me look."), ("tool", "sunny"), ("tool", "rain")]
    assert [c.id for c in job.messages[3].tool_calls or []] == ["call_1", "call_2"]
    assert [m.tool_call_id for m in job.messages[4:]] == ["call_1", "call_2"]
    assert job.max_tokens == 32 and job.tools and job.tools[0].function.name == "get_weather"


def test_a_call_without_a_preceding_assistant_message_opens_one():
    job = to_job_request(request(input=[{"role": "user", "content": "hi"},
                                        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                                        {"type": "function_call_output", "call_id": "c", "output": "ok"}]))
    assert [(m.role, m.content) for m in job.messages or []] == [("user", "hi"), ("assistant", ""), ("tool", "ok")]


def test_text_format_tool_choice_and_sampling_reach_the_job():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    job = to_job_request(request(text={"format": {"type": "json_schema", "name": "a", "schema": schema}},
                                 temperature=0.2, top_p=0.5))
    assert job.sampling.json_schema == schema and job.sampling.temperature == 0.2 and job.sampling.top_p == 0.5
    job = to_job_request(request(tools=[TOOL], parallel_tool_calls=True,
                                 tool_choice={"type": "function", "name": "get_weather"}))
    assert job.tool_choice.function.name == "get_weather" and job.parallel_tool_calls       # type: ignore[union-attr]
    assert to_job_request(request(text={"format": {"type": "json_object"}})).sampling.json_schema == {"type": "object"}
    assert to_job_request(request(text={"format": {"type": "text"}})).sampling.json_schema is None
    assert to_job_request(request(tools=[TOOL], tool_choice="required")).tool_choice == "required"


def test_a_forced_call_is_not_shaped_by_text_format():
    """instructor's Responses mode forces its tool and sends the same schema as text.format: the reply is a
    call, which the format cannot shape (OpenAI accepts the pair). Under auto the reply may be text, and the
    job refuses tools with a format, naming tools."""
    fmt = {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}}
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        job = to_job_request(request(tools=[TOOL], tool_choice=choice, text=fmt))
        assert job.sampling.json_schema is None and job.tools
    assert refusal(tools=[TOOL], tool_choice="auto", text=fmt).param == "tools"


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"tools": [{"type": "web_search"}]}, "tools[0]", "'web_search'"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0]", "'file_search'"),
    ({"tools": [{"type": "computer_use_preview"}]}, "tools[0]", "'computer_use_preview'"),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools[0]", "'code_interpreter'"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "only OpenAI hosts"),
    ({"tools": [{"type": "custom", "name": "f"}]}, "tools[0]", "'custom' is not served"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice", "'allowed_tools'"),
    ({"tool_choice": {"type": "function", "name": "nowhere"}, "tools": [TOOL]}, "tool_choice", "'nowhere'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "?"}]}, "input[0].call_id", "call_x"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id", "required"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content",
     "'input_image'"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "stored responses"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type", "'web_search_call'"),
    ({"conversation": "conv_1"}, "conversation", "not supported"),
    ({"background": True, "store": False}, "background", "store"),
    ({"truncation": "auto"}, "truncation", "never drops"),
    ({"temperature": 3}, "temperature", "2"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
    ({"top_logprobs": 3}, "top_logprobs", "not supported"),
])
def test_bad_input_is_refused_naming_the_field(fields: dict, param: str, words: str):
    error = refusal(**fields)
    assert error.status == 400 and param in (error.param or "") + error.message, error.body()
    assert words in error.message, error.body()


def test_off_values_of_unserved_fields_and_ignored_fields_pass():
    job = to_job_request(request(previous_response_id=None, background=False, store=True, user="u",
                                 include=["reasoning.encrypted_content"], truncation="disabled",
                                 reasoning={"effort": "low"}, service_tier="auto", text={"verbosity": "low"}))
    assert job.messages and job.messages[0].content == "hi"


def result(text: str = "", *, reason: FinishReason = FinishReason.STOP, reasoning: str = "",
           calls: list[ToolCallSpec] | None = None) -> JobResult:
    usage = Usage(prompt_tokens=10, completion_tokens=5, cached_prompt_tokens=4, reasoning_tokens=3 if reasoning else 0)
    choice = ChoiceResult(index=0, text=text, reasoning=reasoning, tool_calls=calls or [], finish_reason=reason,
                          usage=usage, timings=Timings())
    return JobResult(id="j1", status=JobStatus.SUCCEEDED, text=text, finish_reason=reason, usage=usage,
                     choices=[choice], worker="w1", attempts=1)


def test_a_result_is_a_response_with_items_usage_and_echoed_settings():
    call = ToolCallSpec.model_validate({"id": "call_a", "function": {"name": "get_weather",
                                                                     "arguments": '{"city": "Paris"}'}})
    body = request(instructions="Be brief.", tools=[TOOL], temperature=0, metadata={"k": "v"})
    response = json.loads(to_response(result("Looking.", reasoning="hm", calls=[call], reason=FinishReason.TOOL_CALLS),
                                      body, "m", 100).model_dump_json())
    assert response["id"] == "resp_j1" and response["object"] == "response" and response["status"] == "completed"
    assert [item["type"] for item in response["output"]] == ["reasoning", "message", "function_call"]
    assert response["output"][0]["content"] == [{"type": "reasoning_text", "text": "hm"}]
    assert response["output"][1]["content"][0] == {"type": "output_text", "text": "Looking.", "annotations": [],
                                                   "logprobs": []}
    assert response["output"][2] | {"id": None} == {"type": "function_call", "id": None, "call_id": "call_a",
                                                    "name": "get_weather", "arguments": '{"city": "Paris"}',
                                                    "status": "completed"}
    assert response["usage"] == {"input_tokens": 10,
                                 "input_tokens_details": {"cache_write_tokens": 0, "cached_tokens": 4},
                                 "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 3},
                                 "total_tokens": 15}
    assert response["instructions"] == "Be brief." and response["tools"][0]["name"] == "get_weather"
    assert response["temperature"] == 0 and response["metadata"] == {"k": "v"}
    assert response["incomplete_details"] is None
    assert response["slotq"] == {"job_id": "j1", "worker": "w1", "attempts": 1}


def test_a_reply_cut_by_max_output_tokens_is_incomplete_without_its_unfinished_call():
    cut = ToolCallSpec.model_validate({"id": "call_a", "function": {"name": "f", "arguments": '{"city": "Par'}})
    response = to_response(result(calls=[cut], reason=FinishReason.LENGTH), request(), "m", 100)
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output == []
    cut_text = to_response(result("Once upon", reason=FinishReason.LENGTH), request(), "m", 100)
    assert [(item.type, item.status) for item in cut_text.output] == [("message", "incomplete")]


# ---------------------------------------------------------------------- the event stream
def entry(n: int, kind: EntryKind = EntryKind.CHUNK, **fields) -> StreamEntry:
    return StreamEntry(id=f"100-{n}", kind=kind, attempt=1, **fields)


REPLY = [
    entry(1, reasoning="Hm, "), entry(2, reasoning="weather."), entry(3, text="Let me "), entry(4, text="look."),
    entry(5, tool_calls=[ToolCallDelta(index=0, id="call_1", name="get_weather", arguments='{"ci')]),
    entry(6, tool_calls=[ToolCallDelta(index=0, arguments='ty": "Paris"}')]),
    entry(7, EntryKind.ERROR, error=ErrorInfo(code="worker_lost", message="x", retryable=True)),   # retried
    entry(8, EntryKind.DONE, finish_reason=FinishReason.TOOL_CALLS, final=True, worker="w1",
          usage=Usage(prompt_tokens=9, completion_tokens=6)),
]


def rendered(renderer: ResponseEventRenderer, entries: list[StreamEntry]) -> list[dict]:
    lines = renderer.opening() + [line for e in entries for line in renderer.feed(e)]
    events = []
    for line in lines:
        head, data = line.strip().split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        events.append(event)
    return events


def shell(**fields) -> Response:
    return response_shell(request(**fields), "j1", "m", 100)


def test_a_reply_streams_as_the_event_sequence_the_sdk_reads():
    events = rendered(ResponseEventRenderer(shell()), REPLY)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [(e["type"], e.get("output_index")) for e in events] == [
        ("response.created", None), ("response.in_progress", None),
        ("response.output_item.added", 0), ("response.reasoning_text.delta", 0), ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.content_part.added", 1), ("response.output_text.delta", 1),
        ("response.output_text.delta", 1), ("response.output_text.done", 1), ("response.content_part.done", 1),
        ("response.output_item.done", 1),
        ("response.output_item.added", 2), ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.delta", 2), ("response.function_call_arguments.done", 2),
        ("response.output_item.done", 2), ("response.completed", None)]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert events[14]["item"] == {"type": "function_call", "id": "fc_j1_0", "call_id": "call_1", "name": "get_weather",
                                  "arguments": "", "status": "in_progress"}
    assert events[11]["text"] == "Let me look." and events[17]["arguments"] == '{"city": "Paris"}'
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["usage"]["total_tokens"] == 15
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"] == [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert final["slotq"]["worker"] == "w1"


def test_a_resumed_stream_sends_exactly_the_events_after_starting_after():
    whole = rendered(ResponseEventRenderer(shell()), REPLY)
    for cut in (0, 1, 5, 13, len(whole) - 2):
        resumed = rendered(ResponseEventRenderer(shell(), starting_after=cut), REPLY)
        assert resumed == whole[cut + 1:]


def test_a_cut_reply_is_incomplete_and_a_failed_job_is_response_failed():
    cut = rendered(ResponseEventRenderer(shell()), [
        entry(1, text="Once"), entry(2, EntryKind.DONE, finish_reason=FinishReason.LENGTH, final=True)])
    assert cut[-1]["type"] == "response.incomplete"
    assert cut[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut[-2]["item"]["status"] == "incomplete"
    failed = rendered(ResponseEventRenderer(shell()), [
        entry(1, text="Once"),
        entry(2, EntryKind.ERROR, final=True, error=ErrorInfo(code="engine_error", message="boom", retryable=False))])
    assert failed[-1]["type"] == "response.failed" and failed[-1]["response"]["status"] == "failed"
    # the SDK's ResponseError declares its codes: ours, a worker's fault, is a server_error of type engine_error
    assert failed[-1]["response"]["error"] == {"code": "server_error", "message": "job j1 failed: boom",
                                               "type": "engine_error", "param": None}
    ResponseFailedEvent.model_validate(failed[-1])
    cancelled = rendered(ResponseEventRenderer(shell()), [
        entry(1, EntryKind.DONE, finish_reason=FinishReason.CANCELLED, final=True)])
    assert cancelled[-1]["response"]["error"]["type"] == "job_cancelled"
    ResponseFailedEvent.model_validate(cancelled[-1])
