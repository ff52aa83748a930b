"""Tool calls in the engine (issue 33), on real llama.cpp: the tiny random model answers every
forced call with arguments that validate against the function's schema, in the generic format
(a template without tools, like the bundled model's) and in a native one (a Hermes template), and a
resumed reply delivers the rest of a call exactly once. Under ``auto`` a native call is constrained
from its marker on (issue 43), so it validates too, and a plain-text reply is left alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from slotq.engine import FinishReason, GenerationRequest, SamplingParams, TextDelta
from slotq.engine.reply_parser import ToolCallFormat
from slotq.engine.request import GenerationParams
from slotq.engine.tools import CallTrigger, plan_tools, template_messages
from slotq.jobs.protocol.schemas import assemble_tool_calls
from tests.support.engine import running_engine
from tests.support.tiny_model import HERMES_TEMPLATE, TINY_SCALE, TINY_SEED, write_tiny_llama

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"enum": ["Paris", "Tokyo", "Zürich"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "CET"]}}}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "the forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


def tool_request(**fields: Any) -> GenerationRequest:
    fields.setdefault("messages", ASK)
    fields.setdefault("max_tokens", 120)
    fields.setdefault("sampling", SamplingParams(temperature=0.0))
    return GenerationRequest(tools=TOOLS, **fields)


async def reply_of(engine: Any, request: GenerationRequest) -> tuple[list[TextDelta], Any]:
    deltas, finished = [], []
    async for event in engine.submit(request):
        (deltas if isinstance(event, TextDelta) else finished).append(event)
    assert len(finished) == 1
    return deltas, finished[0]


def calls_of(deltas: list[TextDelta]) -> list[dict[str, str]]:
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in assemble_tool_calls(d for delta in deltas for d in delta.tool_calls)]


def assert_valid(calls: list[dict[str, str]], allowed: set[str]) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call["name"] in allowed
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        assert call["id"].startswith("call_")


@pytest.fixture(scope="module")
def hermes_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("hermes") / "hermes.gguf", seed=TINY_SEED, scale=TINY_SCALE,
                            chat_template=HERMES_TEMPLATE)


# ---------------------------------------------------------------------- the plan and the conversation
def test_the_generic_format_describes_the_tools_and_writes_earlier_calls_in_words():
    request = GenerationParams(tools=TOOLS, messages=[
        {"role": "system", "content": "Be brief."}, *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    messages = template_messages(request, ToolCallFormat.GENERIC)
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.")
    assert "get_weather" in messages[0]["content"] and "`response`" in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": 'Calling get_weather({"city": "Paris", "days": 3})'}
    assert messages[3] == {"role": "user", "content": "Result of get_weather: sunny"}     # named by its call's id
    native = template_messages(request, ToolCallFormat.HERMES)
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 3}
    assert native[3]["role"] == "tool"


def test_which_requests_are_constrained():
    auto = GenerationParams(tools=TOOLS, messages=ASK)
    assert plan_tools(GenerationParams(tools=TOOLS, messages=ASK, tool_choice="none"), ToolCallFormat.GENERIC) is None
    generic = plan_tools(auto, ToolCallFormat.GENERIC)
    assert generic is not None and generic.constraint is not None            # a call or a response, always JSON
    native_auto = plan_tools(auto, ToolCallFormat.HERMES)
    assert native_auto is not None and native_auto.lazy                     # free text until a call's marker
    named = plan_tools(GenerationParams(tools=TOOLS, messages=ASK,
                                        tool_choice={"type": "function", "function": {"name": "get_time"}}),
                       ToolCallFormat.HERMES)
    assert named is not None and not named.lazy and "get_time" in named.constraint.grammar
    assert "get_weather" not in named.constraint.grammar


@pytest.mark.parametrize(("fields", "message"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required", "tools": None}, "needs tools"),
    ({"sampling": {"json_schema": {"type": "object"}}}, "cannot be combined"),
    ({"tools": TOOLS + TOOLS[:1]}, "unique"),
    ({"ignore_eos": True}, "ignore_eos: cannot be combined with tools"),      # a constrained call must end
])
def test_bad_tool_requests_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        GenerationParams(**{"tools": TOOLS, "messages": ASK, **fields})


# ---------------------------------------------------------------------- real llama.cpp
async def test_an_auto_reply_in_the_generic_format_is_never_an_empty_response(tiny_model_path: Path):
    """Biased towards ``{"response": ""}`` (``r`` over ``t`` for the key, a quote wherever one may
    come), the reply still says something: the format's response is a non-empty string."""
    async with running_engine(tiny_model_path, slots=1, ctx=2048) as engine:
        def ids(text: bytes) -> list[int]:
            return [t for t in range(engine.info.n_vocab) if engine.model.token_bytes(t) == text]
        bias = dict.fromkeys(ids(b'"') + ids(b"r"), 50.0)
        request = GenerationRequest(messages=ASK, tools=TOOLS, max_tokens=120,
                                    sampling=SamplingParams(temperature=0.0, logit_bias=bias))
        deltas, finished = await reply_of(engine, request)
    assert finished.finish_reason == FinishReason.STOP, finished
    assert not calls_of(deltas) and "".join(d.text for d in deltas) != ""


