"""The real client libraries apps use, each called as its documentation shows with ``base_url`` pointed
at a server (issue 45). One function per check: it raises (an ``AssertionError`` saying what was wrong,
or the library's own error) unless the library got what an app needs. The gateway's tests
(tests/gateway/test_gateway_clients.py, ``..._anthropic_model.py``, ``..._responses_model.py``) call
them against slotq; ``slotq bench clients`` calls every one in :data:`CHECKS` against slotq and
llama-server on the bundled model and tallies them.

A forced call (``tool_choice: required``/``any``, or a named function, which the libraries send for
structured output) must come back as a call to that function with schema-valid arguments; a free turn
after the tool's output must answer in text. litellm's import fetches a price list online unless
``LITELLM_LOCAL_MODEL_COST_MAP`` is set: the caller sets it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anthropic
import instructor
import jsonschema
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
from openai import AsyncOpenAI, BadRequestError, OpenAI, pydantic_function_tool
from pydantic import BaseModel, Field
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai import RunContext
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.tools import ToolDefinition

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 40}}}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                "parameters": WEATHER}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
                    "parameters": WEATHER}]
MESSAGES_TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
QUESTION = "What is the weather in Paris?"
ASK = [{"role": "user", "content": QUESTION}]
INSTRUCTIONS = "Answer questions about the weather."
EXTRACT = "Paris is the capital of France. Extract the city."
GREEDY = {"temperature": 0}     # newer anthropic SDKs take sampling parameters only in extra_body
TIMEOUT = 120


@dataclass(frozen=True)
class Server:
    """Where the clients go: the server's root URL (the anthropic SDK adds ``/v1`` itself), the chat
    model's name and the embedding model's."""

    url: str
    model: str
    embed_model: str

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def openai(self) -> OpenAI:
        return OpenAI(base_url=self.v1, api_key="unused", max_retries=0, timeout=TIMEOUT)

    def async_openai(self) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=self.v1, api_key="unused", max_retries=0, timeout=TIMEOUT)

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key="unused", max_retries=0, timeout=TIMEOUT)


class City(BaseModel):
    """A city and its country."""

    name: str = Field(max_length=30)
    country: str = Field(max_length=30)


def check_paris(city: Any) -> None:
    assert isinstance(city, City), f"not a City: {city!r}"
    assert city.name.strip().lower() == "paris" and city.country.strip(), city


# ---------------------------------------------------------------------------------------------- openai SDK
def choice_of(reply: Any) -> Any:
    """The first choice of a chat completion (the SDK's or litellm's) that ended in tool calls."""
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", \
        f"finish_reason {choice.finish_reason!r}, not tool_calls; content {(choice.message.content or '')[:60]!r}"
    return choice


def chat_tool_call(server: Server, *, stream: bool) -> str:
    """A forced ``get_weather`` call on chat completions; its arguments."""
    client = server.openai()
    ask: dict[str, Any] = {"model": server.model, "messages": ASK, "tools": CHAT_TOOLS, "tool_choice": "required",
                           "max_tokens": 64, "temperature": 0}
    if stream:
        with client.chat.completions.stream(**ask) as events:
            reply = events.get_final_completion()
    else:
        reply = client.chat.completions.create(**ask)
    choice = choice_of(reply)
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function" and calls[0].function.name == "get_weather", calls
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)
    return calls[0].function.arguments


def chat_text(server: Server) -> None:
    """No tools: text, and no tool calls."""
    reply = server.openai().chat.completions.create(model=server.model, messages=ASK, max_tokens=16, temperature=0)
    message = reply.choices[0].message
    assert message.content and message.tool_calls is None, f"content {message.content!r}, calls {message.tool_calls}"


class Forecast(BaseModel):
    """A forecast for a city: a nested model, which pydantic writes as a ``$ref`` into ``$defs``."""

    city: City
    days: int = Field(ge=1, le=14)


def chat_nested_pydantic_tool(server: Server) -> None:
    """``openai.pydantic_function_tool`` of a nested model (parameters with ``$ref`` into ``$defs``, as the
    SDK, instructor and pydantic-ai send them), parsed back by the SDK's ``parse``."""
    reply = server.openai().chat.completions.parse(
        model=server.model, messages=[{"role": "user", "content": "The weather in Paris, France for the next 3 days."}],
        tools=[pydantic_function_tool(Forecast)], tool_choice="required", max_tokens=96, temperature=0)
    calls = choice_of(reply).message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function", calls
    assert isinstance(calls[0].function.parsed_arguments, Forecast), calls[0].function


