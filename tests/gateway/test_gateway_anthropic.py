"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) through real processes:
Valkey, ``slotq worker`` on the tiny model and ``slotq gateway``, driven with the official
``anthropic`` SDK (and httpx where the wire itself is the point: the event sequence, resuming).

The tiny model's template knows no tools, so its worker uses slotq's generic tool format, and a
forced ``tool_choice`` gives a call whose input validates against the tool's schema. A second
worker serves the tiny model with a template that opens ``<think>`` for the reply: everything it
writes is thinking, which comes back as thinking blocks.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import pytest

from tests.support.gateway import Event, Stack, sse_events
from tests.support.tiny_model import CHATML_TEMPLATE, TINY_SCALE, TINY_SEED, write_tiny_llama

MODEL, THINKER = "tiny", "tiny-think"
KEY = "sk-messages"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 12}}}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Newer SDKs dropped the sampling parameters from create()'s signature; the API (and slotq) still takes them.
GREEDY = {"temperature": 0}
THINKING_TEMPLATE = CHATML_TEMPLATE.replace("<|im_start|>assistant\n{% endif %}",
                                            "<|im_start|>assistant\n<think>\n{% endif %}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Iterator[Stack]:
    folder = tmp_path_factory.mktemp("anthropic")
    thinker = write_tiny_llama(folder / "thinker.gguf", seed=TINY_SEED, scale=TINY_SCALE,
                               chat_template=THINKING_TEMPLATE)
    with Stack.started(folder, tiny_model_path) as s:
        s.start_worker("messages-worker", MODEL, ctx=4096)
        s.start_worker("thinking-worker", THINKER, queue="slotq:queue:think", model=thinker)
        s.start_gateway("messages-open")
        s.start_gateway("messages-keys", api_keys=f"acme={KEY}", tenant_tokens_per_min=100)
        for gateway in s.gateways:
            gateway.wait_ready()
        s.wait_for_models({MODEL, THINKER})
        yield s


@pytest.fixture
def client(stack: Stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0, timeout=60)


def raw_events(url: str, body: dict, headers: dict[str, str] | None = None) -> list[Event]:
    with httpx.stream("POST", f"{url}/v1/messages", json=body | {"stream": True}, headers=headers or {},
                      timeout=60) as response:
        assert response.status_code == 200, response.read()
        return [e for e in sse_events(response.iter_lines()) if isinstance(e, Event)]


# ---------------------------------------------------------------------- messages, streamed and not
def test_a_message_streamed_and_not_through_the_sdk(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, system="Be brief.",
                                     messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}])
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_") and message.model_extra["slotq"]["job_id"]
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 12
    [block] = message.content
    assert block.type == "text" and block.text
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens > 0

    with client.messages.stream(model=MODEL, max_tokens=12, extra_body=GREEDY, system="Be brief.",
                                messages=[{"role": "user", "content": "Hello"}]) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed_text == block.text == final.content[0].text       # greedy on one model: the same reply
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        message.usage.input_tokens + message.usage.cache_read_input_tokens
    # the Message the SDK builds from the stream has every usage field a non-streamed one has
    assert final.usage.model_dump(exclude_none=True).keys() == message.usage.model_dump(exclude_none=True).keys()
    assert final.usage.cache_creation_input_tokens == message.usage.cache_creation_input_tokens == 0


def test_the_stream_is_anthropics_event_sequence(stack: Stack) -> None:
    events = raw_events(stack.url, {"model": MODEL, "max_tokens": 6, "temperature": 0,
                                    "messages": [{"role": "user", "content": "Hi"}]})
    kinds = [e.event for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"], kinds
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"], kinds
    assert set(kinds[3:-3]) == {"content_block_delta"}, kinds
    assert all(e.json()["type"] == e.event for e in events)
    assert events[2].json()["content_block"] == {"type": "text", "text": ""}
    assert {e.json()["delta"]["type"] for e in events[3:-3]} == {"text_delta"}
    delta = events[-2].json()
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 6 and delta["usage"]["input_tokens"] > 0
    start = events[0].json()["message"]["usage"]          # the prompt, known with the first tokens
    # both carry Anthropic's four counts (message_delta's cumulative, as the SDK's MessageDeltaUsage reads them)
    assert start == delta["usage"] | {"output_tokens": 0}
    assert set(start) == {"input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"}
    assert start["cache_creation_input_tokens"] == 0


def test_message_start_counts_the_prompt_through_the_sdk(client: anthropic.Anthropic) -> None:
    conversation = {"system": f"Count {uuid.uuid4().hex}", "messages": ASK}      # cold: no cached prefix
    counted = client.messages.count_tokens(model=MODEL, **conversation)
    with client.messages.stream(model=MODEL, max_tokens=4, extra_body=GREEDY, **conversation) as stream:
        [start] = [event for event in stream if event.type == "message_start"]
        final = stream.get_final_message()
    assert start.message.usage.input_tokens + (start.message.usage.cache_read_input_tokens or 0) == \
        counted.input_tokens == final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) > 0


