"""The HTTP gateway end to end: real Valkey, ``slotq worker`` and ``slotq gateway`` processes,
the official ``openai`` package (sync and async) as the client, and raw SSE over httpx where the
test needs to see event ids.

The stack (module scope): worker A serves ``tiny-a`` on the default queue with a long context (so
jobs can run for seconds), worker B serves ``tiny-b`` on ``slotq:queue:b``; gateway 1 (0.5 s
keep-alives) and gateway 2 are open, gateway 3 wants API keys and allows 2 jobs per queue.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai import AsyncOpenAI, OpenAI
from redis.asyncio import Redis

from slotq.jobs.protocol import dead_letters
from slotq.jobs.protocol.wire import ErrorInfo
from slotq.jobs.worker.served_model import gguf_fingerprint
from tests.support.gateway import Event, Stack, chunk_text, free_port, sse_events
from tests.support.jobs import SLOTQ_BIN, clean_env
from tests.support.processes import wait_for

pytestmark = pytest.mark.timeout(180)

KEYS = ("sk-test-one", "sk-test-two")
LONG = 12_000          # tokens: seconds of generation on worker A (ctx 16384), to be cut short by the test
PROMPT = [{"role": "user", "content": "Tell me about queues."}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Iterator[Stack]:
    with Stack.started(tmp_path_factory.mktemp("gateway"), tiny_model_path) as s:
        s.start_worker("gw-worker-a", "tiny-a", ctx=16_384)
        s.start_worker("gw-worker-b", "tiny-b", queue="slotq:queue:b", slots=2)
        s.start_gateway("gateway-1", gateway_keepalive_s=0.5)
        s.start_gateway("gateway-2")
        s.start_gateway("gateway-3", api_keys=",".join(KEYS), max_queue_length=2, cors_origins="https://app.example")
        for gateway in s.gateways:
            gateway.wait_ready()
        s.wait_for_models({"tiny-a", "tiny-b"})
        yield s


def sdk(url: str, api_key: str = "unused") -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=60)


def greedy(**extra: Any) -> dict[str, Any]:
    """extra_body for a deterministic, fixed-length reply."""
    return {"ignore_eos": True, **extra}


def job(url: str, job_id: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    response = httpx.get(f"{url}/v1/jobs/{job_id}", headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def wait_job(url: str, job_id: str, status: str | tuple[str, ...] = ("succeeded", "failed", "cancelled"),
             timeout: float = 60, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """Poll the job until its status is one of ``status``, with ``headers`` (the key of its tenant)."""
    wanted = (status,) if isinstance(status, str) else status
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = job(url, job_id, headers)
        if body["status"] in wanted:
            return body
        time.sleep(0.05)
    raise TimeoutError(f"job {job_id} still {body['status']} after {timeout} s")


def post_stream(url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None, *,
                stop_after: int | None = None) -> tuple[int, list[Event], list[str]]:
    """POST a streaming request; read events until the end, or close the connection after
    ``stop_after`` events with an id (a client dropping). Returns status, events, comments."""
    events: list[Event] = []
    comments: list[str] = []
    with httpx.stream("POST", f"{url}{path}", json=body, headers=headers, timeout=60) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, [Event(None, response.text)], []
        for item in sse_events(response.iter_lines()):
            if isinstance(item, str):
                comments.append(item)
                continue
            events.append(item)
            if stop_after is not None and sum(e.id is not None for e in events) >= stop_after:
                break
    return 200, events, comments


def get_events(url: str, job_id: str, headers: dict[str, str] | None = None, *, after: str | None = None,
               stop_after: int | None = None,
               on_comment: Callable[[list[str]], None] | None = None) -> tuple[list[Event], list[str]]:
    """The job's events and comments; ``on_comment`` is told the comments so far as each arrives."""
    events: list[Event] = []
    comments: list[str] = []
    params = {"after": after} if after else None
    with httpx.stream("GET", f"{url}/v1/jobs/{job_id}/events", params=params, headers=headers, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for item in sse_events(response.iter_lines()):
            if isinstance(item, str):
                comments.append(item)
                if on_comment is not None:
                    on_comment(comments)
                continue
            events.append(item)
            if stop_after is not None and len(events) >= stop_after:
                break
    return events, comments


def fleet(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/api/fleet", timeout=10).json()


def wait_idle(url: str, worker: str, timeout: float = 30) -> None:
    """Until the worker's heartbeat reports no busy slot."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = {w["id"]: w["slots_busy"] for w in fleet(url)["workers"]}
        if busy.get(worker) == 0:
            return
        time.sleep(0.1)
    raise TimeoutError(f"{worker} still has busy slots: {busy}")


def stream_request(key: str, max_tokens: int = LONG, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny-a", "messages": PROMPT, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0, "idempotency_key": key, **extra}


# ---------------------------------------------------------------------- the OpenAI API, happy paths
def test_models_lists_what_live_workers_serve(stack):
    models = {m.id: m for m in sdk(stack.url).models.list()}
    assert set(models) == {"tiny-a", "tiny-b"}
    assert models["tiny-b"].model_extra["queue"] == "slotq:queue:b"
    assert models["tiny-a"].model_extra["slots_total"] == 4


def test_chat_completion_sync_with_usage(stack):
    reply = sdk(stack.url).chat.completions.create(model="tiny-a", messages=PROMPT, max_tokens=12, temperature=0,
                                                   extra_body=greedy())
    assert reply.object == "chat.completion"
    assert reply.id == f"chatcmpl-{reply.slotq['job_id']}"
    [choice] = reply.choices
    assert choice.finish_reason == "length" and choice.index == 0
    assert choice.message.role == "assistant" and choice.message.content
    assert reply.usage.completion_tokens == 12
    assert reply.usage.prompt_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12
    assert reply.slotq["worker"] == "gw-worker-a"
    stored = job(stack.url, reply.slotq["job_id"])
    assert stored["result"]["text"] == choice.message.content
    assert stored["response"]["choices"][0]["message"]["content"] == choice.message.content


def test_chat_stream_sync_with_include_usage(stack):
    chunks = list(sdk(stack.url).chat.completions.create(
        model="tiny-a", messages=PROMPT, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=greedy()))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finishing] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == wait_job(stack.url, chunks[0].id.removeprefix("chatcmpl-"))["result"]["text"]


def test_completions_stream_and_not(stack):
    client = sdk(stack.url)
    whole = client.completions.create(model="tiny-a", prompt="Once upon a time", max_tokens=10, temperature=0,
                                      extra_body=greedy(lane="bulk"))
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 10
    parts = list(client.completions.create(model="tiny-a", prompt="Once upon a time", max_tokens=10, temperature=0,
                                           stream=True, extra_body=greedy()))
    assert "".join(p.choices[0].text for p in parts if p.choices) == whole.choices[0].text   # greedy: same text
    assert parts[-1].choices[0].finish_reason == "length"


async def test_async_client_concurrent_streams(stack):
    client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)

    async def chat(i: int) -> tuple[str, int]:
        stream = await client.chat.completions.create(
            model="tiny-a", messages=[{"role": "user", "content": f"question {i}"}], max_tokens=8 + i,
            stream=True, stream_options={"include_usage": True}, extra_body=greedy())
        text, usage = "", 0
        async for chunk in stream:
            text += "".join(c.delta.content or "" for c in chunk.choices)
            usage = chunk.usage.completion_tokens if chunk.usage else usage
        return text, usage

    async def complete(i: int) -> int:
        reply = await client.completions.create(model="tiny-b", prompt=f"number {i}", max_tokens=5 + i,
                                                extra_body=greedy())
        return reply.usage.completion_tokens

    results = await asyncio.gather(*(chat(i) for i in range(4)), *(complete(i) for i in range(3)))
    assert [usage for _text, usage in results[:4]] == [8, 9, 10, 11]
    assert all(text for text, _usage in results[:4])
    assert results[4:] == [5, 6, 7]
    await client.close()


def test_stop_string_ends_the_reply_before_it(stack):
    client = sdk(stack.url)
    base = client.completions.create(model="tiny-a", prompt="stop test", max_tokens=40, temperature=0,
                                     extra_body=greedy()).choices[0].text
    # a printable two-character stop string from the middle of the greedy reply
    at = next(i for i in range(6, len(base) - 2) if base[i:i + 2].isascii() and base[i:i + 2].isprintable()
              and base[i:i + 2].strip() == base[i:i + 2])
    stop = base[at:at + 2]
    cut = client.completions.create(model="tiny-a", prompt="stop test", max_tokens=40, temperature=0, stop=stop,
                                    extra_body=greedy())
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == base[:base.index(stop)]
    streamed = list(client.completions.create(model="tiny-a", prompt="stop test", max_tokens=40, temperature=0,
                                              stop=[stop], stream=True, extra_body=greedy()))
    assert "".join(p.choices[0].text for p in streamed) == cut.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "stop"


SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 2, "maximum": 40},   # llguidance enforces bounds (issue 32)
    },
    "required": ["ok", "color", "count"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("prompt", ["json please", "colour", "x"])
def test_json_schema_output_parses_and_validates(stack, prompt):
    reply = sdk(stack.url).chat.completions.create(
        model="tiny-a", messages=[{"role": "user", "content": prompt}], max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}})
    assert reply.choices[0].finish_reason == "stop"        # the grammar closed the object
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)


def test_the_probes_schema_bombs_cost_their_sender_nothing_beyond_its_limits(stack):
    """Issue 32's probe: a 200-byte schema with minItems 10^8 took a worker to 12 GB and the next
    request got a 503. It now runs in bounded work (llguidance keeps repetitions symbolic); an enum
    of 100,000 values is refused before it is queued, naming the parameter and the limit."""
    bomb = {"type": "array", "minItems": 100_000_000, "items": {"type": "string"}}
    reply = httpx.post(f"{stack.url}/v1/chat/completions", timeout=60, json={
        "model": "tiny-a", "messages": PROMPT, "max_tokens": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": bomb}}})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] == "length"

    enum = {"enum": [f"v{i}" for i in range(100_000)]}
    reply = httpx.post(f"{stack.url}/v1/chat/completions", timeout=60, json={
        "model": "tiny-a", "messages": PROMPT, "max_tokens": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": enum}}})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "response_format" and error["message"].startswith("response_format: ")
    assert "SLOTQ_GRAMMAR_INITIAL_FUEL" in error["message"]

    after = sdk(stack.url).chat.completions.create(model="tiny-a", messages=PROMPT, max_tokens=4,
                                                   extra_body=greedy())
    assert after.usage.completion_tokens == 4                # the worker serves on


def test_n_choices_stream_and_not(stack):
    client = sdk(stack.url)
    reply = client.chat.completions.create(model="tiny-a", messages=PROMPT, n=3, max_tokens=6, temperature=1.0,
                                           seed=7, extra_body=greedy())
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage.completion_tokens == 18
    assert all(c.finish_reason == "length" for c in reply.choices)

    chunks = list(client.chat.completions.create(model="tiny-a", messages=PROMPT, n=2, max_tokens=6, temperature=1.0,
                                                 seed=7, stream=True, extra_body=greedy()))
    texts = {0: "", 1: ""}
    reasons = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert reasons == {0: "length", 1: "length"}
    stored = wait_job(stack.url, chunks[0].id.removeprefix("chatcmpl-"))["result"]["choices"]
    assert {c["index"]: c["text"] for c in stored} == texts


# ---------------------------------------------------------------------- tool calls
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"enum": ["Paris", "Tokyo"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "the forecast", "parameters": WEATHER}}]


def test_a_forced_tool_call_through_the_sdk_streamed_and_not(stack):
    client = sdk(stack.url)
    ask = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    reply = client.chat.completions.create(model="tiny-a", messages=ask, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200, temperature=0)
    [choice] = reply.choices
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    # streamed: the SDK's own accumulation of delta.tool_calls gives the same call
    with client.chat.completions.stream(model="tiny-a", messages=ask, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=200, temperature=0) as stream:
        final = stream.get_final_completion()
    [streamed] = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)

    # the second turn: the call and its result go back; the job's result has them in OpenAI's shape
    again = client.chat.completions.create(model="tiny-a", max_tokens=300, temperature=0, tools=TOOLS,
                                           parallel_tool_calls=False, messages=[
        *ask, choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}])
    assert again.choices[0].finish_reason in ("stop", "tool_calls", "length")
    stored = job(stack.url, reply.slotq["job_id"])
    assert stored["result"]["choices"][0]["tool_calls"][0]["function"] == call.function.model_dump()


def test_ignore_eos_with_callable_tools_is_a_400_naming_it(stack):
    # A call is grammar-constrained and ends with end-of-generation, which ignore_eos bans.
    body = {"model": "tiny-a", "messages": PROMPT, "max_tokens": 3, "tools": TOOLS, "ignore_eos": True}
    reply = httpx.post(f"{stack.url}/v1/chat/completions", timeout=60, json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "ignore_eos"
    reply = httpx.post(f"{stack.url}/v1/chat/completions", timeout=60, json={**body, "tool_choice": "none"})
    assert reply.status_code == 200, reply.text


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)       # the tiny model's strings run on until a limit
    country: str = pydantic.Field(max_length=8)


class Trip(pydantic.BaseModel):
    """What pydantic writes for a nested model: ``$ref`` into the parameters' own ``$defs``."""

    origin: City
    destination: City


def test_tool_parameters_with_refs_into_their_own_defs(stack):
    client = sdk(stack.url)
    tool = openai.pydantic_function_tool(Trip)
    assert tool["function"]["parameters"]["properties"]["origin"] == {"$ref": "#/$defs/City"}
    reply = client.chat.completions.create(model="tiny-a", messages=[{"role": "user", "content": "Plan a trip"}],
                                           tools=[tool], tool_choice="required", parallel_tool_calls=False,
                                           max_tokens=400, temperature=0)
    [call] = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "Trip"
    Trip.model_validate_json(call.function.arguments)


def test_a_tool_call_cut_by_max_tokens_finishes_with_length(stack):
    """As OpenAI answers: 200, ``finish_reason: length``, the call as far as it came (a 5xx would
    make the SDKs retry the same request three times)."""
    client = sdk(stack.url)
    ask = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    reply = client.chat.completions.create(model="tiny-a", messages=ask, tools=TOOLS, tool_choice="required",
                                           max_tokens=58, temperature=0)
    [choice] = reply.choices
    assert choice.finish_reason == "length" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and not call.function.arguments.endswith("}")
    # streamed: the SDK's helper raises on a length finish, as against OpenAI, holding the completion
    with (pytest.raises(openai.LengthFinishReasonError) as cut,
          client.chat.completions.stream(model="tiny-a", messages=ask, tools=TOOLS, tool_choice="required",
                                         max_tokens=58, temperature=0) as stream):
        stream.get_final_completion()
    final = cut.value.completion
    assert final.choices[0].finish_reason == "length"
    assert final.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    assert job(stack.url, reply.slotq["job_id"])["status"] == "succeeded"


@pytest.mark.parametrize("fields", [{"n": 4}, {"parallel_tool_calls": True}])
def test_cut_calls_of_several_choices_or_parallel_calls_finish_with_length(stack, fields):
    """The probe's other cut calls: several choices each forced to call (n up to the worker's slots;
    the probe's n=8 ran on 8), or calls in parallel, all cut by max_tokens, are a 200 whose choices
    finish with ``length``, never a 5xx the SDKs retry."""
    reply = sdk(stack.url).chat.completions.create(
        model="tiny-a", messages=[{"role": "user", "content": "Weather in Paris for 3 days?"}], tools=TOOLS,
        tool_choice="required", max_tokens=58, temperature=0, **fields)
    assert len(reply.choices) == fields.get("n", 1)
    for choice in reply.choices:
        assert choice.finish_reason == "length" and choice.message.content is None
        assert choice.message.tool_calls and choice.message.tool_calls[0].function.name == "get_weather"
    assert job(stack.url, reply.slotq["job_id"])["status"] == "succeeded"


def test_tool_calls_resume_with_last_event_id_exactly_once(stack):
    key = f"tools-{uuid.uuid4().hex}"
    body = {"model": "tiny-a", "messages": PROMPT, "stream": True, "max_tokens": 200, "idempotency_key": key,
            "keep_on_disconnect": True, "temperature": 0, "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "note", "parameters": {
                "type": "object", "required": ["text"], "additionalProperties": False,
                "properties": {"text": {"type": "string", "maxLength": 60}}}}}]}
    status, first, _ = post_stream(stack.url, "/v1/chat/completions", body, stop_after=4)
    assert status == 200
    last_id = [e.id for e in first if e.id][-1]
    _, rest, _ = post_stream(stack.url, "/v1/chat/completions", body, {"Last-Event-ID": last_id})

    def pieces(events: list[Event]) -> list[dict[str, Any]]:
        return [call for e in events if e.data.startswith('{"id"') and e.json()["choices"]
                for call in e.json()["choices"][0]["delta"].get("tool_calls") or ()]
    calls: dict[int, dict[str, str]] = {}
    for piece in pieces(first) + pieces(rest):
        call = calls.setdefault(piece["index"], {"id": "", "name": "", "arguments": ""})
        if piece.get("id"):
            assert not call["id"], "a call was started twice"
            call["id"], call["name"] = piece["id"], piece["function"]["name"]
        call["arguments"] += piece["function"].get("arguments") or ""
    result = wait_job(stack.url, key)["result"]["choices"][0]["tool_calls"]
    assert [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in result] == [calls[i] for i in sorted(calls)]