def chat_no_invented_keys(server: Server) -> None:
    """Parameters as pydantic writes them, without ``additionalProperties``: the call has the schema's keys
    and no others (a model left free to add keys pads the call until ``max_tokens`` cuts it)."""
    tools = [{"type": "function", "function": {"name": "record_city", "description": "Record a city and its country",
                                               "parameters": City.model_json_schema()}}]
    reply = server.openai().chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": EXTRACT}], tools=tools, tool_choice="required",
        max_tokens=64, temperature=0)
    [call] = choice_of(reply).message.tool_calls or [None]
    assert call is not None and call.type == "function", call
    keys = sorted(json.loads(call.function.arguments))
    assert keys == ["country", "name"], f"keys {keys}"


def chat_call_cut_by_max_tokens(server: Server) -> None:
    """A forced call cut by ``max_tokens``: 200 with ``finish_reason: length`` as OpenAI answers (or a 4xx
    naming ``max_tokens``), not a 5xx, which the SDKs retry."""
    try:
        reply = server.openai().chat.completions.create(model=server.model, messages=ASK, tools=CHAT_TOOLS,
                                                        tool_choice="required", max_tokens=4, temperature=0)
    except BadRequestError as exc:
        assert "max_tokens" in str(exc), exc
        return
    assert reply.choices[0].finish_reason == "length", f"finish_reason {reply.choices[0].finish_reason!r}"


# ------------------------------------------------------------------------------------- openai SDK: Responses
def responses_tool_call(server: Server, *, stream: bool) -> Any:
    """A forced function call on the Responses API; the Response."""
    client = server.openai()
    ask: dict[str, Any] = {"model": server.model, "instructions": INSTRUCTIONS, "input": QUESTION,
                           "tools": RESPONSES_TOOLS, "tool_choice": "required", "max_output_tokens": 64,
                           "temperature": 0}
    if stream:
        with client.responses.stream(**ask) as events:
            response = events.get_final_response()
    else:
        response = client.responses.create(**ask)
    calls = [item for item in response.output if item.type == "function_call"]
    assert response.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather", \
        f"status {response.status!r}, output {[i.type for i in response.output]}; text {response.output_text[:60]!r}"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    return response


def responses_tool_loop(server: Server) -> None:
    """The call, then its output sent back with ``previous_response_id`` alone; the model, free again,
    answers in text."""
    first = responses_tool_call(server, stream=False)
    [call] = [item for item in first.output if item.type == "function_call"]
    city = json.loads(call.arguments)["city"]
    answer = server.openai().responses.create(
        model=server.model, instructions=INSTRUCTIONS, previous_response_id=first.id, tools=RESPONSES_TOOLS,
        max_output_tokens=96, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": f"Sunny and 21 degrees in {city}."}])
    assert answer.status == "completed" and [item.type for item in answer.output] == ["message"] and \
        answer.output_text.strip(), f"status {answer.status!r}, output {[item.type for item in answer.output]}"


# ------------------------------------------------------------------------------------------ OpenAI Agents SDK
def weather_tool(seen: list[str]) -> FunctionTool:
    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        seen.append(city)
        return f"Sunny and 21 degrees in {city}."
    return get_weather


async def agent_on_chat_completions(server: Server) -> None:
    """A two-turn tool loop on chat completions."""
    set_tracing_disabled(True)          # its traces would go to api.openai.com
    seen: list[str] = []
    model = OpenAIChatCompletionsModel(model=server.model, openai_client=server.async_openai())
    agent = Agent(name="weather", instructions=INSTRUCTIONS, model=model, tools=[weather_tool(seen)],
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=96))
    result = await Runner.run(agent, QUESTION, max_turns=4)
    assert len(seen) == 1, f"the tool ran with {seen}"  # the model called the tool once, with a string city
    assert isinstance(result.final_output, str) and result.final_output.strip(), result.final_output
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item", kinds


async def agent_on_default_provider(server: Server) -> None:
    """An app's set-up as the Agents SDK documents it: a default client, a model by name. Its default
    provider speaks the Responses API, streamed, each turn sending the whole conversation as input items
    (the call and its output), and fails a turn that ends ``incomplete``."""
    set_tracing_disabled(True)
    set_default_openai_client(server.async_openai(), use_for_tracing=False)
    seen: list[str] = []
    agent = Agent(name="weather", instructions=INSTRUCTIONS, model=server.model, tools=[weather_tool(seen)],
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=256))
    result = await Runner.run(agent, f"{QUESTION} Answer in a few words.", max_turns=4)
    assert seen == ["Paris"], f"the tool ran with {seen}"
    assert isinstance(result.final_output, str) and result.final_output.strip(), result.final_output
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    ids = [response.response_id for response in result.raw_responses]
    assert len(ids) == 2 and all(i and i.startswith("resp_") for i in ids), ids     # Responses, not chat


