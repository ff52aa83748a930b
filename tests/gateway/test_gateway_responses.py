"""OpenAI's Responses API (``/v1/responses``) through real processes: Valkey, ``slotq worker`` on the
tiny model and ``slotq gateway``, driven with the official ``openai`` SDK (``client.responses``),
and httpx where the wire itself is the point.

The tiny model's template knows no tools, so its worker uses slotq's generic tool format, and a
forced ``tool_choice`` gives a call whose arguments validate against the tool's schema. A second
worker serves the tiny model with a template that opens ``<think>`` for the reply: everything it
writes is reasoning, which comes back as a reasoning item.
"""

from __future__ import annotations

import json
import os
import signal
import time
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
import redis
from openai.types.responses import Response as SdkResponse
from openai.types.responses import ResponseItemList, ResponseStreamEvent

from slotq.jobs.gateway.response_store import stored_response_key
from tests.support.gateway import Event, Stack, sse_events
from tests.support.tiny_model import CHATML_TEMPLATE, TINY_SCALE, TINY_SEED, write_tiny_llama

MODEL, THINKER = "tiny", "tiny-think"
KEY, OTHER_KEY = "sk-responses", "sk-responses-globex"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 12}}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": WEATHER, "strict": True}]
ASK = "What is the weather in Paris?"
# A reply the grammar keeps going for a few hundred tokens, whatever the tiny model would rather do
LONG_STORY = {"type": "object", "required": ["story"], "additionalProperties": False,
              "properties": {"story": {"type": "string", "minLength": 400}}}
LONGER_STORY = {"type": "object", "required": ["story"], "additionalProperties": False,
                "properties": {"story": {"type": "string", "minLength": 2000}}}
THINKING_TEMPLATE = CHATML_TEMPLATE.replace("<|im_start|>assistant\n{% endif %}",
                                            "<|im_start|>assistant\n<think>\n{% endif %}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Iterator[Stack]:
    folder = tmp_path_factory.mktemp("responses")
    thinker = write_tiny_llama(folder / "thinker.gguf", seed=TINY_SEED, scale=TINY_SCALE,
                               chat_template=THINKING_TEMPLATE)
    with Stack.started(folder, tiny_model_path) as s:
        s.start_worker("responses-worker", MODEL, ctx=4096)
        s.start_worker("responses-thinker", THINKER, queue="slotq:queue:think", model=thinker)
        s.start_gateway("responses-open")
        s.start_gateway("responses-keys", api_keys=f"acme={KEY},globex={OTHER_KEY}", tenant_tokens_per_min=100)
        for gateway in s.gateways:
            gateway.wait_ready()
        s.wait_for_models({MODEL, THINKER})
        yield s


@pytest.fixture
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)


# ---------------------------------------------------------------------- responses
def test_a_response_to_a_string_and_to_items(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Hello", instructions="Be brief.", max_output_tokens=12,
                                       temperature=0)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert response.output_text and response.output_text == message.content[0].text
    assert response.usage is not None and response.usage.output_tokens == 12 and response.usage.input_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + 12
    assert response.usage.output_tokens_details.reasoning_tokens == 0           # a reply that does not think
    assert response.instructions == "Be brief." and response.max_output_tokens == 12
    assert response.model_extra and response.model_extra["slotq"]["job_id"]

    as_items = client.responses.create(model=MODEL, max_output_tokens=12, temperature=0, input=[
        {"role": "system", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]}])
    assert as_items.output_text == response.output_text        # the same prompt, greedy: the same reply


def test_a_short_reply_is_completed(client: openai.OpenAI) -> None:
    """``text.format`` json_schema with a schema that closes after a few tokens: the reply ends by
    itself (status completed) and parses."""
    schema = {"type": "object", "additionalProperties": False, "required": ["ok"],
              "properties": {"ok": {"type": "boolean"}}}
    response = client.responses.create(model=MODEL, input="Is it sunny?", max_output_tokens=40, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                                                        "strict": True}})
    assert response.status == "completed" and response.incomplete_details is None, response
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text is not None and response.text.format.type == "json_schema"
    anything = client.responses.create(model=MODEL, input="JSON please", max_output_tokens=60, temperature=0,
                                       text={"format": {"type": "json_object"}})
    if anything.status == "completed":
        assert isinstance(json.loads(anything.output_text), dict)