# ---------------------------------------------------------------------- resumable streams
def test_resume_with_last_event_id_gets_exactly_the_rest(stack):
    key = f"resume-{uuid.uuid4().hex}"
    body = stream_request(key, max_tokens=3000, keep_on_disconnect=True)
    status, first, _ = post_stream(stack.url, "/v1/chat/completions", body, stop_after=5)     # then drop
    assert status == 200
    last_id = [e.id for e in first if e.id][-1]
    status, rest, _ = post_stream(stack.url, "/v1/chat/completions", body, {"Last-Event-ID": last_id})
    assert status == 200
    assert rest[-1].data == "[DONE]"
    assert not any(e.data.startswith('{"id"') and e.json()["choices"] and e.json()["choices"][0]["delta"].get("role")
                   for e in rest), "a resumed stream does not repeat the opening role chunk"

    ids = [e.id for e in first + rest if e.id]
    assert len(ids) == len(set(ids)), "an event was repeated"
    assert ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))
    result = wait_job(stack.url, key)["result"]
    assert result["usage"]["completion_tokens"] == 3000
    assert chunk_text(first) + chunk_text(rest) == result["text"]
    # every entry of the job's stream was delivered exactly once across the two connections
    native, _ = get_events(stack.url, key)
    assert [e.id for e in native] == ids

    # the official SDK resumes the same way (extra header), from the middle
    middle = ids[len(ids) // 2]
    resumed = sdk(stack.url).chat.completions.create(
        model="tiny-a", messages=PROMPT, max_tokens=3000, stream=True,
        extra_headers={"Last-Event-ID": middle}, extra_body={"idempotency_key": key})
    text = "".join(c.choices[0].delta.content or "" for c in resumed if c.choices)
    position = ids.index(middle) + 1
    expected = "".join(e.json()["text"] for e in native[position:] if e.event == "chunk")
    assert text == expected


def test_native_events_resume_with_after_and_last_event_id(stack):
    created = httpx.post(f"{stack.url}/v1/jobs", json={"model": "tiny-b", "prompt": "events", "max_tokens": 40,
                                                       "ignore_eos": True}, timeout=30)
    assert created.status_code == 202
    job_id = created.json()["id"]
    assert created.headers["location"] == f"/v1/jobs/{job_id}"
    events, _ = get_events(stack.url, job_id)
    assert [e.event for e in events][-1] == "done" and events[-1].json()["final"] is True
    kinds = {e.event for e in events}
    assert kinds == {"chunk", "done"}
    middle = events[len(events) // 2].id
    after, _ = get_events(stack.url, job_id, after=middle)
    header, _ = get_events(stack.url, job_id, {"Last-Event-ID": middle}, after="0-0")   # the header wins
    assert [e.id for e in after] == [e.id for e in header] == [e.id for e in events[len(events) // 2 + 1:]]


# ---------------------------------------------------------------------- disconnects and background jobs
def test_disconnect_cancels_the_job_and_frees_its_slot(stack):
    key = f"drop-{uuid.uuid4().hex}"
    status, events, _ = post_stream(stack.url, "/v1/chat/completions", stream_request(key), stop_after=3)
    assert status == 200 and len(events) >= 3
    cancelled = wait_job(stack.url, key, "cancelled", timeout=15)
    assert cancelled["result"]["usage"]["completion_tokens"] < LONG
    wait_idle(stack.url, "gw-worker-a")
    metrics = httpx.get(f"{stack.url}/metrics", timeout=10).text
    assert "slotq_gateway_disconnect_cancels_total" in metrics


def test_non_streaming_client_leaving_cancels_too(stack):
    key = f"leave-{uuid.uuid4().hex}"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{stack.url}/v1/chat/completions", json=stream_request(key) | {"stream": False}, timeout=1.0)
    _wait_exists(stack.url, key)                 # on a busy machine the gateway may enqueue after the client left
    wait_job(stack.url, key, "cancelled", timeout=15)


def test_kept_and_background_jobs_survive_their_client_leaving(stack):
    key = f"keep-{uuid.uuid4().hex}"
    status, _events, _ = post_stream(stack.url, "/v1/chat/completions",
                                     stream_request(key, max_tokens=2000, keep_on_disconnect=True), stop_after=2)
    assert status == 200
    created = httpx.post(f"{stack.url}/v1/jobs", json={"model": "tiny-a", "prompt": "background", "max_tokens": 2000,
                                                       "ignore_eos": True}, timeout=30)
    assert created.status_code == 202 and created.json()["status"] in ("queued", "running")
    background = created.json()["id"]
    get_events(stack.url, background, stop_after=2)          # a reader comes and goes
    for job_id in (key, background):
        done = wait_job(stack.url, job_id)
        assert done["status"] == "succeeded", done
        assert done["result"]["usage"]["completion_tokens"] == 2000
    assert wait_job(stack.url, background)["response"]["object"] == "text_completion"
    # cancelling a finished job changes nothing; cancelling a running one stops it
    assert httpx.delete(f"{stack.url}/v1/jobs/{background}", timeout=10).json()["cancelled"] is False
    running = httpx.post(f"{stack.url}/v1/jobs", json={"model": "tiny-a", "prompt": "stop me", "max_tokens": LONG,
                                                       "ignore_eos": True}, timeout=30).json()["id"]
    get_events(stack.url, running, stop_after=1)
    assert httpx.delete(f"{stack.url}/v1/jobs/{running}", timeout=10).json()["cancelled"] is True
    assert wait_job(stack.url, running, "cancelled", timeout=15)["result"]["usage"]["completion_tokens"] < LONG


# ---------------------------------------------------------------------- errors
def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize(("extra", "param"), [
    ({"temperature": 9}, "temperature"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"top_k": -1}, "top_k"),
    ({"stop": ["a"] * 20}, "stop"),
    ({"logit_bias": {"abc": 1}}, "logit_bias.abc"),
    ({"frobnicate": True}, "frobnicate"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"idempotency_key": "bad key!"}, "idempotency_key"),
    ({"lane": "Not A Lane"}, "lane"),
    ({"lane": "overnight"}, "lane"),          # well formed, but not one of the queue's lanes
])
def test_400_names_the_parameter(stack, extra, param):
    body = {"model": "tiny-a", "messages": PROMPT} | extra
    response = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    assert param.split(".")[0].split("[")[0] in error["message"]


def test_400_from_the_worker_and_through_the_sdk(stack):
    client = sdk(stack.url)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny-a", messages=PROMPT, temperature=7)
    assert _error(caught.value)["param"] == "temperature"
    # max_tokens beyond the context that worker B advertises: refused before it is queued
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny-b", messages=PROMPT, max_completion_tokens=600)
    error = _error(caught.value)
    assert (error["param"], error["code"]) == ("max_completion_tokens", "context_length_exceeded")
    # a prompt too long for worker B's 512-token context: only the worker can count its tokens;
    # streaming or not, the answer is a 400
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="tiny-b", prompt="x" * 3000, max_tokens=10, stream=stream)
        assert _error(caught.value)["code"] == "prompt_too_long"
    response = httpx.post(f"{stack.url}/v1/chat/completions", json=stream_request("k1"),
                          headers={"Last-Event-ID": "yesterday"}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "Last-Event-ID"


def test_404_unknown_model_and_job(stack):
    with pytest.raises(openai.NotFoundError) as caught:
        sdk(stack.url).chat.completions.create(model="gpt-9", messages=PROMPT)
    error = _error(caught.value)
    assert error["param"] == "model" and error["code"] == "model_not_found" and "tiny-a" in error["message"]
    for method in ("GET", "DELETE"):
        response = httpx.request(method, f"{stack.url}/v1/jobs/no-such-job", timeout=10)
        assert response.status_code == 404 and response.json()["error"]["code"] == "job_not_found"
    response = httpx.get(f"{stack.url}/v1/jobs/no-such-job/events", timeout=10)
    assert response.status_code == 404
    response = httpx.post(f"{stack.url}/v1/chat/completions", json=stream_request("never-created-key"),
                          headers={"Last-Event-ID": "1-0"}, timeout=10)
    assert response.status_code == 404


def test_401_without_a_valid_key(stack):
    url = stack.gateways[2].url
    for key in ("", "sk-wrong"):
        with pytest.raises(openai.AuthenticationError) as caught:
            sdk(url, api_key=key or "none").models.list()
        assert _error(caught.value)["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/api/fleet", timeout=10).status_code == 401
    assert {m.id for m in sdk(url, api_key=KEYS[1]).models.list()} == {"tiny-a", "tiny-b"}
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200      # probes need no key
    assert httpx.get(f"{url}/", timeout=10).status_code == 200            # the page itself holds no data


def test_cors_for_the_configured_origins_only(stack):
    url = stack.gateways[2].url              # SLOTQ_CORS_ORIGINS=https://app.example
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    allowed = httpx.options(f"{url}/v1/chat/completions", headers={"Origin": "https://app.example"} | preflight)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    refused = httpx.options(f"{url}/v1/chat/completions", headers={"Origin": "https://evil.example"} | preflight)
    assert "access-control-allow-origin" not in refused.headers
    reply = httpx.get(f"{url}/v1/models",
                      headers={"Origin": "https://app.example", "Authorization": f"Bearer {KEYS[0]}"})
    assert reply.headers["access-control-allow-origin"] == "https://app.example"
    health = httpx.get(f"{stack.url}/health", headers={"Origin": "https://app.example"})
    assert "access-control-allow-origin" not in health.headers


def test_429_with_retry_after_when_the_queue_is_full(stack):
    """Gateway 3 allows 2 waiting jobs per queue: with worker A's 4 slots busy and 2 jobs waiting,
    the next request is refused with Retry-After."""
    url = stack.gateways[2].url              # SLOTQ_MAX_QUEUE_LENGTH=2
    client = sdk(url, api_key=KEYS[0])
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    wait_idle(stack.url, "gw-worker-a")
    held = []
    try:
        for i in range(6):
            held.append(httpx.post(f"{url}/v1/jobs", headers=headers, timeout=30, json={
                "model": "tiny-a", "prompt": f"hold {i}", "max_tokens": LONG, "ignore_eos": True}).json()["id"])
            if i < 4:
                wait_job(url, held[-1], "running", headers=headers)      # the 4 slots fill, then 2 wait
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model="tiny-a", prompt="one too many", max_tokens=4)
        assert caught.value.response.headers["retry-after"] == "2"
        assert _error(caught.value)["code"] == "queue_full"
    finally:
        for job_id in held:
            httpx.delete(f"{url}/v1/jobs/{job_id}", headers=headers, timeout=10)
    for job_id in held:
        wait_job(url, job_id, "cancelled", timeout=15, headers=headers)


def test_504_when_the_deadline_passes(stack):
    client = sdk(stack.url)
    # passed before the job started
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="tiny-a", messages=PROMPT, max_tokens=8,
                                       extra_body={"deadline": time.time() - 1})
    assert caught.value.status_code == 504 and _error(caught.value)["code"] == "deadline_exceeded"
    # passed while generating: the partial result stays at /v1/jobs/{id}
    key = f"deadline-{uuid.uuid4().hex}"
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="tiny-a", messages=PROMPT, max_tokens=LONG,
                                       extra_body=greedy(deadline=time.time() + 0.5, idempotency_key=key))
    assert caught.value.status_code == 504
    partial = wait_job(stack.url, key)["result"]
    assert partial["finish_reason"] == "deadline" and 0 < partial["usage"]["completion_tokens"] < LONG
    # streaming: the chunks so far, then an error event the SDK raises
    stream = client.chat.completions.create(model="tiny-a", messages=PROMPT, max_tokens=LONG, stream=True,
                                            extra_body=greedy(deadline=time.time() + 0.5))
    received: list[Any] = []
    with pytest.raises(openai.APIError) as caught:
        received.extend(stream)
    assert caught.value.body["code"] == "deadline_exceeded"
    assert any(c.choices and c.choices[0].delta.content for c in received)