# ----------------------------------------------------------------------------------------------- instructor
def instructor_extracts(server: Server, mode: str) -> None:
    """TOOLS forces a function whose parameters are the model's schema, JSON_SCHEMA sends it as
    response_format, RESPONSES_TOOLS forces the function on the Responses API and sends the schema as
    ``text.format`` too (a forced call is not shaped by a format, as on OpenAI)."""
    client = instructor.from_openai(server.openai(), mode=instructor.Mode[mode])
    limit = {"max_output_tokens": 64} if mode == "RESPONSES_TOOLS" else {"max_tokens": 64}
    city = client.create(model=server.model, response_model=City, messages=[{"role": "user", "content": EXTRACT}],
                         max_retries=0, temperature=0, **limit)
    check_paris(city)


# ---------------------------------------------------------------------------------------------- pydantic-ai
def pydantic_ai_tool_then_output(server: Server) -> None:
    """An agent with a tool and an output type: pydantic-ai forces a call each turn (its output is a
    tool too). The tool hides itself once it has run, so the next turn must call the output tool."""
    class Weather(BaseModel):
        city: str = Field(max_length=30)
        summary: str = Field(max_length=40)

    seen: list[str] = []
    model = OpenAIChatModel(server.model, provider=OpenAIProvider(base_url=server.v1, api_key="unused"))
    agent = PydanticAgent(model, output_type=Weather, instructions=INSTRUCTIONS,
                          model_settings={"temperature": 0, "max_tokens": 128})

    async def once(ctx: RunContext[None], tool: ToolDefinition) -> ToolDefinition | None:
        return None if seen else tool

    @agent.tool_plain(prepare=once)
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        seen.append(city)
        return f"Sunny in {city}."

    result = agent.run_sync(QUESTION)
    assert seen == ["Paris"], f"the tool ran with {seen}"
    assert isinstance(result.output, Weather) and result.output.city == "Paris", result.output
    calls = [part.tool_name for message in result.all_messages() for part in message.parts
             if part.part_kind == "tool-call"]
    assert calls == ["get_weather", "final_result"], calls


# ----------------------------------------------------------------------------------------- langchain-openai
def chat_model(server: Server) -> ChatOpenAI:
    return ChatOpenAI(model=server.model, base_url=server.v1, api_key="unused",
                      temperature=0, max_tokens=64, max_retries=0)


def langchain_binds_a_tool(server: Server) -> None:
    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return f"Sunny in {city}."

    reply = chat_model(server).bind_tools([get_weather], tool_choice="get_weather").invoke(QUESTION)
    assert len(reply.tool_calls) == 1, f"{len(reply.tool_calls)} tool calls; content {str(reply.content)[:60]!r}"
    [call] = reply.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str) and call["args"]["city"], call


def langchain_structured_output(server: Server, method: str) -> None:
    check_paris(chat_model(server).with_structured_output(City, method=method).invoke(EXTRACT))


def langchain_embeds(server: Server) -> None:
    # check_embedding_ctx_length=False sends the texts, not tiktoken's tokens (OpenAI's vocabulary, not the model's)
    embeddings = OpenAIEmbeddings(model=server.embed_model, base_url=server.v1, api_key="unused",
                                  max_retries=0, check_embedding_ctx_length=False)
    documents = embeddings.embed_documents(["hello world", "a queue of jobs"])
    query = embeddings.embed_query("hello world")
    assert len(documents) == 2 and len({len(v) for v in [*documents, query]}) == 1 and len(query) > 1
    assert max(abs(a - b) for a, b in zip(query, documents[0], strict=True)) <= 1e-5, "the query's vector differs"
    assert documents[0] != documents[1]


# -------------------------------------------------------------------------------------------------- litellm
def litellm_completes_with_tools(server: Server) -> None:
    import litellm

    reply = litellm.completion(model=f"openai/{server.model}", api_base=server.v1, api_key="unused", messages=ASK,
                               tools=CHAT_TOOLS, tool_choice="required", max_tokens=64, temperature=0)
    calls = choice_of(reply).message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "get_weather", calls
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)


def litellm_embeds(server: Server) -> None:
    import litellm

    vectors = litellm.embedding(model=f"openai/{server.embed_model}", api_base=server.v1, api_key="unused",
                                input=["hello world", "a queue of jobs"])
    [first, second] = [item["embedding"] for item in vectors.data]
    assert len(first) == len(second) > 1 and first != second