def test_a_function_tool_loop(client: openai.OpenAI) -> None:
    forced = {"type": "function", "name": "get_weather"}
    first = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, tool_choice=forced, max_output_tokens=200,
                                    temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1, first
    [call] = calls
    assert call.name == "get_weather" and call.call_id and call.id
    jsonschema.validate(json.loads(call.arguments), WEATHER)

    # the agent loop: the output items go back as input, with the function's output
    conversation = [{"role": "user", "content": ASK}, *[item.model_dump(exclude_none=True) for item in first.output],
                    {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    again = client.responses.create(model=MODEL, input=conversation, tools=TOOLS, tool_choice="auto",
                                    max_output_tokens=300, temperature=0)
    assert again.status in ("completed", "incomplete")
    assert again.usage is not None and first.usage is not None
    assert again.usage.input_tokens > first.usage.input_tokens      # the call and its output are in the prompt

    none = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, tool_choice="none", max_output_tokens=8,
                                   temperature=0)
    assert [item.type for item in none.output] == ["message"]


def test_reasoning_comes_back_as_a_reasoning_item(client: openai.OpenAI) -> None:
    response = client.responses.create(model=THINKER, input=ASK, max_output_tokens=10, temperature=0,
                                       reasoning={"effort": "low"})
    reasoning = [item for item in response.output if item.type == "reasoning"]
    assert len(reasoning) == 1 and reasoning[0].content and reasoning[0].content[0].text, response
    assert response.status == "incomplete" and response.reasoning is not None
    # the prompt opened <think> and max_output_tokens cut the reply in it: every output token is reasoning
    assert response.usage is not None and response.usage.output_tokens_details.reasoning_tokens == 10
    chat = client.chat.completions.create(model=THINKER, messages=[{"role": "user", "content": ASK}], max_tokens=10,
                                          temperature=0)
    assert chat.usage is not None and chat.usage.completion_tokens_details is not None
    assert chat.usage.completion_tokens_details.reasoning_tokens == chat.usage.completion_tokens == 10
    # sent back with the conversation, a reasoning item is accepted (and left out of the prompt)
    again = client.responses.create(model=MODEL, max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": ASK}, *[item.model_dump(exclude_none=True) for item in response.output],
        {"role": "user", "content": "And tomorrow?"}])
    assert again.output_text is not None


# ---------------------------------------------------------------------- streaming
def test_a_streamed_response_is_the_sdks_event_sequence(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=MODEL, input="Hello", max_output_tokens=12, temperature=0)
    events = list(client.responses.create(model=MODEL, input="Hello", max_output_tokens=12, temperature=0,
                                          stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], kinds
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"], kinds
    assert set(kinds[4:-4]) == {"response.output_text.delta"}, kinds
    assert [event.sequence_number for event in events] == list(range(len(events)))
    streamed = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert streamed == whole.output_text                    # greedy on one model: the same reply
    final = events[-1].response
    assert final.status == "incomplete" and final.output_text == whole.output_text
    assert final.usage is not None and whole.usage is not None and final.usage.output_tokens == 12
    assert final.id == events[0].response.id


def test_a_streamed_function_call_and_the_final_response(client: openai.OpenAI) -> None:
    forced = {"type": "function", "name": "get_weather"}
    whole = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, tool_choice=forced, max_output_tokens=200,
                                    temperature=0)
    with client.responses.stream(model=MODEL, input=ASK, tools=TOOLS, tool_choice=forced, max_output_tokens=200,
                                 temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert kinds[-1] == "response.completed"
    [call] = [item for item in final.output if item.type == "function_call"]
    [expected] = [item for item in whole.output if item.type == "function_call"]
    assert (call.name, call.arguments) == (expected.name, expected.arguments)
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_a_streamed_reasoning_item(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=THINKER, input=ASK, max_output_tokens=10, temperature=0,
                                          stream=True))
    deltas = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    final = events[-1].response
    [reasoning] = [item for item in final.output if item.type == "reasoning"]
    assert deltas and reasoning.content and reasoning.content[0].text == deltas
    assert final.usage is not None and final.usage.output_tokens_details.reasoning_tokens == 10


