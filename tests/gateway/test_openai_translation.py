"""One OpenAI translation (slotq.jobs.openai) for the gateway's routes and OpenAI Batch lines.

Every request case runs through both: the gateway's HTTP answer (the app in-process on the suite's
Valkey; no worker runs, so a body the translation accepts reaches routing and gets the unknown
model's 404) and a batch line's error record, built as the bulk runner builds it. A refused body
must get the same status and the same error object, parameter and message, either way.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from slotq.jobs.bulk.formats import LineError, error_record, output_record, parse_line
from slotq.jobs.bulk.openai_batch import KEY_SET_BY_BULK, Endpoint
from slotq.jobs.gateway.app import create_app
from slotq.jobs.gateway.settings import GatewaySettings
from slotq.jobs.openai.translate import format_shapes_reply, to_response
from slotq.jobs.protocol.schemas import ChoiceResult, JobResult, JobStatus
from slotq.jobs.protocol.wire import FinishReason, NamedToolChoice, Usage

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TEXT = {"model": "m", "prompt": "once"}
FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
NO_MODEL = "model_not_found"        # what an accepted body meets next: routing, with no worker serving "m"


def case(id: str, body: dict[str, Any], param: str | None = None, code: str = "invalid_value", *words: str,
         endpoint: Endpoint = Endpoint.CHAT) -> Any:
    """A body; with ``param``/``code``, the 400 both paths must give (its message holding ``words``)."""
    return pytest.param(endpoint, body, (param, code, words) if param or words else None, id=id)


def chat(**fields: Any) -> dict[str, Any]:
    return CHAT | fields


def text(**fields: Any) -> dict[str, Any]:
    return TEXT | fields


CASES = [
    # ---- accepted by both (the batch lines refused the first eight before the translators were one)
    case("grammar", chat(grammar='root ::= "a"')),
    case("json_schema", chat(json_schema={"type": "object"})),
    case("llama-extras", chat(ignore_eos=True, repeat_last_n=32, top_k=5, min_p=0.1, repeat_penalty=1.1)),
    case("slotq-extras", chat(priority=5, lane="interactive", deadline=4102444800, keep_on_disconnect=True)),
    case("off-values-dropped", chat(logprobs=False, top_logprobs=0, tools=[], tool_choice="none", best_of=1)),
    case("ignored", chat(user="u", store=False, service_tier="auto", parallel_tool_calls=True)),
    case("metadata-not-only-strings", chat(metadata={"k": 1, "ok": True})),
    case("echoed-assistant-message", chat(messages=[{"role": "user", "content": "a"}, {
        "role": "assistant", "content": "b", "refusal": None, "annotations": []}, {"role": "user", "content": "c"}])),
    case("text-parts-and-developer", chat(messages=[{"role": "developer", "content": "be brief"}, {
        "role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])),
    case("response-format", chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}})),
    case("json-object", chat(response_format={"type": "json_object"}, max_completion_tokens=9, n=3, seed=4,
                             stop=["a", "b", "c", "d"], logit_bias={"13": -100})),
    case("one-prompt-list", text(prompt=["only"], n=2), endpoint=Endpoint.TEXT),
    case("logprobs", chat(logprobs=True, top_logprobs=20)),
    case("completion-logprobs", text(logprobs=5), endpoint=Endpoint.TEXT),
    # ---- OpenAI's own bounds (the batch lines had slotq's looser ones: temperature <= 5, 16 stops)
    case("temperature", chat(temperature=3), "temperature", "invalid_value", "less than or equal to 2", "got 3"),
    case("stops", chat(stop=list("abcde")), "stop", "invalid_value", "at most 4 stop strings"),
    case("top_logprobs", chat(logprobs=True, top_logprobs=21), "top_logprobs", "invalid_value",
         "less than or equal to 20", "got 21"),
    case("top_logprobs-alone", chat(top_logprobs=2), "top_logprobs", "invalid_value", "needs logprobs: true"),
    case("completion-logprobs-limit", text(logprobs=6), "logprobs", "invalid_value", "less than or equal to 5",
         endpoint=Endpoint.TEXT),
    # ---- slotq's limits, under the body's names
    case("top_p", chat(top_p=7), "top_p", "invalid_value", "less than or equal to 1", "got 7"),
    case("max_tokens", chat(max_tokens=0), "max_tokens", "invalid_value", "greater than or equal to 1"),
    case("max_completion_tokens", chat(max_tokens=99, max_completion_tokens=0), "max_completion_tokens"),
    case("n", chat(n=65), "n", "invalid_value", "less than or equal to 64"),
    case("repeat_last_n", chat(repeat_last_n=-5), "repeat_last_n"),
    case("lane", chat(lane="Not A Lane"), "lane", "invalid_value", "should match pattern"),
    case("metadata-nested", chat(metadata={"k": {"deep": 1}}), "metadata.k.str"),
    case("grammar-and-schema", chat(json_schema={"type": "object"}, grammar='root ::= "a"'), None, "invalid_value",
         "give either grammar or json_schema"),
    # ---- response_format (a batch line took a schema-less json_schema as {"type": "object"})
    case("schema-less", chat(response_format={"type": "json_schema"}), "response_format", "invalid_value",
         "needs a json_schema object"),
    case("schema-not-json", chat(response_format={"type": "json_schema", "json_schema": {
        "schema": {"x": float("nan")}}}), "response_format", "invalid_value", "plain JSON"),
    case("format-and-grammar", chat(response_format={"type": "json_object"}, grammar='root ::= "a"'),
         "response_format", "invalid_value", "not several"),
    # ---- what slotq cannot honour, named
    case("tools", chat(tools=[{"type": "function"}]), "tools[0].function", "missing_required_parameter", "required"),
    # a forced call is not shaped by response_format (instructor sends both); under auto the pair is refused
    case("forced-call-with-format", chat(tools=[FN], tool_choice="required", response_format={"type": "json_object"})),
    case("auto-call-with-format", chat(tools=[FN], response_format={"type": "json_object"}), "tools", "invalid_value",
         "cannot be combined"),
    case("functions", chat(functions=[{"name": "f"}]), "functions", "unsupported_parameter", "not supported by slotq"),
    case("tool-choice-without-tools", chat(tool_choice="required"), "tool_choice", "invalid_value", "needs tools"),
    case("best_of", chat(best_of=3), "best_of", "unsupported_parameter"),
    case("tenant", chat(tenant="other"), "tenant", "unsupported_parameter"),
    case("image-part", chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
         "messages[0].content", "invalid_value", "only 'text' parts"),
    case("tool-calls", chat(messages=[{"role": "assistant", "tool_calls": [{"id": "x"}]}]),
         "messages[0].tool_calls[0].function", "missing_required_parameter", "required"),
    # ---- loose values, refused as OpenAI's API refuses them
    case("logprobs-yes", chat(logprobs="yes"), "logprobs", "invalid_value", "valid boolean"),
    case("stream-one", chat(stream=1), "stream", "invalid_value", "valid boolean"),
    case("unknown-tool-call-id", chat(messages=[{"role": "user", "content": "hi"},
                                                {"role": "tool", "tool_call_id": "call_x", "content": "21 C"}]),
         "messages[1].tool_call_id", "invalid_value", "'call_x' answers no tool call"),
    case("call-arguments-not-json", chat(messages=[{"role": "user", "content": "hi"}, {
        "role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                             "function": {"name": "f", "arguments": "{oops"}}]}]),
         "messages[1]", "invalid_value", "tool_calls[0].function.arguments: not JSON"),
    # ---- shape
    case("no-messages", chat(messages=[]), "messages", "invalid_value", "at least 1 item"),
    case("role", chat(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
    case("empty-model", chat(model=""), "model", "invalid_value", "at least 1 character"),
    case("no-model", {"messages": CHAT["messages"]}, "model", "missing_required_parameter", "model: required"),
    case("two-prompts", text(prompt=["a", "b"]), "prompt", "invalid_value", "one prompt per request",
         endpoint=Endpoint.TEXT),
    case("no-prompt", {"model": "m"}, "prompt", "missing_required_parameter", endpoint=Endpoint.TEXT),
]


@pytest.fixture
async def http(redis_url: str, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway's app in this process (its lifespan connects to the suite's Valkey)."""
    app = create_app(GatewaySettings(_env_file=None, gateway_files_dir=tmp_path), redis_url)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
        yield client