def test_409_when_someone_cancels_a_waiting_request(stack):
    key = f"cancelled-{uuid.uuid4().hex}"
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            sdk(stack.url).chat.completions.create(model="tiny-a", messages=PROMPT, max_tokens=LONG,
                                                   extra_body=greedy(idempotency_key=key))
        except openai.APIStatusError as exc:
            outcome["error"] = exc

    caller = threading.Thread(target=call)
    caller.start()
    _wait_exists(stack.url, key)
    get_events(stack.url, key, stop_after=1)         # generating
    assert httpx.delete(f"{stack.url}/v1/jobs/{key}", timeout=10).json()["cancelled"] is True
    caller.join(30)
    assert outcome["error"].status_code == 409 and _error(outcome["error"])["code"] == "job_cancelled"


def _wait_exists(url: str, job_id: str, timeout: float = 10) -> None:
    wait_for(lambda: httpx.get(f"{url}/v1/jobs/{job_id}", timeout=10).status_code == 200, timeout,
             f"job {job_id} created")


def test_quiet_streams_get_keepalives_and_a_model_without_workers_is_503(stack):
    """Worker C (one slot) serves tiny-c: a job queued behind a long one gets keep-alive comments
    while it waits; once worker C is gone, tiny-c is a 503 (seen recently), not a 404."""
    stack.start_worker("gw-worker-c", "tiny-c", queue="slotq:queue:c", slots=1, ctx=16_384)
    stack.wait_for_models({"tiny-c"})
    ids = [httpx.post(f"{stack.url}/v1/jobs", timeout=30, json={
        "model": "tiny-c", "prompt": f"c {i}", "max_tokens": LONG if i == 0 else 4, "ignore_eos": True}).json()["id"]
        for i in range(2)]
    get_events(stack.url, ids[0], stop_after=1)                    # the first holds the only slot

    def cancel_the_first_after_two_keepalives(comments: list[str]) -> None:
        if len(comments) == 2:
            httpx.delete(f"{stack.url}/v1/jobs/{ids[0]}", timeout=10)

    events, comments = get_events(stack.url, ids[1], on_comment=cancel_the_first_after_two_keepalives)
    assert len(comments) >= 2 and all(c == ": keep-alive" for c in comments)      # gateway 1: every 0.5 s
    assert events[-1].json()["final"] and events[-1].json()["finish_reason"] == "length"

    stack.workers.pop("gw-worker-c").stop()
    wait_for(lambda: "tiny-c" not in {m.id for m in sdk(stack.url).models.list()}, 10, "tiny-c gone from /v1/models")
    with pytest.raises(openai.InternalServerError) as caught:
        sdk(stack.url).chat.completions.create(model="tiny-c", messages=PROMPT)
    assert caught.value.status_code == 503 and _error(caught.value)["code"] == "model_unavailable"