# ------------------------------------------------------------------------------------------- anthropic SDK
def anthropic_tool_use(server: Server, *, stream: bool) -> Any:
    """A forced (``tool_choice: any``) ``get_weather`` call, as agent loops send while a tool has not
    run yet; the Message."""
    client = server.anthropic()
    ask: dict[str, Any] = {"model": server.model, "max_tokens": 64, "system": INSTRUCTIONS, "messages": ASK,
                           "tools": MESSAGES_TOOLS, "tool_choice": {"type": "any"}, "extra_body": GREEDY}
    if stream:
        with client.messages.stream(**ask) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**ask)
    assert message.stop_reason == "tool_use", \
        f"stop_reason {message.stop_reason!r}, not tool_use; blocks {[block.type for block in message.content]}"
    calls = [block for block in message.content if block.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather", message.content
    jsonschema.validate(calls[0].input, WEATHER)
    return message


def anthropic_tool_loop(server: Server) -> None:
    """The call, its ``tool_result``, and the model, free (``auto``), answers in text."""
    first = anthropic_tool_use(server, stream=False)
    [call] = [block for block in first.content if block.type == "tool_use"]
    answer = server.anthropic().messages.create(
        model=server.model, max_tokens=96, system=INSTRUCTIONS, tools=MESSAGES_TOOLS,
        extra_body=GREEDY, messages=[*ASK, {"role": "assistant", "content": first.content},
                                     {"role": "user", "content": [{
                                         "type": "tool_result", "tool_use_id": call.id,
                                         "content": f"Sunny and 21 degrees in {call.input['city']}."}]}])
    kinds = [block.type for block in answer.content]
    assert answer.stop_reason == "end_turn" and kinds == ["text"] and answer.content[0].text.strip(), \
        f"stop_reason {answer.stop_reason!r}, blocks {kinds}"


#: (library, case, check): what ``slotq bench clients`` runs against each server, in this order.
CHECKS: list[tuple[str, str, Callable[[Server], Any]]] = [
    ("openai", "chat: forced tool call", lambda s: chat_tool_call(s, stream=False)),
    ("openai", "chat: forced tool call, streamed", lambda s: chat_tool_call(s, stream=True)),
    ("openai", "chat: text, no tools", chat_text),
    ("openai", "chat: nested pydantic_function_tool ($ref into $defs), parse", chat_nested_pydantic_tool),
    ("openai", "chat: parameters without additionalProperties: no invented keys", chat_no_invented_keys),
    ("openai", "chat: a forced call cut by max_tokens: 200 length, no 5xx", chat_call_cut_by_max_tokens),
    ("openai", "responses: forced function call", lambda s: responses_tool_call(s, stream=False)),
    ("openai", "responses: forced function call, streamed", lambda s: responses_tool_call(s, stream=True)),
    ("openai", "responses: tool loop (previous_response_id)", responses_tool_loop),
    ("openai-agents", "tool loop on chat completions", agent_on_chat_completions),
    ("openai-agents", "tool loop on the default provider (Responses, streamed)", agent_on_default_provider),
    ("instructor", "Mode.TOOLS", lambda s: instructor_extracts(s, "TOOLS")),
    ("instructor", "Mode.JSON_SCHEMA", lambda s: instructor_extracts(s, "JSON_SCHEMA")),
    ("instructor", "Mode.RESPONSES_TOOLS", lambda s: instructor_extracts(s, "RESPONSES_TOOLS")),
    ("pydantic-ai", "a tool, then a structured output", pydantic_ai_tool_then_output),
    ("langchain-openai", "bind_tools", langchain_binds_a_tool),
    ("langchain-openai", "with_structured_output(function_calling)",
     lambda s: langchain_structured_output(s, "function_calling")),
    ("langchain-openai", "with_structured_output(json_schema)",
     lambda s: langchain_structured_output(s, "json_schema")),
    ("langchain-openai", "OpenAIEmbeddings", langchain_embeds),
    ("litellm", "completion with tools", litellm_completes_with_tools),
    ("litellm", "embedding", litellm_embeds),
    ("anthropic", "messages: forced tool_use", lambda s: anthropic_tool_use(s, stream=False)),
    ("anthropic", "messages: forced tool_use, streamed", lambda s: anthropic_tool_use(s, stream=True)),
    ("anthropic", "messages: tool loop (tool_result, then text)", anthropic_tool_loop),
]
