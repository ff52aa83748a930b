"""The real clients apps use, against the gateway on the bundled model (issue 33): the official
``openai`` SDK (streaming and not) and an agent framework (``openai-agents``) running a two-turn
tool loop -- the model calls a tool, the tool's result goes back, and a final answer comes.

The bundled SmolLM2's template knows no tools, so the gateway's worker uses the generic format:
the first turn is forced (``tool_choice: required``, which openai-agents resets to ``auto`` once a
tool has run, so the loop ends), and the arguments validate against the function's schema.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI, OpenAI

from tests.support.gateway import Stack

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(300)]

MODEL = "smol"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 40}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, real_model_path: Path) -> Iterator[Stack]:
    with Stack.started(tmp_path_factory.mktemp("clients"), real_model_path) as s:
        s.start_worker("clients-worker", MODEL, ctx=2048)
        s.start_gateway("clients-gateway").wait_ready()
        s.wait_for_models({MODEL})
        yield s


def test_the_openai_sdk_gets_a_tool_call_streamed_and_not(stack: Stack) -> None:
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=64, temperature=0)
    assert reply.choices[0].finish_reason == "tool_calls"
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                        max_tokens=64, temperature=0) as stream:
        streamed = stream.get_final_completion()
    assert streamed.choices[0].message.tool_calls[0].function.arguments == call.function.arguments

    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, temperature=0)
    assert plain.choices[0].message.content and plain.choices[0].message.tool_calls is None


async def test_an_agent_framework_runs_a_two_turn_tool_loop(stack: Stack) -> None:
    set_tracing_disabled(True)          # its traces would go to api.openai.com
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        seen.append(city)
        return f"Sunny and 21 degrees in {city}."

    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=AsyncOpenAI(
        base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120))
    agent = Agent(name="weather", instructions="Answer questions about the weather.", model=model,
                  tools=[get_weather], model_settings=ModelSettings(tool_choice="required", temperature=0,
                                                                    max_tokens=96))
    result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    assert len(seen) == 1, seen                         # the model called the tool once, with a string city
    assert isinstance(result.final_output, str) and result.final_output.strip()
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item", kinds