# ---------------------------------------------------------------------- fleet: replicas and models
def test_two_gateways_serve_one_jobs_stream(stack):
    one, two = stack.gateways[0].url, stack.gateways[1].url
    key = f"replicas-{uuid.uuid4().hex}"
    body = stream_request(key, max_tokens=2000, keep_on_disconnect=True)
    _status, first, _ = post_stream(one, "/v1/chat/completions", body, stop_after=4)
    last_id = [e.id for e in first if e.id][-1]
    _status, rest, _ = post_stream(two, "/v1/chat/completions", body, {"Last-Event-ID": last_id})
    assert rest[-1].data == "[DONE]"
    assert chunk_text(first) + chunk_text(rest) == wait_job(two, key)["result"]["text"]
    # two readers on two replicas see the same events
    seen: dict[str, list[Event]] = {}
    readers = [threading.Thread(target=lambda u=u: seen.__setitem__(u, get_events(u, key)[0])) for u in (one, two)]
    for t in readers:
        t.start()
    for t in readers:
        t.join(60)
    assert [(e.id, e.data) for e in seen[one]] == [(e.id, e.data) for e in seen[two]]
    assert len(seen[one]) > 2


def test_two_models_on_two_workers_are_routed_by_model(stack, tiny_model_path):
    """Each reply names the model that served it (the worker's, not the echoed request) and its GGUF's
    fingerprint, streamed or not; none is answered by the other model."""
    client = sdk(stack.gateways[1].url)
    fingerprint = gguf_fingerprint(tiny_model_path)
    for i in range(20):
        model = ("tiny-a", "tiny-b")[i % 2]
        reply = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=4, extra_body=greedy())
        assert reply.model == model and reply.system_fingerprint == fingerprint
        assert reply.slotq["worker"] == {"tiny-a": "gw-worker-a", "tiny-b": "gw-worker-b"}[model]
        expected_queue = {"tiny-a": "slotq:queue", "tiny-b": "slotq:queue:b"}[model]
        stored = job(stack.url, reply.slotq["job_id"])
        assert stored["queue"] == expected_queue and stored["result"]["model"] == model
    chunks = list(client.chat.completions.create(model="tiny-b", messages=PROMPT, max_tokens=4, stream=True,
                                                 extra_body=greedy()))
    assert chunks[-1].model == "tiny-b" and chunks[-1].system_fingerprint == fingerprint