def test_a_stream_resumes_after_last_event_id_exactly_once(stack: Stack) -> None:
    key = f"messages-{uuid.uuid4().hex}"
    body = {"model": MODEL, "max_tokens": 24, "temperature": 0, "keep_on_disconnect": True,
            "messages": [{"role": "user", "content": "Count"}]}
    whole = raw_events(stack.url, body, {"Idempotency-Key": key})
    cut = next(i for i, e in enumerate(whole) if e.id is not None and e.event == "content_block_delta") + 3
    last_id = next(e.id for e in reversed(whole[:cut]) if e.id is not None)
    resumed = raw_events(stack.url, body, {"Idempotency-Key": key, "Last-Event-ID": last_id})
    seen = [e for e in whole if e.id is not None]
    upto = next(i for i, e in enumerate(whole) if e.id == last_id) + 1
    assert [e.data for e in whole[upto:]] == [e.data for e in resumed], (seen, resumed)
    assert resumed[-1].event == "message_stop"


def test_a_stop_sequence_is_named_as_the_reason_and_the_sequence(stack: Stack, client: anthropic.Anthropic) -> None:
    """A reply that one of ``stop_sequences`` ends says ``stop_reason: stop_sequence`` and which one,
    streamed and not (the SDK reads ``message_delta``), and the job's own result names it too."""
    plain = client.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=ASK)
    text = plain.content[0].text
    assert plain.stop_reason == "max_tokens" and plain.stop_sequence is None
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3) if "\ufffd" not in text[i:i + 3])
    before = text[:text.find(stop)]                    # greedy: the same reply, cut where the stop first appears
    asked = {"model": MODEL, "max_tokens": 24, "extra_body": GREEDY, "messages": ASK,
             "stop_sequences": ["\u2603 never", stop]}
    message = client.messages.create(**asked)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop), (text, message)
    assert "".join(b.text for b in message.content if b.type == "text") == before
    with client.messages.stream(**asked) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    job = httpx.get(f"{stack.url}/v1/jobs/{message.model_extra['slotq']['job_id']}", timeout=30).json()["result"]
    assert job["finish_reason"] == "stop" and job["stop_sequence"] == job["choices"][0]["stop_sequence"] == stop


# ---------------------------------------------------------------------- tools
def test_a_tool_loop_with_tool_use_and_tool_result(client: anthropic.Anthropic) -> None:
    forced = {"type": "tool", "name": "get_weather"}
    first = client.messages.create(model=MODEL, max_tokens=200, extra_body=GREEDY, messages=ASK, tools=TOOLS,
                                   tool_choice=forced)
    assert first.stop_reason == "tool_use", first
    [call] = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER)

    with client.messages.stream(model=MODEL, max_tokens=200, extra_body=GREEDY, messages=ASK, tools=TOOLS,
                                tool_choice=forced) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    [streamed_call] = [b for b in streamed.content if b.type == "tool_use"]
    assert streamed_call.input == call.input and streamed_call.name == call.name

    again = client.messages.create(model=MODEL, max_tokens=300, extra_body=GREEDY, tools=TOOLS,
                                   tool_choice={"type": "auto"}, messages=[
        *ASK, {"role": "assistant", "content": first.content},        # the SDK's blocks, sent back as they came
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}]}])
    assert again.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens > \
        first.usage.input_tokens + first.usage.cache_read_input_tokens

    none = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, messages=ASK, tools=TOOLS,
                                  tool_choice={"type": "none"})
    assert none.stop_reason == "max_tokens" and all(b.type == "text" for b in none.content)