async def test_a_forced_call_validates_even_on_a_random_model(tiny_model_path: Path):
    async with running_engine(tiny_model_path, slots=2, ctx=2048) as engine:
        assert engine.tool_format == ToolCallFormat.GENERIC        # plain ChatML knows no tools
        deltas, finished = await reply_of(engine, tool_request(tool_choice="required", parallel_tool_calls=False))
        assert finished.finish_reason == FinishReason.TOOL_CALLS, finished
        calls = calls_of(deltas)
        assert len(calls) == 1
        assert_valid(calls, {"get_weather", "get_time"})
        assert "".join(d.text for d in deltas) == ""             # the call's JSON is not text

        named = {"type": "function", "function": {"name": "get_time"}}
        deltas, finished = await reply_of(engine, tool_request(tool_choice=named))
        assert finished.finish_reason == FinishReason.TOOL_CALLS
        assert_valid(calls_of(deltas), {"get_time"})


async def test_a_native_template_gets_the_tools_and_its_forced_calls_parse(hermes_model_path: Path):
    async with running_engine(hermes_model_path, slots=2, ctx=2048) as engine:
        assert engine.tool_format == ToolCallFormat.HERMES
        request = tool_request(tool_choice="required", parallel_tool_calls=False)
        prompt = "".join(engine.model.token_bytes(t).decode("utf-8", "replace") for t in engine.prompt_tokens(request))
        assert "<tools>" in prompt and "get_weather" in prompt              # the template rendered them
        deltas, finished = await reply_of(engine, request)
        assert finished.finish_reason == FinishReason.TOOL_CALLS, finished
        assert_valid(calls_of(deltas), {"get_weather", "get_time"})


