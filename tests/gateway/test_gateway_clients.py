"""The real clients apps use, against the gateway on the bundled model (issues 33 and 45): the official
``openai`` SDK (streaming and not), the OpenAI Agents SDK running a two-turn tool loop on chat completions
and on its default model provider (the Responses API), and the libraries apps put on top of the SDK:
instructor (tools, JSON schema and Responses modes), pydantic-ai (a tool, then a structured output),
langchain-openai (``bind_tools``, ``with_structured_output`` both ways, ``OpenAIEmbeddings``) and litellm
(a completion with tools, an embedding). Each is called as its documentation shows, with ``base_url``
pointed at the gateway.

The bundled SmolLM2's template knows no tools, so the gateway's worker uses the generic format: a forced
call (``tool_choice: required`` or a named function, which these libraries send for structured output)
is grammar-constrained to the function's schema; a free turn may be text. One stack (a generation and an
embedding worker, one gateway) serves the whole module.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import instructor
import jsonschema
import pytest
from agents import (
    Agent,
    FunctionTool,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_default_openai_client,
    set_tracing_disabled,
)
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI, OpenAIEmbeddings
from openai import AsyncOpenAI, OpenAI
from pydantic import BaseModel, Field
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai import RunContext
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.tools import ToolDefinition

from tests.support.gateway import Stack

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(300)]

MODEL = "smol"
EMBED = "smol-embed"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 40}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
EXTRACT = "Paris is the capital of France. Extract the city."


class City(BaseModel):
    """A city and its country."""

    name: str = Field(max_length=30)
    country: str = Field(max_length=30)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, real_model_path: Path) -> Iterator[Stack]:
    with Stack.started(tmp_path_factory.mktemp("clients"), real_model_path) as s:
        s.start_worker("clients-worker", MODEL, ctx=2048)
        s.start_worker("clients-embedder", EMBED, queue="slotq:embed", embeddings="true", ctx=512, batch=512)
        s.start_gateway("clients-gateway").wait_ready()
        s.wait_for_models({MODEL, EMBED})
        yield s


@pytest.fixture
def base_url(stack: Stack) -> str:
    return f"{stack.url}/v1"


def is_paris(city: City) -> bool:
    return city.name.strip().lower() == "paris" and bool(city.country.strip())


# ---------------------------------------------------------------------------------------------- openai SDK
def test_the_openai_sdk_gets_a_tool_call_streamed_and_not(base_url: str) -> None:
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
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


# ------------------------------------------------------------------------------------------ OpenAI Agents SDK
def weather_tool(seen: list[str]) -> FunctionTool:
    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        seen.append(city)
        return f"Sunny and 21 degrees in {city}."
    return get_weather


async def test_an_agent_runs_a_two_turn_tool_loop_on_chat_completions(base_url: str) -> None:
    set_tracing_disabled(True)          # its traces would go to api.openai.com
    seen: list[str] = []
    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=AsyncOpenAI(
        base_url=base_url, api_key="unused", max_retries=0, timeout=120))
    agent = Agent(name="weather", instructions="Answer questions about the weather.", model=model,
                  tools=[weather_tool(seen)], model_settings=ModelSettings(tool_choice="required", temperature=0,
                                                                           max_tokens=96))
    result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    assert len(seen) == 1, seen                         # the model called the tool once, with a string city
    assert isinstance(result.final_output, str) and result.final_output.strip()
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item", kinds


async def test_an_agent_on_the_default_model_provider_runs_a_tool_loop_over_responses(base_url: str) -> None:
    """An app's set-up as the Agents SDK documents it: a default client, a model by name. Its default
    provider speaks the Responses API, streamed, each turn sending the whole conversation as input items
    (the call and its output), and fails a turn that ends ``incomplete``."""
    set_tracing_disabled(True)
    set_default_openai_client(AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120),
                              use_for_tracing=False)
    seen: list[str] = []
    agent = Agent(name="weather", instructions="Answer questions about the weather.", model=MODEL,
                  tools=[weather_tool(seen)], model_settings=ModelSettings(tool_choice="required", temperature=0,
                                                                           max_tokens=256))
    result = await Runner.run(agent, "What is the weather in Paris? Answer in a few words.", max_turns=4)
    assert seen == ["Paris"]
    assert isinstance(result.final_output, str) and result.final_output.strip()
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    ids = [response.response_id for response in result.raw_responses]
    assert len(ids) == 2 and all(i and i.startswith("resp_") for i in ids), ids     # Responses, not chat


# ----------------------------------------------------------------------------------------------- instructor
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA", "RESPONSES_TOOLS"])
def test_instructor_extracts_a_model(base_url: str, mode: str) -> None:
    """TOOLS forces a function whose parameters are the model's schema, JSON_SCHEMA sends it as
    response_format, RESPONSES_TOOLS forces the function on the Responses API and sends the schema as
    ``text.format`` too (a forced call is not shaped by a format, as on OpenAI)."""
    client = instructor.from_openai(OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120),
                                    mode=instructor.Mode[mode])
    limit = {"max_output_tokens": 64} if mode == "RESPONSES_TOOLS" else {"max_tokens": 64}
    city = client.create(model=MODEL, response_model=City, messages=[{"role": "user", "content": EXTRACT}],
                         max_retries=0, temperature=0, **limit)
    assert isinstance(city, City) and is_paris(city), city


# ---------------------------------------------------------------------------------------------- pydantic-ai
def test_pydantic_ai_calls_a_tool_then_gives_a_structured_output(base_url: str) -> None:
    """An agent with a tool and an output type: pydantic-ai forces a call each turn (its output is a
    tool too). The tool hides itself once it has run, so the next turn must call the output tool."""
    class Weather(BaseModel):
        city: str = Field(max_length=30)
        summary: str = Field(max_length=40)

    seen: list[str] = []
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=base_url, api_key="unused"))
    agent = PydanticAgent(model, output_type=Weather, instructions="Answer questions about the weather.",
                          model_settings={"temperature": 0, "max_tokens": 128})

    async def once(ctx: RunContext[None], tool: ToolDefinition) -> ToolDefinition | None:
        return None if seen else tool

    @agent.tool_plain(prepare=once)
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        seen.append(city)
        return f"Sunny in {city}."

    result = agent.run_sync("What is the weather in Paris?")
    assert seen == ["Paris"]
    assert isinstance(result.output, Weather) and result.output.city == "Paris", result.output
    calls = [part.tool_name for message in result.all_messages() for part in message.parts
             if part.part_kind == "tool-call"]
    assert calls == ["get_weather", "final_result"], calls


# ----------------------------------------------------------------------------------------- langchain-openai
def chat_model(base_url: str) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=base_url, api_key="unused", temperature=0, max_tokens=64, max_retries=0)


def test_langchain_binds_a_tool(base_url: str) -> None:
    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return f"Sunny in {city}."

    reply = chat_model(base_url).bind_tools([get_weather], tool_choice="get_weather").invoke(ASK[0]["content"])
    [call] = reply.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str) and call["args"]["city"]


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_gives_a_structured_output(base_url: str, method: str) -> None:
    city = chat_model(base_url).with_structured_output(City, method=method).invoke(EXTRACT)
    assert isinstance(city, City) and is_paris(city), city


def test_langchain_embeds_with_openai_embeddings(base_url: str) -> None:
    # check_embedding_ctx_length=False sends the texts, not tiktoken's tokens (OpenAI's vocabulary, not the model's)
    embeddings = OpenAIEmbeddings(model=EMBED, base_url=base_url, api_key="unused", max_retries=0,
                                  check_embedding_ctx_length=False)
    documents = embeddings.embed_documents(["hello world", "a queue of jobs"])
    query = embeddings.embed_query("hello world")
    assert len(documents) == 2 and len({len(v) for v in [*documents, query]}) == 1 and len(query) > 1
    assert query == pytest.approx(documents[0], abs=1e-5) and documents[0] != documents[1]


# -------------------------------------------------------------------------------------------------- litellm
def test_litellm_completes_with_tools_and_embeds(base_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")     # else its import fetches a price list online
    import litellm

    reply = litellm.completion(model=f"openai/{MODEL}", api_base=base_url, api_key="unused", messages=ASK,
                               tools=TOOLS, tool_choice="required", max_tokens=64, temperature=0)
    [call] = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    vectors = litellm.embedding(model=f"openai/{EMBED}", api_base=base_url, api_key="unused",
                                input=["hello world", "a queue of jobs"])
    [first, second] = [item["embedding"] for item in vectors.data]
    assert len(first) == len(second) > 1 and first != second
