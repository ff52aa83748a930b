"""Unit tests of the reply parser (no model): content, reasoning and tool calls split from a reply that
arrives in arbitrary pieces, each format parsed the same way whatever the split."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotq.engine.reply_parser import (
    ReplyDelta,
    ReplyParser,
    ToolCallDelta,
    ToolCallError,
    ToolCallFormat,
    detect_tool_format,
    template_renders_tools,
)

HERMES = ToolCallFormat.HERMES
LLAMA3 = ToolCallFormat.LLAMA3
MISTRAL = ToolCallFormat.MISTRAL
GENERIC = ToolCallFormat.GENERIC


@dataclass(frozen=True)
class Reply:
    """A reply assembled from deltas; calls are (id, name, arguments)."""

    content: str = ""
    reasoning: str = ""
    calls: tuple[tuple[str, str, str], ...] = ()


@dataclass(frozen=True)
class Case:
    name: str
    tool_format: ToolCallFormat | None
    text: str
    expected: Reply
    options: dict[str, bool] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.name


def call(index: int, name: str, arguments: str) -> tuple[str, str, str]:
    return (f"call_r1_0_{index}", name, arguments)


def new_parser(tool_format: ToolCallFormat | None, **options: bool) -> ReplyParser:
    return ReplyParser(tool_format=tool_format, call_id_prefix="call_r1_0", **options)


def assemble(deltas: list[ReplyDelta], parser: ReplyParser) -> Reply:
    """Joins deltas as an OpenAI client does, checking the stream's shape on the way: a call's first
    delta carries its id and name, later ones neither, and the fragments assemble into parser.tool_calls."""
    ids: dict[int, str] = {}
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for delta in deltas:
        for piece in delta.tool_calls:
            if piece.index in ids:
                assert piece.id is None and piece.name is None, piece
                arguments[piece.index] += piece.arguments
            else:
                assert piece.id is not None and piece.name is not None, piece
                ids[piece.index], names[piece.index], arguments[piece.index] = piece.id, piece.name, piece.arguments
    assert sorted(ids) == list(range(len(ids)))
    calls = tuple((ids[i], names[i], arguments[i]) for i in sorted(ids))
    assert calls == tuple((c.id, c.name, c.arguments) for c in parser.tool_calls)
    return Reply(
        content="".join(d.content for d in deltas), reasoning="".join(d.reasoning for d in deltas), calls=calls
    )


def parse(case: Case, pieces: list[str]) -> Reply:
    parser = new_parser(case.tool_format, **case.options)
    deltas = [parser.push(piece) for piece in pieces]
    deltas.append(parser.finish())
    return assemble(deltas, parser)


WEATHER = '{"city": "Paris", "unit": "celsius"}'
MULTIBYTE = '{"q": "日本 é 🎉", "quote": "a\\"}b\\\\", "n": [1, 2.5e3, true, null, {}]}'

CASES = [
    Case("no_tools_text_is_verbatim", None, " Hi <tool_call> [TOOL_CALLS] </think>\n",
         Reply(" Hi <tool_call> [TOOL_CALLS] </think>\n")),
    Case("think_then_answer", None, " <think>\nplan it\n</think>\n\nThe answer.", Reply("The answer.", "plan it")),
    Case("think_only_at_the_start", None, "a <think>b</think>", Reply("a <think>b</think>")),
    Case("think_tags_off", None, "<think>x</think>y", Reply("<think>x</think>y"), {"reasoning": False}),
    Case("prompt_opened_think", None, "still thinking</think> done", Reply("done", "still thinking"),
         {"starts_in_reasoning": True}),
    Case("hermes_content_then_call", HERMES,
         f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
         Reply("Let me check.", calls=(call(0, "get_weather", WEATHER),))),
    Case("hermes_two_calls_multibyte", HERMES,
         f'<tool_call>\n{{"name": "search", "arguments": {MULTIBYTE}}}\n</tool_call>\n \n'
         '<tool_call>\n{"name":"noop","arguments":{}}\n</tool_call>\n',
         Reply(calls=(call(0, "search", MULTIBYTE), call(1, "noop", "{}")))),
    Case("hermes_think_then_call", HERMES,
         f'<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}'
         '\n</tool_call>',
         Reply(reasoning="The user wants weather.", calls=(call(0, "get_weather", WEATHER),))),
    Case("hermes_arguments_before_name", HERMES,
         f'<tool_call>{{"id": 7, "arguments": {MULTIBYTE}, "name": "search"}}</tool_call>Done.',
         Reply("Done.", calls=(call(0, "search", MULTIBYTE),))),
    Case("hermes_no_arguments_and_string_arguments", HERMES,
         '<tool_call>{"name": "now"}</tool_call><tool_call>{"name": "f", "arguments": "{\\"a\\": \\"\\u00e9\\"}"}'
         "</tool_call>",
         Reply(calls=(call(0, "now", "{}"), call(1, "f", '{"a": "é"}')))),
    Case("hermes_prose_only", HERMES, "Text with <b> and a <tool", Reply("Text with <b> and a <tool")),
    Case("llama3_bare_json", LLAMA3, ' {"name": "get_weather", "parameters": {"city": "東京"}}',
         Reply(calls=(call(0, "get_weather", '{"city": "東京"}'),))),
    Case("llama3_python_tag_two_calls", LLAMA3,
         '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": "😀"}}',
         Reply(calls=(call(0, "a", '{"x": 1}'), call(1, "b", '{"y": "😀"}')))),
    Case("llama3_think_then_call", LLAMA3, '<think>hm</think>{"name": "a", "parameters": {}}',
         Reply(reasoning="hm", calls=(call(0, "a", "{}"),))),
    Case("llama3_prose", LLAMA3, "The weather is {unknown}.", Reply("The weather is {unknown}.")),
    Case("llama3_json_answer", LLAMA3, ' {"city": "Paris", "name": "x"}', Reply('{"city": "Paris", "name": "x"}')),
    Case("llama3_json_answer_typed", LLAMA3, '{"type": "object", "name": "x"}',
         Reply('{"type": "object", "name": "x"}')),
    Case("llama3_typed_call", LLAMA3, '{ "type" : "function", "name": "a", "parameters": {}}',
         Reply(calls=(call(0, "a", "{}"),))),
    Case("mistral_list", MISTRAL,
         '[TOOL_CALLS] [{"name": "a", "arguments": {"k": "v"}, "id": "abcdefghi"}, {"name": "b", "arguments": {}}]',
         Reply(calls=(call(0, "a", '{"k": "v"}'), call(1, "b", "{}")))),
    Case("mistral_named", MISTRAL,
         'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}',
         Reply("Sure.", calls=(call(0, "get_weather", '{"city": "Zürich"}'), call(1, "get_time", "{}")))),
    Case("generic_response", GENERIC, '{"response": "Hi \\"there\\" \\u00e9\\ud83d\\ude00\\n\\t\\\\ 日本\\/"}',
         Reply('Hi "there" é😀\n\t\\ 日本/')),
    Case("generic_lone_surrogate", GENERIC, '{"response": "a\\ud83d\\n\\udc00b"}', Reply("a\ufffd\n\ufffdb")),
    Case("generic_tool_calls", GENERIC,
         '{\n  "tool_calls" : [\n    {"name": "a", "arguments": {"x": "é"}} ,\n    {"name": "b", "arguments": '
         '{"y": [1, 2]}}\n  ]\n}\n',
         Reply(calls=(call(0, "a", '{"x": "é"}'), call(1, "b", '{"y": [1, 2]}')))),
    Case("generic_tool_call", GENERIC, '<think>ok</think>{"tool_call": {"name": "a", "arguments": {}}}',
         Reply(reasoning="ok", calls=(call(0, "a", "{}"),))),
    Case("generic_structured_response", GENERIC, '{"response": {"x": [1, "}"]}}', Reply('{"x": [1, "}"]}')),
    Case("generic_prose", GENERIC, "Plain answer.", Reply("Plain answer.")),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_one_push(case: Case) -> None:
    assert parse(case, [case.text]) == case.expected


@pytest.mark.parametrize("case", CASES, ids=str)
def test_split_at_every_position(case: Case) -> None:
    for at in range(len(case.text) + 1):
        assert parse(case, [case.text[:at], case.text[at:]]) == case.expected, at


@pytest.mark.parametrize("case", CASES, ids=str)
def test_one_character_at_a_time(case: Case) -> None:
    assert parse(case, list(case.text)) == case.expected


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(CASES), st.sets(st.integers(min_value=0, max_value=200)))
def test_any_pieces(case: Case, cuts: set[int]) -> None:
    bounds = [0, *sorted(c for c in cuts if c < len(case.text)), len(case.text)]
    assert parse(case, [case.text[a:b] for a, b in zip(bounds, bounds[1:])]) == case.expected


def test_content_and_arguments_stream_as_soon_as_they_are_certain() -> None:
    parser = new_parser(HERMES)
    assert parser.push("Hello wor").content == "Hello wor"
    assert parser.push("ld <tool").content == "ld"            # " <tool" may be a marker: held
    assert parser.push("_call>\n") == ReplyDelta()
    assert parser.push('{"name": "get_weather", "argu').tool_calls == [
        ToolCallDelta(index=0, id="call_r1_0_0", name="get_weather")
    ]
    assert parser.push('ments": {"city": "Pa').tool_calls == [ToolCallDelta(index=0, arguments='{"city": "Pa')]
    assert parser.push('ris"}').tool_calls == [ToolCallDelta(index=0, arguments='ris"}')]
    assert parser.tool_calls == []                             # the call object is not closed yet
    assert parser.push("}\n</tool_call>").tool_calls == []
    assert [c.arguments for c in parser.tool_calls] == ['{"city": "Paris"}']
    assert parser.finish() == ReplyDelta()


def test_arguments_written_before_the_name_wait_for_it() -> None:
    parser = new_parser(LLAMA3)
    assert parser.push('{"parameters": {"a": 1}, ').tool_calls == []
    assert parser.push('"name": "f"').tool_calls == [
        ToolCallDelta(index=0, id="call_r1_0_0", name="f", arguments='{"a": 1}')
    ]


@pytest.mark.parametrize(("pieces", "inside"), [
    ([" ", "<th", "ink>", "plan", "</think>", "\n", "Answer"], [False, False, True, True, False, False, False]),
    (["<think>a</think>b"], [False]),                                    # opened and closed in one push
    (["plan", " more", "</think>", "done"], [True, True, False, False]),  # the prompt opened it
    (["<think>", "cut short"], [True, True]),                            # never closed
    (["Hi ", "<think>x"], [False, False]),                               # not at the start: text
])
def test_thinking_says_whether_the_reply_is_inside_its_think_block(pieces: list[str], inside: list[bool]) -> None:
    parser = new_parser(None, starts_in_reasoning=pieces[0] == "plan")
    assert [(parser.push(piece), parser.thinking)[1] for piece in pieces] == inside


def test_reasoning_and_generic_response_stream() -> None:
    parser = new_parser(GENERIC)
    assert parser.push("<think>\nabc").reasoning == "abc"
    assert parser.push(" \n</thi").reasoning == ""             # trailing whitespace and a maybe-marker: held
    assert parser.push('nk>\n{"response": "Bon').content == "Bon"
    assert parser.push("jour \\ud83d").content == "jour "      # half a surrogate pair: held
    assert parser.push('\\ude00"}').content == "😀"


ERRORS = [
    (HERMES, '<tool_call>{"name": "f", "arguments": {"a": 1', "unfinished: the reply ended inside tool call 0"),
    (HERMES, '<tool_call>{"name": "f", "arguments": {}}', "unfinished: the reply ended before </tool_call>"),
    (HERMES, '<tool_call>{"name": "f", "arguments": {"a": }}</tool_call>', "not valid JSON"),
    (HERMES, '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "arguments as a JSON object at character 38"),
    (HERMES, '<tool_call>{"name": "f", "arguments": "[1]"}</tool_call>', "arguments are not a JSON object"),
    (HERMES, '<tool_call>{"arguments": {}}</tool_call>', "has no name"),
    (HERMES, '<tool_call>{"name": "f", "name": "g"}</tool_call>', "appears twice"),
    (HERMES, '<tool_call>{"name": "f", "x": tru}</tool_call>', "not valid JSON"),
    (HERMES, '<tool_call>{"name": "f"} oops</tool_call>', "malformed: expected '</tool_call>'"),
    (MISTRAL, "[TOOL_CALLS]", "unfinished: the reply ended after [TOOL_CALLS]"),
    (MISTRAL, '[TOOL_CALLS][{"name": "a", "arguments": {}},', "unfinished: the reply ended inside the list"),
    (MISTRAL, '[TOOL_CALLS]get weather[ARGS]{}', "malformed"),
    (LLAMA3, '{"name": "f", "parameters": {"a": "x}', "unfinished"),
    (LLAMA3, '<|python_tag|>brave_search.call(query="x")', "not valid JSON: expected '{'"),
    (GENERIC, '{"tool_calls": [{"name": "a", "arguments": {}}]} extra', "not valid JSON"),
    (GENERIC, '{"answer": 42}', 'neither "tool_calls" nor "response"'),
    (GENERIC, '{"tool_call": {"name": "a", "arguments": {"x": "\\q"}}}', "not valid JSON"),
]


@pytest.mark.parametrize(("tool_format", "text", "message"), ERRORS)
def test_a_broken_call_fails_with_a_clear_error_however_split(
    tool_format: ToolCallFormat, text: str, message: str
) -> None:
    messages = set()
    for pieces in ([text], list(text), *([text[:at], text[at:]] for at in range(len(text) + 1))):
        parser = new_parser(tool_format)
        for piece in pieces:
            parser.push(piece)
        with pytest.raises(ToolCallError) as raised:
            parser.finish()
        messages.add(raised.value.message)
    (only,) = messages
    assert message in only
    assert only.startswith("the model's")
    assert (raised.value.code, raised.value.retryable, raised.value.field) == ("invalid_tool_call", False, None)


def test_a_broken_call_is_reported_at_once_and_nothing_more_is_delivered() -> None:
    parser = new_parser(HERMES)
    parser.push('Hi <tool_call>{"name": "f", "arguments": {"a": 1}}')
    errors = [parser.error]
    parser.push(" nonsense")
    errors.append(parser.error)
    assert errors[0] is None and errors[1] is not None and "expected '</tool_call>'" in errors[1].message
    assert parser.push("More text <tool_call>") == ReplyDelta()
    with pytest.raises(ToolCallError) as raised:
        parser.finish()
    assert raised.value is errors[1]


def test_a_resumed_attempt_replaying_the_text_gets_the_same_ids() -> None:
    case = next(c for c in CASES if c.name == "hermes_two_calls_multibyte")
    assert parse(case, [case.text]) == parse(case, list(case.text))
    assert [c[0] for c in case.expected.calls] == ["call_r1_0_0", "call_r1_0_1"]


# Shaped like the real templates: what decides is where they read `tools` and which markers they write.
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}{{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": "
        "<args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- endif %}
{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
SMOLLM2_TEMPLATE = (  # the bundled model's, verbatim
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA31_TEMPLATE = """{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if tools is not none %}{{- 'Given the following functions, respond with a JSON for a function call with its '
    'proper arguments. Respond in the format {"name": function name, "parameters": dictionary}.' }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{%- endfor %}{%- endif %}
{%- for message in messages %}{%- if message.role == 'ipython' or message.role == 'tool' %}
    {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}{%- elif 'tool_calls' in message %}
    {{- '<|python_tag|>' }}{%- endif %}{%- endfor %}
"""
MISTRAL_TEMPLATE = """{%- for message in messages %}{%- if message.role == 'user' %}
{%- if tools is not none and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}
[INST]{{ message.content }}[/INST]{%- elif message.tool_calls is defined %}[TOOL_CALLS]{{ message.tool_calls | tojson }}
{%- endif %}{%- endfor %}
"""


@pytest.mark.parametrize(
    ("template", "renders_tools", "expected"),
    [
        (QWEN25_TEMPLATE, True, HERMES),
        (LLAMA31_TEMPLATE, True, LLAMA3),
        (MISTRAL_TEMPLATE, True, MISTRAL),
        (SMOLLM2_TEMPLATE, False, GENERIC),
        (None, False, GENERIC),
        ("{# <tool_call> #}{% set tools = none %}{{ messages }}", False, GENERIC),   # never reads `tools`
        ("{% for t in tools %}<|tool|>{{ t.name }}{% endfor %}", True, GENERIC),    # tools, in a format we lack
        ("{% if tools %}<tool_call>{% endif %}{% generation %}", True, HERMES),     # Jinja cannot parse it
    ],
)
def test_detect_tool_format(template: str | None, renders_tools: bool, expected: ToolCallFormat) -> None:
    assert template_renders_tools(template) == renders_tools
    assert detect_tool_format(template) == expected