def _sdk_event_types() -> dict[str, type[pydantic.BaseModel]]:
    """The SDK's stream event types by their ``type`` tag (the SDK tags the union with a marker of its
    own, which pydantic does not read)."""
    union = typing.get_args(ResponseStreamEvent)[0]
    return {typing.get_args(member.model_fields["type"].annotation)[0]: member for member in typing.get_args(union)}


@pytest.mark.parametrize(("model", "body"), [
    (MODEL, {"input": "Hello", "max_output_tokens": 12}),
    (MODEL, {"input": ASK, "tools": TOOLS, "tool_choice": "required", "max_output_tokens": 200}),
    (THINKER, {"input": ASK, "max_output_tokens": 10}),
], ids=["text", "function-call", "reasoning"])
def test_the_response_and_every_event_validate_against_the_sdks_types(stack: Stack, model: str,
                                                                       body: dict[str, Any]) -> None:
    """The SDK builds its objects without validating them: a field its types require that the gateway
    leaves out (``usage.input_tokens_details.cache_write_tokens`` did) reads None where the client's
    type checker promised an int, so the wire is validated here against the SDK's own pydantic types."""
    body = {"model": model, "temperature": 0, **body}
    whole = httpx.post(f"{stack.url}/v1/responses", json=body, timeout=60)
    assert whole.status_code == 200, whole.text
    SdkResponse.model_validate(whole.json())
    event_types = _sdk_event_types()
    with httpx.stream("POST", f"{stack.url}/v1/responses", json=body | {"stream": True}, timeout=60) as streamed:
        events = [e.json() for e in sse_events(streamed.iter_lines()) if isinstance(e, Event)]
    assert events and events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1:]
    for event in events:
        event_types[event["type"]].model_validate(event)


def test_a_stream_refused_at_once_is_an_http_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model=MODEL, input=ASK, max_output_tokens=10**7, stream=True)
    assert bad.value.param == "max_output_tokens"


# ---------------------------------------------------------------------- stored responses
def test_previous_response_id_continues_a_stored_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=6, temperature=0)
    assert first.store is True
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="What is my name?",
                                     max_output_tokens=6, temperature=0)
    assert second.previous_response_id == first.id
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens   # the turn came along
    # the same conversation sent whole reads the same prompt: the same tokens, the same greedy reply
    whole = client.responses.create(model=MODEL, max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": "My name is Ada."}, *[item.model_dump(exclude_none=True) for item in first.output],
        {"role": "user", "content": "What is my name?"}])
    assert whole.usage is not None and whole.usage.input_tokens == second.usage.input_tokens
    assert whole.output_text == second.output_text