def test_a_worker_of_another_model_on_a_served_queue_is_refused_by_name(stack):
    """Two models, both with the default queue (the way a fleet grows): the second exits before it loads
    its model, naming the queue, the model there and the setting to change; nothing else changes."""
    intruder = stack.start_worker("gw-worker-z", "tiny-z")
    assert intruder.proc.wait(60) == 1
    log = intruder.log_tail()
    stack.workers.pop("gw-worker-z").stop()          # gone: the stack's later waits check its workers live
    assert "queue 'slotq:queue' is served by model 'tiny-a' (generation jobs, worker gw-worker-a)" in log
    assert "this worker serves 'tiny-z'" in log and "SLOTQ_QUEUE_NAME" in log
    assert {m.id for m in sdk(stack.url).models.list()} == {"tiny-a", "tiny-b"}


# ---------------------------------------------------------------------- operations
def test_health_metrics_and_fleet(stack):
    sdk(stack.url).chat.completions.create(model="tiny-b", messages=PROMPT, max_tokens=2)
    health = httpx.get(f"{stack.url}/health", timeout=10).json()
    assert health["status"] == "ok" and health["redis"] == "ok"
    tiny_b = health["models"]["tiny-b"]
    assert (tiny_b["queue"], tiny_b["workers"], tiny_b["slots_total"]) == ("slotq:queue:b", 1, 2)
    metrics = httpx.get(f"{stack.url}/metrics", timeout=10).text
    assert 'slotq_gateway_requests_total{method="POST",route="/v1/chat/completions",status="200"}' in metrics
    assert "slotq_gateway_request_duration_seconds_bucket" in metrics
    state = fleet(stack.url)
    assert {q["queue"] for q in state["queues"]} >= {"slotq:queue", "slotq:queue:b"}
    assert {w["id"] for w in state["workers"]} >= {"gw-worker-a", "gw-worker-b"}


