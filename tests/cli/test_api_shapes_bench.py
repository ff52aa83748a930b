"""``slotq bench api-shapes``' pure parts, which decide what its tables say without running it.

* Key paths carry their value types, a list's items share ``[]``, and a key one side leaves out is
  listed once, not with everything under it.
* A stream's event types collapse runs (``x+``) and their difference names what each side alone sends.
* The SDK check picks the stream event type by its ``type`` tag, reports a required field left out
  by its path, and the keys the SDK does not declare (what the SDK keeps as extras).
* A server's error is shown as its status, and a skipped llama-server says why.
"""

from __future__ import annotations

from typing import Any

from openai.types.responses import Response, ResponseStreamEvent

from bench.api_shapes import (
    chat_chunk_kind,
    collapsed,
    grouped,
    key_paths,
    only_in,
    sdk_issues,
    sequence_diff,
    sse_events,
    tables,
    typed,
)


def _shape(data: Any, event: str = "") -> set[tuple[str, str]]:
    return {(event, line) for line in typed(key_paths(data))}


def test_key_paths_carry_types_and_list_items_share_a_path() -> None:
    paths = key_paths({"a": [{"b": 1}, {"b": "x", "c": None}], "d": True})
    assert paths == {"a": {"array"}, "a[]": {"object"}, "a[].b": {"number", "str"}, "a[].c": {"null"},
                     "d": {"bool"}}


def test_a_key_one_side_leaves_out_is_listed_once() -> None:
    ours = _shape({"usage": {"input_tokens": 1, "details": {"cached": 0}}, "id": "x"})
    theirs = _shape({"usage": None, "id": "x"})
    assert grouped(only_in(ours, theirs)) == ["usage: object"]
    assert grouped(only_in(theirs, ours)) == ["usage: null"]


def test_stream_paths_are_grouped_by_the_events_that_carry_them() -> None:
    ours = _shape({"sequence_number": 0}, "response.created") | _shape({"sequence_number": 1}, "response.completed")
    assert grouped(only_in(ours, set())) == ["sequence_number: number (completed, created)"]


def test_event_sequences_collapse_runs_and_differ_by_side() -> None:
    body = ("event: message_start\ndata: {\"type\": \"message_start\"}\n\n: comment\n\n"
            "data: {\"type\": \"ping\"}\n\n" + "data: {\"type\": \"content_block_delta\"}\n\n" * 3 +
            "data: {\"choices\": [{\"delta\": {\"content\": \"hi\"}}]}\n\ndata: [DONE]\n\n")
    kinds = collapsed(event.type for event in sse_events(body))
    assert kinds == ["message_start", "ping", "content_block_delta+", "content", "[DONE]"]
    assert sequence_diff(kinds, ["message_start", "content_block_delta+", "text", "[DONE]"]) == [
        "-ping", "-content", "+text"]


def test_a_chat_chunk_is_typed_by_what_it_carries() -> None:
    assert chat_chunk_kind({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == "role"
    assert chat_chunk_kind({"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]}) == "tool_calls"
    assert chat_chunk_kind({"choices": [{"delta": {}, "finish_reason": "stop"}]}) == "finish"
    assert chat_chunk_kind({"choices": [], "usage": {"total_tokens": 3}}) == "usage"
    assert chat_chunk_kind({"choices": [{"delta": {"content": ""}}]}) == "empty"


def test_the_sdk_check_names_missing_and_undeclared_fields() -> None:
    response = {"id": "resp_1", "object": "response", "created_at": 1, "model": "m", "output": [],
                "parallel_tool_calls": False, "tool_choice": "auto", "slotq": {"job_id": "1"}}
    assert sdk_issues(Response, response) == {("", "missing tools"), ("", "undeclared slotq")}
    delta = {"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0, "content_index": 0,
             "delta": "hi", "logprobs": []}
    # of the event union's dozens of members, only the one tagged response.output_text.delta reports
    assert sdk_issues(ResponseStreamEvent, delta, "delta") == {("delta", "missing sequence_number")}
    assert sdk_issues(ResponseStreamEvent, {**delta, "sequence_number": 3}) == set()


def test_the_tables_show_an_error_and_a_skipped_peer() -> None:
    rows = [{"route": "/v1/responses", "case": "plain", "sdk_type": "openai.types.responses.Response",
             "status": {"slotq": 400}, "errors": {"slotq": "bad"}, "sdk": {"slotq": []}},
            {"route": "/v1/messages", "case": "plain", "sdk_type": "anthropic.types.Message",
             "status": {"slotq": 200}, "errors": {}, "sdk": {"slotq": ["undeclared slotq"]}}]
    text = tables(rows, {"llama-server": "not built"})
    assert "| /v1/responses | plain | slotq HTTP 400<br>slotq: bad | slotq HTTP 400<br>slotq: bad | - |" in text
    assert "| /v1/messages | plain | - | - | - |" in text
    assert "| /v1/responses | plain | `openai.types.responses.Response` | HTTP 400: bad | - |" in text
    assert "| /v1/messages | plain | `anthropic.types.Message` | `undeclared slotq` | - |" in text
    assert text.endswith("Skipped llama-server: not built")