def test_a_tool_loop_through_previous_response_id(client: openai.OpenAI) -> None:
    """The agents' pattern: the call's response id and only the function's output go back."""
    first = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, tool_choice="required",
                                    max_output_tokens=200, temperature=0)
    [call] = [item for item in first.output if item.type == "function_call"]
    answer = client.responses.create(model=MODEL, previous_response_id=first.id, tools=TOOLS, max_output_tokens=300,
                                     temperature=0, tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny, 21 C"}])
    assert answer.status in ("completed", "incomplete") and [item.type for item in answer.output] == ["message"]


def test_retrieve_delete_and_what_is_not_stored(client: openai.OpenAI) -> None:
    created = client.responses.create(model=MODEL, input="Hello", max_output_tokens=5, temperature=0,
                                      metadata={"run": "r1"})
    fetched = client.responses.retrieve(created.id)
    assert (fetched.id, fetched.status, fetched.output_text) == (created.id, created.status, created.output_text)
    assert fetched.metadata == {"run": "r1"} and fetched.usage == created.usage
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    unstored = client.responses.create(model=MODEL, input="Hello", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=MODEL, input="Hello", previous_response_id="resp_nope")
    assert missing.value.param == "previous_response_id"


def test_input_items_list_the_conversation_and_input_tokens_count_it(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="My name is Ada.", instructions="Be brief.",
                                    max_output_tokens=4, temperature=0)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="What is my name?",
                                     max_output_tokens=4, temperature=0)
    newest_first = client.responses.input_items.list(second.id)
    kinds = [(item.type, getattr(item, "role", None)) for item in newest_first.data]
    assert kinds == [("message", "user"), ("message", "assistant"), ("message", "user")], kinds
    assert [part.text for part in newest_first.data[2].content] == ["My name is Ada."]
    in_order = client.responses.input_items.list(second.id, order="asc", limit=2)
    assert [item.id for item in in_order.data] == [item.id for item in reversed(newest_first.data)][:2]
    assert in_order.has_more
    rest = client.responses.input_items.list(second.id, order="asc", after=in_order.data[-1].id)
    assert [item.id for item in rest.data] == [newest_first.data[0].id] and not rest.has_more

    counted = client.responses.input_tokens.count(model=MODEL, previous_response_id=first.id,
                                                  input="What is my name?", instructions="Be brief.")
    again = client.responses.create(model=MODEL, previous_response_id=first.id, input="What is my name?",
                                    instructions="Be brief.", max_output_tokens=1, store=False)
    assert again.usage is not None and counted.input_tokens == again.usage.input_tokens > 0
    with_tools = client.responses.input_tokens.count(model=MODEL, input=ASK, tools=TOOLS, tool_choice="required")
    assert with_tools.input_tokens > client.responses.input_tokens.count(model=MODEL, input=ASK).input_tokens


def test_input_items_validate_against_the_sdks_types(stack: Stack, client: openai.OpenAI) -> None:
    """Every item ``input_items`` lists is in the SDK's shape, however the request spelled it: an
    assistant message sent as a string lists as an ``output_text`` part with its ``annotations``, and
    a reasoning item sent bare lists with its ``summary``, and a previous response's call and its
    output list as the SDK's call items."""
    first = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, tool_choice="required",
                                    max_output_tokens=200, temperature=0)
    [call] = [item for item in first.output if item.type == "function_call"]
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=TOOLS, max_output_tokens=4,
                                     temperature=0, input=[
                                         {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
                                         {"role": "assistant", "content": "It is sunny."},
                                         {"role": "assistant", "content": [{"type": "output_text", "text": "Yes."}]},
                                         {"type": "reasoning"},
                                         {"role": "user", "content": "And tomorrow?"}])
    listed = httpx.get(f"{stack.url}/v1/responses/{second.id}/input_items", params={"order": "asc"}, timeout=30)
    assert listed.status_code == 200, listed.text
    items = ResponseItemList.model_validate(listed.json()).data
    assert [item.type for item in items] == ["message", "function_call", "function_call_output", "message", "message",
                                             "reasoning", "message"], items
    assert [part.annotations for item in items[3:5] for part in item.content] == [[], []]


def test_a_stored_response_belongs_to_its_tenant(stack: Stack) -> None:
    url = f"{stack.gateways[1].url}/v1"
    acme = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)
    globex = openai.OpenAI(base_url=url, api_key=OTHER_KEY, max_retries=0, timeout=60)
    created = acme.responses.create(model=MODEL, input="Hello", max_output_tokens=2)
    assert acme.responses.retrieve(created.id).id == created.id
    with pytest.raises(openai.NotFoundError):
        globex.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        globex.responses.create(model=MODEL, input="Hi", previous_response_id=created.id)
    with pytest.raises(openai.NotFoundError):
        globex.responses.delete(created.id)
    assert acme.responses.retrieve(created.id).id == created.id