def test_thinking_comes_back_as_thinking_blocks(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model=THINKER, max_tokens=10, extra_body=GREEDY, messages=ASK,
                                     thinking={"type": "enabled", "budget_tokens": 1024})
    [block] = message.content
    assert block.type == "thinking" and block.thinking and message.stop_reason == "max_tokens"
    with client.messages.stream(model=THINKER, max_tokens=10, extra_body=GREEDY, messages=ASK) as stream:
        kinds = {event.delta.type for event in stream if event.type == "content_block_delta"}
        final = stream.get_final_message()
    assert kinds == {"thinking_delta"}
    assert final.content[0].type == "thinking" and final.content[0].thinking == block.thinking


# ---------------------------------------------------------------------- count_tokens
def test_count_tokens_is_what_the_message_is_charged(client: anthropic.Anthropic) -> None:
    for extra in ({}, {"tools": TOOLS}):
        conversation = {"system": f"Count {uuid.uuid4().hex}", "messages": ASK, **extra}   # cold: no cached prefix
        counted = client.messages.count_tokens(model=MODEL, **conversation)
        message = client.messages.create(model=MODEL, max_tokens=1, extra_body=GREEDY, **conversation)
        assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens > 0
    longer = client.messages.count_tokens(model=MODEL, messages=ASK, system="A much longer system prompt than before")
    shorter = client.messages.count_tokens(model=MODEL, messages=ASK, system="Short")
    assert longer.input_tokens > shorter.input_tokens


# ---------------------------------------------------------------------- errors and keys
@pytest.mark.parametrize(("body", "named"), [
    ({"max_tokens": None}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"max_tokens": 10**7}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
    ({"tool_choice": {"type": "tool", "name": "nowhere"}, "tools": TOOLS}, "tool_choice"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"mcp_servers": [{"type": "url", "url": "https://example.com"}]}, "mcp_servers"),
    ({"thinking": {"type": "enabled"}}, "budget_tokens"),
])
def test_bad_input_is_refused_by_name_in_anthropics_shape(stack: Stack, body: dict, named: str) -> None:
    request = {"model": MODEL, "max_tokens": 8, "messages": ASK} | body
    response = httpx.post(f"{stack.url}/v1/messages", json={k: v for k, v in request.items() if v is not None},
                          timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    assert named in error["error"]["message"], error


def test_the_sdk_raises_its_own_errors(stack: Stack, client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=8, messages=ASK, extra_body={"temperature": 3})
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=8, messages=ASK)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="no-such-model", messages=ASK)
    missing = httpx.get(f"{stack.url}/v1/messages/batches", timeout=30)      # Message Batches: not served
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_x_api_key_and_bearer_keys_name_the_tenant(stack: Stack) -> None:
    url = stack.gateways[1].url
    for sdk in (anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0),
                anthropic.Anthropic(base_url=url, auth_token=KEY, max_retries=0)):
        message = sdk.messages.create(model=MODEL, max_tokens=2, messages=ASK)
        assert message.model_extra["slotq"]["job_id"].endswith("acme")    # the key's tenant owns the job
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic.Anthropic(base_url=url, api_key="sk-wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=ASK)
    assert refused.value.body["error"]["type"] == "authentication_error"
    assert "x-api-key" in refused.value.body["error"]["message"]


def test_a_tenants_quota_is_a_rate_limit_error(stack: Stack) -> None:
    """Each request reserves its prompt and 60 tokens of acme's 100 a minute: of three in a row
    (which cross at most one minute) one is refused, in Anthropic's shape with Retry-After."""
    sdk = anthropic.Anthropic(base_url=stack.gateways[1].url, api_key=KEY, max_retries=0, timeout=60)
    refused = []
    for _ in range(3):
        try:
            sdk.messages.create(model=MODEL, max_tokens=60, messages=ASK)
        except anthropic.RateLimitError as exc:
            refused.append(exc)
    assert refused
    assert refused[0].body["error"]["type"] == "rate_limit_error"
    assert refused[0].response.headers["retry-after"]


def test_unknown_fields_and_block_shapes_echo_back(client: anthropic.Anthropic) -> None:
    """What a client sends back from a reply (citations, cache_control, thinking signatures) and
    the fields that change nothing here are accepted."""
    message = client.messages.create(
        model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "x"},
                                              {"type": "text", "text": "Hello", "citations": None}]},
            {"role": "user", "content": "Again"}],
        metadata={"user_id": "u-1"}, service_tier="auto", stop_sequences=["zzzz"],
        extra_body={"top_k": 5, "top_p": 0.9, "temperature": 0.5})
    assert message.stop_reason in ("max_tokens", "end_turn")
    assert json.loads(message.to_json())["usage"]["output_tokens"] <= 4