def batch_line(endpoint: Endpoint, body: dict[str, Any], custom_id: str = "req-1") -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": endpoint.value, "body": body}).encode()


def batch_record(endpoint: Endpoint, body: dict[str, Any]) -> dict[str, Any] | None:
    """The line's error record as the runner writes it; None when the line becomes a job."""
    try:
        parse_line(batch_line(endpoint, body), 7, lane="bulk")
    except LineError as exc:
        return error_record(7, exc.error, format=exc.format, key=exc.key, job_id=None, response=exc.response)
    return None


@pytest.mark.parametrize(("endpoint", "body", "refusal"), CASES)
async def test_gateway_and_batch_lines_answer_a_body_alike(http: httpx.AsyncClient, endpoint: Endpoint,
                                                           body: dict[str, Any], refusal: Any) -> None:
    content = json.dumps(body)
    answers = [await http.post(path, content=content, headers={"content-type": "application/json"})
               for path in (endpoint.value, "/v1/jobs")]
    record = batch_record(endpoint, body)
    for answer in answers:                      # /v1/jobs reads the same bodies (kind by "messages")
        error = answer.json()["error"]
        if refusal is None:
            assert (answer.status_code, error["code"]) == (404, NO_MODEL), error
            continue
        param, code, words = refusal
        assert answer.status_code == 400 and (error["param"], error["code"]) == (param, code), error
        assert error["message"].startswith(f"{param}: " if param else ""), error
        for word in words:
            assert word in error["message"], error
    if refusal is None:
        assert record is None
        return
    assert record is not None
    assert record == {"id": None, "custom_id": "req-1", "line": 7, "error": None,
                      "response": {"status_code": 400, "request_id": None, "body": answers[0].json()}}