def test_a_conversation_is_capped_and_a_stored_response_expires(stack: Stack) -> None:
    """``SLOTQ_GATEWAY_RESPONSE_MAX_ITEMS`` caps a ``previous_response_id`` chain (a 400 naming it); a
    stored response lives ``min(SLOTQ_GATEWAY_RESPONSE_TTL_S, SLOTQ_KEEP_RESULT_S)``, then retrieving or
    continuing it is a 404 naming it, as for one never stored."""
    capped = stack.start_gateway("responses-capped", gateway_response_max_items=4)
    brief = stack.start_gateway("responses-brief", keep_result_s=3)
    capped.wait_ready()
    brief.wait_ready()
    client = openai.OpenAI(base_url=f"{capped.url}/v1", api_key="unused", max_retries=0, timeout=60)
    say: dict[str, Any] = {"model": MODEL, "max_output_tokens": 2, "temperature": 0}
    first = client.responses.create(input="Hello", **say)                                  # 2 items: in, out
    second = client.responses.create(previous_response_id=first.id, input="Again", **say)    # 4 items
    with pytest.raises(openai.BadRequestError) as over:
        client.responses.create(previous_response_id=second.id, input="More", **say)       # 5: one too many
    assert over.value.param == "previous_response_id" and "SLOTQ_GATEWAY_RESPONSE_MAX_ITEMS" in over.value.message
    assert [item.type for item in client.responses.input_items.list(second.id, order="asc")] == ["message"] * 3

    client = openai.OpenAI(base_url=f"{brief.url}/v1", api_key="unused", max_retries=0, timeout=60)
    kept = client.responses.create(input="Hello", **say)
    assert kept.model_extra is not None
    with redis.Redis.from_url(stack.redis.url) as db:
        assert 0 < db.ttl(stored_response_key(kept.model_extra["slotq"]["job_id"])) <= 3
    deadline = time.monotonic() + 30
    with pytest.raises(openai.NotFoundError):
        while time.monotonic() < deadline:
            client.responses.retrieve(kept.id)
            time.sleep(0.2)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.create(previous_response_id=kept.id, input="Again", **say)
    assert gone.value.param == "previous_response_id"