def test_dead_letters_listed_and_requeued(stack):
    """A dead letter as the worker records it when a job exhausts its tries; requeued from the API,
    it runs again for real on the queue it came from."""
    key = f"dead-{uuid.uuid4().hex}"
    reply = sdk(stack.url).completions.create(model="tiny-b", prompt="dead letter", max_tokens=4,
                                              extra_body=greedy(idempotency_key=key))
    assert reply.choices[0].finish_reason == "length"

    async def record() -> None:
        redis = Redis.from_url(stack.redis.url)
        try:
            await dead_letters.record(redis, key, {"prompt": "dead letter", "max_tokens": 4, "ignore_eos": True},
                                      ErrorInfo(code="tries_exhausted", message="test", retryable=True), 5, time.time())
        finally:
            await redis.aclose()

    asyncio.run(record())
    listed = httpx.get(f"{stack.url}/api/dead-letters", timeout=10).json()["data"]
    assert [d["job_id"] for d in listed] == [key]
    assert fleet(stack.url)["dead_letters"] == 1
    response = httpx.post(f"{stack.url}/api/dead-letters/{key}/requeue", timeout=10)
    assert response.json() == {"id": key, "requeued": True}
    done = wait_job(stack.url, key)
    assert done["status"] == "succeeded" and done["queue"] == "slotq:queue:b"
    assert done["result"]["worker"] == "gw-worker-b"
    assert httpx.get(f"{stack.url}/api/dead-letters", timeout=10).json()["data"] == []
    assert httpx.post(f"{stack.url}/api/dead-letters/{key}/requeue", timeout=10).status_code == 404