def test_a_line_takes_the_runs_lane_unless_it_names_one() -> None:
    line = parse_line(batch_line(Endpoint.CHAT, chat()), 1, lane="bulk")
    assert (line.request.lane, line.model, line.key) == ("bulk", "m", "req-1")
    assert parse_line(batch_line(Endpoint.CHAT, chat(lane="interactive")), 1, lane="bulk").request.lane == "interactive"


@pytest.mark.parametrize(("field", "value", "words"), [
    ("stream", True, "a batch line cannot stream"),
    ("idempotency_key", "k", KEY_SET_BY_BULK),
])
def test_what_only_a_batch_line_refuses(field: str, value: Any, words: str) -> None:
    """A line has no connection to stream to, and its job id is derived from the input."""
    record = batch_record(Endpoint.CHAT, chat(**{field: value}))
    assert record is not None and record["response"]["status_code"] == 400
    error = record["response"]["body"]["error"]
    assert (error["param"], error["code"]) == (field, "invalid_value") and words in error["message"]


@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.TEXT])
def test_a_batch_lines_output_is_the_gateways_response_object(endpoint: Endpoint) -> None:
    jid = "bulk:0123456789abcdef:4"
    choices = [ChoiceResult(index=i, text=f"out {i}", finish_reason=reason, usage=Usage(completion_tokens=2),
                            timings={}) for i, reason in enumerate((FinishReason.STOP, FinishReason.LENGTH))]
    result = JobResult(id=jid, status=JobStatus.SUCCEEDED, text="out 0", finish_reason=FinishReason.STOP,
                       usage=Usage(prompt_tokens=3, completion_tokens=4, cached_prompt_tokens=1), choices=choices,
                       worker="w1", attempts=1)
    body = CHAT if endpoint == Endpoint.CHAT else TEXT
    line = parse_line(batch_line(endpoint, body | {"n": 2}), 4, lane="bulk")
    record = output_record(line, jid, result)
    response = record["response"]["body"]
    gateway = to_response(endpoint.kind, result, "m", response["created"]).model_dump(mode="json")
    assert response == gateway and record["response"]["status_code"] == 200
    assert [c["finish_reason"] for c in response["choices"]] == ["stop", "length"]
    assert response["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                 "prompt_tokens_details": {"cached_tokens": 1},
                                 "completion_tokens_details": {"reasoning_tokens": 0}}
    if endpoint == Endpoint.CHAT:
        assert response["choices"][0]["message"] == {"role": "assistant", "content": "out 0", "refusal": None}


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_an_embedding_lines_output_is_the_gateways_response_object(encoding_format: str) -> None:
    jid = "bulk:0123456789abcdef:5"
    vectors = np.array([[0.6, -0.8], [1.0, 0.0]], "<f4")
    result = JobResult(id=jid, status=JobStatus.SUCCEEDED, usage=Usage(prompt_tokens=7), worker="w1", attempts=1,
                       embeddings=[base64.b64encode(v.tobytes()).decode() for v in vectors], dimensions=2)
    body = {"model": "m", "input": ["a", "b"], "encoding_format": encoding_format}
    line = parse_line(batch_line(Endpoint.EMBEDDINGS, body), 5, lane="bulk")
    assert line.request.inputs == ["a", "b"] and line.request.lane == "bulk"
    response = output_record(line, jid, result)["response"]["body"]
    gateway = to_response("embedding", result, "m", 0, encoding_format).model_dump(mode="json")
    assert response == gateway and response["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    first = response["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(first), "<f4") if encoding_format == "base64" else np.array(first)
    assert np.allclose(decoded, vectors[0])


