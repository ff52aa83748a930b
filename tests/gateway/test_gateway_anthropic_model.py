"""The ``anthropic`` SDK against the gateway on the bundled model (issue 45): a two-turn tool loop,
the call streamed and not. The first turn is forced (``tool_choice: any``), as agent loops do while
a tool has not run yet; after the ``tool_result`` the model is free (``auto``) and answers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import jsonschema
import pytest

from tests.support.gateway import Stack

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(300)]

MODEL = "smol"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 40}}}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SYSTEM = "Answer questions about the weather."
GREEDY = {"temperature": 0}     # newer SDKs take sampling parameters only in extra_body


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, real_model_path: Path) -> Iterator[Stack]:
    with Stack.started(tmp_path_factory.mktemp("anthropic-model"), real_model_path) as s:
        s.start_worker("anthropic-model-worker", MODEL, ctx=2048)
        s.start_gateway("anthropic-model-gateway").wait_ready()
        s.wait_for_models({MODEL})
        yield s


def test_the_anthropic_sdk_runs_a_tool_loop_streamed_and_not(stack: Stack) -> None:
    client = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0, timeout=120)
    first = client.messages.create(model=MODEL, max_tokens=64, system=SYSTEM, messages=ASK, tools=TOOLS,
                                   tool_choice={"type": "any"}, extra_body=GREEDY)
    assert first.stop_reason == "tool_use", first
    [call] = [block for block in first.content if block.type == "tool_use"]
    assert call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER)

    with client.messages.stream(model=MODEL, max_tokens=64, system=SYSTEM, messages=ASK, tools=TOOLS,
                                tool_choice={"type": "any"}, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [call.input]

    answer = client.messages.create(model=MODEL, max_tokens=96, system=SYSTEM, tools=TOOLS, extra_body=GREEDY,
                                    messages=[*ASK, {"role": "assistant", "content": first.content},
                                              {"role": "user", "content": [{
                                                  "type": "tool_result", "tool_use_id": call.id,
                                                  "content": f"Sunny and 21 degrees in {call.input['city']}."}]}])
    assert answer.stop_reason == "end_turn", answer
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text.strip()


def test_a_stop_sequence_ends_a_real_reply_and_is_named(stack: Stack) -> None:
    """The model counts; ``stop_sequences`` cut it at the first of them it writes, and the SDK reads
    which (streamed: ``message_delta``, after a ``message_start`` that already counts the prompt)."""
    client = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0, timeout=120)
    ask = {"model": MODEL, "max_tokens": 64, "extra_body": GREEDY, "stop_sequences": ["7", "seven"],
           "messages": [{"role": "user", "content": "Count from 1 to 10, as digits separated by commas."}]}
    plain = client.messages.create(**(ask | {"stop_sequences": []}))
    assert "7" in plain.content[0].text, plain                     # what it writes when nothing stops it
    message = client.messages.create(**ask)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "7"), message
    assert message.content[0].text == plain.content[0].text[:plain.content[0].text.index("7")]
    with client.messages.stream(**ask) as stream:
        [start] = [event for event in stream if event.type == "message_start"]
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "7")
    assert start.message.usage.input_tokens + (start.message.usage.cache_read_input_tokens or 0) == \
        final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) > 0