async def test_a_resumed_reply_delivers_the_rest_of_its_call_exactly_once(tiny_model_path: Path):
    request = tool_request(tool_choice="required", parallel_tool_calls=False)
    async with running_engine(tiny_model_path, slots=2, ctx=2048) as engine:
        deltas, _ = await reply_of(engine, request)
        tokens = [t for d in deltas for t in d.token_ids]
        for cut in (1, len(tokens) // 3, len(tokens) // 2, len(tokens) - 2):
            resumed = request.model_copy(update={"resume_tokens": tokens[:cut]})
            rest, finished = await reply_of(engine, resumed)
            assert finished.finish_reason == FinishReason.TOOL_CALLS
            before = [d for d in deltas if d.n_tokens <= cut]
            assert calls_of(before + rest) == calls_of(deltas), cut


def text_tokens(engine: Any, text: str) -> list[int]:
    return engine.model.tokenize(text, add_special=False)


async def test_an_auto_call_is_grammar_constrained_from_its_marker_on(hermes_model_path: Path):
    # The random model would never write a call; the reply is made to start one: resumed past
    # "<tool_call" with ">" pushed up, so the marker completes in this attempt's first token. From
    # there the grammar writes a valid call, and only the end may follow it (no text, no second call).
    async with running_engine(hermes_model_path, slots=1, ctx=2048) as engine:
        close = text_tokens(engine, ">")[-1:]       # SPM writes a leading space token first
        assert engine.model.token_bytes(close[0]) == b">"
        plain, finished = await reply_of(engine, tool_request())
        assert finished.finish_reason != FinishReason.TOOL_CALLS and not calls_of(plain)   # text is not constrained
        for resumed in ("Sure. <tool_call", "<think>hm <tool_call> no</think><tool_call"):
            request = tool_request(resume_tokens=text_tokens(engine, resumed), max_tokens=200,
                                   sampling=SamplingParams(temperature=0.0, logit_bias={close[0]: 50.0}))
            deltas, finished = await reply_of(engine, request)
            assert finished.finish_reason == FinishReason.TOOL_CALLS, (resumed, finished)
            calls = calls_of(deltas)
            assert len(calls) == 1
            assert_valid(calls, {"get_weather", "get_time"})
            text = "".join(engine.model.token_bytes(t).decode() for d in deltas for t in d.token_ids)
            assert text.startswith(">\n{") and text.rstrip().endswith("</tool_call>"), text

        # A resumed attempt arms the grammar while replaying, and follows the call the first one began.
        begun = '<tool_call>\n{"name":"get_time","arguments":{"zone":"'
        deltas, finished = await reply_of(engine, tool_request(resume_tokens=text_tokens(engine, begun)))
        assert finished.finish_reason == FinishReason.TOOL_CALLS, finished
        rest = "".join(engine.model.token_bytes(t).decode() for d in deltas for t in d.token_ids)
        call = json.loads((begun + rest).removeprefix("<tool_call>\n").strip().removesuffix("</tool_call>"))
        jsonschema.validate(call["arguments"], TIME)

        broken = text_tokens(engine, '<tool_call>\n{"name":"rm_rf"')    # no attempt could have written it
        _, finished = await reply_of(engine, tool_request(resume_tokens=broken))
        assert finished.finish_reason == FinishReason.ERROR and "resume_tokens" in finished.error.message


async def test_the_armed_grammar_takes_each_call_opening_its_parser_reads(tiny_model_path: Path):
    # What a trigger hands over (the model wrote it freely) must be a start the call's grammar goes on from.
    async with running_engine(tiny_model_path, slots=1) as engine:
        compiler = engine._constraints
        for tool_format, opening in [(ToolCallFormat.LLAMA3, b'{"name": "get_time"'),
                                     (ToolCallFormat.LLAMA3, b'{ "type": "function", "name"'),
                                     (ToolCallFormat.LLAMA3, b'<|python_tag|>{"name"'),
                                     (ToolCallFormat.HERMES, b'<tool_call>\n{"name": "get_weather", "arg'),
                                     (ToolCallFormat.MISTRAL, b'[TOOL_CALLS][{"name"')]:
            plan = plan_tools(GenerationParams(tools=TOOLS, messages=ASK), tool_format)
            assert plan is not None and plan.lazy
            assert compiler.matcher(plan.constraint, []).follows(compiler.tokenize(opening)), opening


@pytest.mark.parametrize(("tool_format", "pieces", "call"), [
    (ToolCallFormat.HERMES, [b"Let me ", b"check. <tool", b"_call>\n{"], b"<tool_call>\n{"),
    (ToolCallFormat.HERMES, [b"<think>a <tool_call> b</th", b"ink>ok <tool_call>"], b"<tool_call>"),
    (ToolCallFormat.MISTRAL, [b"[TOOL_", b"CALLS][{"], b"[TOOL_CALLS][{"),
    (ToolCallFormat.LLAMA3, [b" {", b'"name', b'": "f'], b'{"name": "f'),
    (ToolCallFormat.LLAMA3, [b'{"answer": 1}', b' <|python_tag|>{'], b"<|python_tag|>{"),
    (ToolCallFormat.LLAMA3, [b'{"answer": 1, "name": 2}'], None),               # a JSON answer is no call
    (ToolCallFormat.LLAMA3, [b'{"type": "object"}'], None),
    (ToolCallFormat.LLAMA3, [b"\n" * 100, b'{"type" : "function",'], b'{"type" : "function",'),
    (ToolCallFormat.HERMES, [b"no call, just ", b"<tool", b" talk"], None),
])
def test_a_call_starts_at_its_marker_or_its_opening(tool_format, pieces, call):
    trigger = CallTrigger(tool_format, reasoning=True, starts_in_reasoning=False)
    fired = [got for piece in pieces if (got := trigger.push(piece)) is not None]
    assert fired == ([call] if call else [])


async def test_a_leading_think_goes_to_reasoning_unless_asked_not_to(tiny_model_path: Path):
    # The grammar makes the random model think aloud first, as a reasoning model would.
    thinking = SamplingParams(temperature=0.0, grammar='root ::= "<think>" [a-z]{3,6} "</think>" [a-z]{3,6}')
    async with running_engine(tiny_model_path, slots=1, ctx=2048) as engine:
        deltas, finished = await reply_of(engine, GenerationRequest(messages=ASK, max_tokens=40, sampling=thinking))
        assert finished.finish_reason == FinishReason.STOP
        reasoning, text = "".join(d.reasoning for d in deltas), "".join(d.text for d in deltas)
        assert reasoning.isalpha() and text.isalpha(), (reasoning, text)
        kept, _ = await reply_of(engine, GenerationRequest(messages=ASK, max_tokens=40, sampling=thinking,
                                                           reasoning_format="none"))
        assert "".join(d.text for d in kept) == f"<think>{reasoning}</think>{text}"


async def test_control_tokens_show_in_replies_whose_calls_start_with_one(tiny_model_path: Path):
    # Mistral's [TOOL_CALLS] is a control token, which plain text renders empty; <s> stands in for it here.
    async with running_engine(tiny_model_path, slots=1) as engine:
        assert engine.model.token_bytes(1) == b"" and engine.model.token_bytes(1, special=True) == b"<s>"