def test_an_embedding_body_is_refused_as_the_gateway_refuses_it() -> None:
    record = batch_record(Endpoint.EMBEDDINGS, {"model": "m", "input": "x", "dimensions": 8})
    assert record is not None and record["response"]["body"]["error"]["param"] == "dimensions"
    record = batch_record(Endpoint.EMBEDDINGS, {"model": "m", "input": []})
    assert record is not None and record["response"]["body"]["error"]["param"] == "input"


def test_the_translation_does_not_load_the_web_stack() -> None:
    """Batch lines use it in ``slotq bulk``, which must not need FastAPI to start."""
    code = ("import sys, slotq.jobs.bulk.formats, slotq.jobs.openai.translate; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fastapi', 'starlette', 'uvicorn')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_the_translation_and_bulk_load_no_part_of_the_gateway() -> None:
    """The translation is shared, not the gateway's: ``slotq.jobs.openai`` loads neither the gateway
    nor bulk, and bulk (which the gateway's Batch API runs) loads no part of the gateway."""
    code = ("import sys, slotq.jobs.openai.translate; "
            "print(sorted(m for m in sys.modules if m.startswith(('slotq.jobs.gateway', 'slotq.jobs.bulk')))); "
            "import slotq.jobs.bulk, slotq.jobs.bulk.formats, slotq.jobs.bulk.openai_batch, slotq.jobs.bulk.runner; "
            "print(sorted(m for m in sys.modules if m.startswith('slotq.jobs.gateway')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split("\n")[:2] == ["[]", "[]"]


@pytest.mark.parametrize(("tool_choice", "shapes"), [
    (None, True), ("auto", True), ("none", True), ("required", False),
    (NamedToolChoice(function={"name": "f"}), False),             # a chat request's named function
    ({"type": "function", "name": "f"}, False),                   # a Responses request's
])
def test_a_response_format_shapes_the_reply_unless_a_call_is_forced(tool_choice: Any, shapes: bool) -> None:
    assert format_shapes_reply([FN], tool_choice) is shapes
    assert format_shapes_reply(None, tool_choice) and format_shapes_reply([], tool_choice)   # no tools: always