# ---------------------------------------------------------------------- background responses
def finished_response(client: openai.OpenAI, response_id: str, timeout: float = 60) -> openai.types.responses.Response:
    deadline = time.monotonic() + timeout
    while (response := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, response
        time.sleep(0.1)
    return response


def test_a_background_response_is_polled_and_its_events_resume_from_starting_after(client: openai.OpenAI) -> None:
    created = client.responses.create(model=MODEL, input="Hello", background=True, max_output_tokens=40,
                                      temperature=0)
    assert created.status == "queued" and created.background is True and created.output == []
    done = finished_response(client, created.id)
    assert done.status == "incomplete" and done.background is True and done.output_text
    whole = [event.model_dump() for event in client.responses.retrieve(created.id, stream=True)]
    assert [event["sequence_number"] for event in whole] == list(range(len(whole)))
    assert whole[-1]["type"] == "response.incomplete" and whole[-1]["response"]["output"] == \
        [item.model_dump() for item in done.output]
    for cut in (3, len(whole) // 2, len(whole) - 2):
        resumed = [event.model_dump() for event in
                   client.responses.retrieve(created.id, stream=True, starting_after=cut)]
        assert [e["sequence_number"] for e in resumed] == list(range(cut + 1, len(whole)))
        assert resumed == whole[cut + 1:]


def test_a_background_response_is_cancelled(client: openai.OpenAI) -> None:
    created = client.responses.create(model=MODEL, input="Hello", background=True, max_output_tokens=1500,
                                      text={"format": {"type": "json_schema", "name": "story",
                                                       "schema": LONGER_STORY}})
    cancelled = client.responses.cancel(created.id)
    assert cancelled.status == "cancelled" and cancelled.error is None, cancelled     # a cancel is no failure
    assert client.responses.retrieve(created.id).status == "cancelled"
    foreground = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(foreground.id)
    with pytest.raises(openai.BadRequestError) as unstored:
        client.responses.create(model=MODEL, input="Hi", background=True, store=False)
    assert unstored.value.param == "background"


def test_a_failed_response_names_an_sdk_error_code_and_slotqs_own(stack: Stack, client: openai.OpenAI) -> None:
    """A job that fails (a prompt past the worker's context, found only by its tokenizer) is a Response
    ``failed``: ``error.code`` one of the codes the SDK's type declares, slotq's own code in ``type``,
    the field in ``param`` (a failed stream's ``response.failed``: tests/gateway/test_responses_translation.py).
    The queued Response the create answers at once is in the SDK's shape too."""
    queued = httpx.post(f"{stack.url}/v1/responses", timeout=30, json={
        "model": MODEL, "input": "a" * 5000, "background": True, "max_output_tokens": 8})
    created = SdkResponse.model_validate(queued.json())
    assert created.status == "queued", created
    failed = finished_response(client, created.id)
    assert failed.status == "failed" and failed.error is not None, failed
    error = failed.error
    assert (error.code, error.type, error.param) == ("invalid_prompt", "prompt_too_long", "input"), error
    SdkResponse.model_validate(httpx.get(f"{stack.url}/v1/responses/{created.id}", timeout=30).json())


def test_an_idempotency_key_gives_the_same_background_response(client: openai.OpenAI) -> None:
    """A client that retries its create (a timeout, a dropped connection) gets the response it
    started, not a second job."""
    key = {"Idempotency-Key": f"responses-{time.time_ns()}"}
    first = client.responses.create(model=MODEL, input="Hello", background=True, max_output_tokens=8,
                                    extra_headers=key)
    again = client.responses.create(model=MODEL, input="Hello", background=True, max_output_tokens=8,
                                    extra_headers=key)
    assert again.id == first.id
    assert finished_response(client, first.id).status in ("completed", "incomplete")


def stream_lines(url: str, **params: object) -> Iterator[Event]:
    with httpx.stream("GET", url, params=params, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for event in sse_events(response.iter_lines()):
            if isinstance(event, Event):
                yield event


@pytest.mark.fault
def test_a_background_stream_survives_a_gateway_killed_mid_stream(stack: Stack) -> None:
    """A background response streamed through one gateway, that gateway killed (-9) after the
    first text delta; a gateway started afresh resumes with starting_after: what the client then holds is
    exactly the events an uninterrupted read gives, each once."""
    first = stack.start_gateway("responses-doomed")
    first.wait_ready()
    created = httpx.post(f"{first.url}/v1/responses", timeout=60, json={
        "model": MODEL, "input": "Hello", "background": True, "max_output_tokens": 600, "temperature": 0,
        "text": {"format": {"type": "json_schema", "name": "story", "schema": LONG_STORY}}}).json()
    assert created["status"] == "queued", created
    seen = []
    for event in stream_lines(f"{first.url}/v1/responses/{created['id']}", stream="true"):
        seen.append(json.loads(event.data))
        if len(seen) == 5:
            os.kill(first.proc.pid, signal.SIGKILL)        # mid-stream: the client holds its first text delta
            break
    first.stop()
    assert all(event["type"] != "response.incomplete" for event in seen)
    second = stack.start_gateway("responses-restarted")
    second.wait_ready()
    url = f"{second.url}/v1/responses/{created['id']}"
    after = seen[-1]["sequence_number"]
    resumed = [json.loads(e.data) for e in stream_lines(url, stream="true", starting_after=after)]
    uninterrupted = [json.loads(e.data) for e in stream_lines(url, stream="true")]
    assert seen + resumed == uninterrupted
    assert [e["sequence_number"] for e in seen + resumed] == list(range(len(uninterrupted)))
    assert seen[-1]["type"] == "response.output_text.delta" and len(resumed) >= 2
    assert resumed[-1]["type"] == uninterrupted[-1]["type"]
    assert resumed[-1]["type"] in ("response.completed", "response.incomplete")
    assert resumed[-1]["response"]["output"] == uninterrupted[-1]["response"]["output"]


@pytest.mark.fault
def test_a_background_response_survives_its_worker_killed_mid_reply(stack: Stack) -> None:
    """Its worker killed (-9) while the reply is being written and a client is reading it: another
    worker resumes the job, and the client resumes with starting_after to exactly the events an
    uninterrupted read of the finished response gives, each once."""
    model, queue = "tiny-fault", "slotq:queue:responses-fault"
    doomed = stack.start_worker("responses-doomed-worker", model, queue=queue, ctx=4096)
    stack.wait_for_models({model})
    story = LONGER_STORY | {"properties": {"story": {"type": "string", "minLength": 3000}}}   # the kill comes mid-reply
    created = httpx.post(f"{stack.url}/v1/responses", timeout=60, json={
        "model": model, "input": "Hello", "background": True, "max_output_tokens": 3500, "temperature": 0,
        "text": {"format": {"type": "json_schema", "name": "story", "schema": story}}}).json()
    url = f"{stack.url}/v1/responses/{created['id']}"
    seen = []
    for event in stream_lines(url, stream="true"):
        seen.append(json.loads(event.data))
        if len(seen) == 5:                              # the first text delta
            status_at_kill = httpx.get(url, timeout=30).json()["status"]
            os.kill(doomed.proc.pid, signal.SIGKILL)
            break
    assert status_at_kill == "in_progress"
    stack.workers.pop(doomed.name).stop()
    stack.start_worker("responses-heir-worker", model, queue=queue, ctx=4096)
    resumed = [json.loads(e.data) for e in stream_lines(url, stream="true", starting_after=seen[-1]["sequence_number"])]
    uninterrupted = [json.loads(e.data) for e in stream_lines(url, stream="true")]
    assert seen + resumed == uninterrupted
    assert [e["sequence_number"] for e in seen + resumed] == list(range(len(uninterrupted)))
    final = uninterrupted[-1]["response"]
    assert final["status"] in ("completed", "incomplete") and final["slotq"]["worker"] == "responses-heir-worker"
    assert resumed[-1]["response"]["output"] == final["output"]
    text = "".join(e["delta"] for e in uninterrupted if e["type"] == "response.output_text.delta")
    assert final["output"][0]["content"][0]["text"] == text


@pytest.mark.fault
def test_a_background_stream_survives_its_worker_and_its_gateway_killed_together(stack: Stack) -> None:
    """The worker writing a background response and the gateway streaming it both killed (-9) at
    once, mid-reply: another worker resumes the job, a gateway started afresh serves starting_after,
    and the client then holds exactly the events an uninterrupted read gives, each once, with the
    text an uninterrupted run of the same request writes (one-token micro-batches: a resumed attempt
    prefills exactly what was decoded, so greedy decoding goes on token for token)."""
    model, queue = "tiny-both", "slotq:queue:responses-both"
    doomed_worker = stack.start_worker("both-doomed-worker", model, queue=queue, ctx=8192, ubatch=1)
    doomed_gateway = stack.start_gateway("both-doomed-gateway")
    doomed_gateway.wait_ready()
    stack.wait_for_models({model}, url=doomed_gateway.url)
    story = LONGER_STORY | {"properties": {"story": {"type": "string", "minLength": 4000}}}   # the kill comes mid-reply
    body = {"model": model, "input": "Hello", "background": True, "max_output_tokens": 4500, "temperature": 0,
            "text": {"format": {"type": "json_schema", "name": "story", "schema": story}}}
    reference = httpx.post(f"{doomed_gateway.url}/v1/responses", timeout=60, json=body).json()
    url = f"{doomed_gateway.url}/v1/responses/{reference['id']}"
    whole = [json.loads(e.data) for e in stream_lines(url, stream="true")]      # uninterrupted, to its end
    created = httpx.post(f"{doomed_gateway.url}/v1/responses", timeout=60, json=body).json()
    url = f"{doomed_gateway.url}/v1/responses/{created['id']}"
    seen = []
    for event in stream_lines(url, stream="true"):
        seen.append(json.loads(event.data))
        if len(seen) == 5:                              # the first text delta
            status_at_kill = httpx.get(url, timeout=30).json()["status"]
            os.kill(doomed_worker.proc.pid, signal.SIGKILL)
            os.kill(doomed_gateway.proc.pid, signal.SIGKILL)
            break
    assert status_at_kill == "in_progress" and seen[-1]["type"] == "response.output_text.delta"
    stack.workers.pop(doomed_worker.name).stop()
    doomed_gateway.stop()
    stack.start_worker("both-heir-worker", model, queue=queue, ctx=8192, ubatch=1)
    gateway = stack.start_gateway("both-restarted-gateway")
    gateway.wait_ready()
    url = f"{gateway.url}/v1/responses/{created['id']}"
    resumed = [json.loads(e.data) for e in stream_lines(url, stream="true", starting_after=seen[-1]["sequence_number"])]
    uninterrupted = [json.loads(e.data) for e in stream_lines(url, stream="true")]
    assert seen + resumed == uninterrupted                                     # exactly once, nothing missing
    assert [e["sequence_number"] for e in seen + resumed] == list(range(len(uninterrupted)))
    final = uninterrupted[-1]["response"]
    assert final["status"] in ("completed", "incomplete") and final["slotq"]["worker"] == "both-heir-worker"
    text = "".join(e["delta"] for e in seen + resumed if e["type"] == "response.output_text.delta")
    assert final["output"][0]["content"][0]["text"] == text
    assert text == whole[-1]["response"]["output"][0]["content"][0]["text"]  # as the run never killed wrote it
    assert (final["status"], final["usage"]["output_tokens"]) == \
        (whole[-1]["response"]["status"], whole[-1]["response"]["usage"]["output_tokens"])


# ---------------------------------------------------------------------- errors and keys
@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0]"),
    ({"tools": [{"type": "computer_use_preview", "display_width": 1, "display_height": 1,
                 "environment": "linux"}]}, "tools[0]"),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools[0]"),
    ({"max_output_tokens": 10**7}, "max_output_tokens"),
    ({"temperature": 9}, "temperature"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "?"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x"}]}]},
     "input[0].content"),
    ({"conversation": "conv_x"}, "conversation"),
    ({"lane": "no-such-lane"}, "lane"),
    ({"tool_choice": {"type": "function", "name": "nowhere"}, "tools": TOOLS}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format"),
])
def test_bad_input_is_refused_by_name_in_openais_shape(stack: Stack, body: dict, param: str) -> None:
    response = httpx.post(f"{stack.url}/v1/responses", json={"model": MODEL, "input": ASK} | body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param.split("[")[0] in error["message"], error
    if param == "tools[0]":
        assert repr(body["tools"][0]["type"]) in error["message"]       # the hosted tool, by name


def test_the_sdk_raises_its_own_errors_and_keys_name_the_tenant(stack: Stack, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model=MODEL, input=ASK, tools=[{"type": "web_search"}])
    assert bad.value.param == "tools[0]" and "web_search" in bad.value.message
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input=ASK)

    url = f"{stack.gateways[1].url}/v1"
    keyed = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)
    response = keyed.responses.create(model=MODEL, input=ASK, max_output_tokens=2)
    assert response.model_extra and response.model_extra["slotq"]["job_id"].endswith("acme")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="sk-wrong", max_retries=0).responses.create(model=MODEL, input=ASK)
    refused = []             # each reserves its prompt and 60 tokens of acme's 100 a minute
    for _ in range(3):
        try:
            keyed.responses.create(model=MODEL, input=ASK, max_output_tokens=60)
        except openai.RateLimitError as exc:
            refused.append(exc)
    assert refused and refused[0].response.headers["retry-after"]