def test_refuses_to_bind_beyond_loopback_without_keys(tmp_path):
    import subprocess

    proc = subprocess.run([str(SLOTQ_BIN), "gateway", "--host", "0.0.0.0", "--port", str(free_port())],
                          env=clean_env(redis_url="redis://127.0.0.1:1/0"), cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode != 0
    assert "SLOTQ_API_KEYS" in proc.stderr and "0.0.0.0" in proc.stderr


@pytest.mark.fault
def test_a_worker_killed_mid_stream_is_invisible_to_the_sse_client(stack):
    """SIGKILL the worker generating a streamed reply; another worker of the same model takes the
    job over when its lease lapses and resumes it: the client's one stream carries one seamless
    text (the failed attempt shows at most as an SSE comment)."""
    first = stack.start_worker("gw-worker-r1", "tiny-r", queue="slotq:queue:r", slots=1, ctx=16_384)
    stack.wait_for_models({"tiny-r"})
    key = f"killed-{uuid.uuid4().hex}"
    body = stream_request(key, max_tokens=8000) | {"model": "tiny-r"}
    events: list[Event] = []
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for item in sse_events(response.iter_lines()):
            if isinstance(item, str):
                continue
            events.append(item)
            if len(events) == 5:
                first.proc.kill()                                  # mid-reply, no goodbye
                stack.start_worker("gw-worker-r2", "tiny-r", queue="slotq:queue:r", slots=1, ctx=16_384)
    assert events[-1].data == "[DONE]"
    assert not any(e.data.startswith('{"error"') for e in events)
    result = wait_job(stack.url, key)["result"]
    assert result["attempts"] == 2 and result["worker"] == "gw-worker-r2"
    assert result["usage"]["completion_tokens"] == 8000
    assert chunk_text(events) == result["text"]
    stack.workers.pop("gw-worker-r2").stop()
    stack.workers.pop("gw-worker-r1").stop()
