"""The wire (slotq.jobs.protocol.wire) and the engine state the same shapes twice, on purpose: the
wire is a contract with running producers and workers, the engine's types may change. These tests
keep the two statements equal, so an engine change can never alter the Redis protocol unnoticed:

* every wire model matches its engine counterpart: fields, types, defaults, limits (their JSON
  schemas less titles and descriptions), configuration and validators; a field added or renamed
  on either side fails here, and so does a wire model without a counterpart;
* both accept the same requests and refuse the same ones with the same errors (property-based);
* the worker's edge (slotq.jobs.worker.wire_edge) loses nothing: wire -> engine -> wire is the identity,
  and the engine's text delta holds exactly what a chunk entry carries;
* protocol does not import the engine at all.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, TypeAdapter, ValidationError

from slotq.engine import Finished, TextDelta
from slotq.engine import events as engine_events
from slotq.engine import reply_parser as engine_reply_parser
from slotq.engine import request as engine_request
from slotq.jobs.protocol import wire
from slotq.jobs.protocol.payload import decode_payload, encode_payload
from slotq.jobs.protocol.schemas import EmbeddingJobRequest, JobRequest
from slotq.jobs.protocol.streams import encode_chunk
from slotq.jobs.worker.wire_edge import (
    Done,
    from_engine_finished,
    to_engine_embedding_request,
    to_engine_request,
    wire_logprobs,
    wire_tool_calls,
)

# Every shape the wire states, beside the engine's statement of it.
PAIRS: list[tuple[type[Any], type[Any]]] = [
    (wire.FinishReason, engine_events.FinishReason),
    (wire.Usage, engine_events.Usage),
    (wire.Timings, engine_events.Timings),
    (wire.ErrorInfo, engine_events.ErrorInfo),
    (wire.TopLogprob, engine_events.TopLogprob),
    (wire.TokenLogprob, engine_events.TokenLogprob),
    (wire.ToolCallDelta, engine_reply_parser.ToolCallDelta),
    (wire.FunctionCall, engine_request.FunctionCall),
    (wire.ToolCallSpec, engine_request.ToolCallSpec),
    (wire.ChatMessage, engine_request.ChatMessage),
    (wire.FunctionDef, engine_request.FunctionDef),
    (wire.ToolSpec, engine_request.ToolSpec),
    (wire.FunctionName, engine_request.FunctionName),
    (wire.NamedToolChoice, engine_request.NamedToolChoice),
    (wire.SamplingParams, engine_request.SamplingParams),
    (wire.LoraRef, engine_request.LoraRef),
    (wire.GenerationParams, engine_request.GenerationParams),
    (wire.EmbeddingParams, engine_request.EmbeddingParams),
    (wire.RerankParams, engine_request.RerankParams),
]
CONSTANTS = ["TOOL_NAME_PATTERN", "MAX_TOOLS", "MAX_TOP_LOGPROBS", "MAX_EMBEDDING_INPUTS", "MAX_RERANK_DOCUMENTS",
             "LORA_NAME_PATTERN", "MAX_LORA_SCALE", "MAX_LORA_ADAPTERS"]


# ---------------------------------------------------------------------- the two statements agree
def _shape(schema: Any, *, names: bool = False) -> Any:
    """A JSON schema without its prose (titles, descriptions): what a payload may hold. Inside
    ``properties`` the keys are field names, kept even where a field is called ``description``."""
    if isinstance(schema, dict):
        return {key: _shape(value, names=key == "properties" and not names) for key, value in schema.items()
                if names or key not in ("title", "description")}
    if isinstance(schema, list):
        return [_shape(value) for value in schema]
    return schema


def _defaults(model: type[BaseModel]) -> dict[str, Any]:
    """Every optional field's default as data, default factories called (a JSON schema leaves those out)."""
    def plain(value: Any) -> Any:
        return value.model_dump() if isinstance(value, BaseModel) else value

    return {name: plain(field.get_default(call_default_factory=True))
            for name, field in model.model_fields.items() if not field.is_required()}


def _validators(model: type[BaseModel]) -> dict[str, list[str]]:
    decorators = model.__pydantic_decorators__
    return {kind: sorted(getattr(decorators, kind)) for kind in (
        "validators", "field_validators", "root_validators", "model_validators", "field_serializers",
        "model_serializers", "computed_fields")}


@pytest.mark.parametrize(("ours", "engines"), PAIRS, ids=[ours.__name__ for ours, _ in PAIRS])
def test_each_wire_shape_states_its_engine_counterpart(ours: type[Any], engines: type[Any]) -> None:
    assert ours.__name__ == engines.__name__       # the schemas' $refs name the classes
    if issubclass(ours, enum.Enum):
        assert [(m.name, m.value) for m in ours] == [(m.name, m.value) for m in engines]
        return
    assert _shape(TypeAdapter(ours).json_schema()) == _shape(TypeAdapter(engines).json_schema())
    if dataclasses.is_dataclass(ours):
        assert [(f.name, f.default) for f in dataclasses.fields(ours)] == \
               [(f.name, f.default) for f in dataclasses.fields(engines)]
        assert ours.__dataclass_params__.frozen == engines.__dataclass_params__.frozen
        return
    assert list(ours.model_fields) == list(engines.model_fields)
    assert _defaults(ours) == _defaults(engines)
    assert dict(ours.model_config) == dict(engines.model_config)
    assert _validators(ours) == _validators(engines)


def test_every_wire_shape_has_an_engine_counterpart_and_the_limits_agree() -> None:
    stated = {obj for obj in vars(wire).values() if isinstance(obj, type) and obj.__module__ == wire.__name__}
    assert stated == {ours for ours, _ in PAIRS}
    assert _shape(TypeAdapter(wire.ToolChoice).json_schema()) == \
           _shape(TypeAdapter(engine_request.ToolChoice).json_schema())
    assert {name: getattr(wire, name) for name in CONSTANTS} == {name: getattr(engine_request, name)
                                                                for name in CONSTANTS}


def test_protocol_never_imports_the_engine() -> None:
    code = ("import importlib, pkgutil, sys, slotq.jobs.protocol as p\n"
            "for m in pkgutil.iter_modules(p.__path__): importlib.import_module(f'slotq.jobs.protocol.{m.name}')\n"
            "print(sorted(m for m in sys.modules if m.startswith('slotq.engine')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------- requests: same verdicts, nothing lost
TEXT = st.text(st.characters(codec="utf-8"), max_size=12)
NAME = st.from_regex(r"[A-Za-z0-9_-]{1,6}", fullmatch=True) | st.sampled_from(["", "two words", "x" * 65])
JUNK = (st.none() | st.booleans() | st.integers() | st.floats() | TEXT | st.lists(st.integers(), max_size=2)
        | st.dictionaries(TEXT, st.integers(), max_size=2))
FLOATS = st.floats(allow_nan=False) | st.sampled_from([float("nan"), float("inf"), float("-inf")])
STOPS_AT_THE_LIMIT = st.sampled_from(["s" * 256, "s" * 257])


def requests(field: Any) -> st.SearchStrategy[dict[str, Any]]:
    """Generation requests built field by field from ``field(values)``: with ``field=lambda s: s`` most
    are valid (up to the limits and past some); with junk mixed in, most are not."""
    def optional(**fields: st.SearchStrategy[Any]) -> dict[str, st.SearchStrategy[Any]]:
        return {name: field(values) for name, values in fields.items()}

    call = st.fixed_dictionaries(optional(id=TEXT, function=st.fixed_dictionaries(optional(name=NAME, arguments=TEXT))),
                                 optional=optional(type=st.just("function")))
    message = st.fixed_dictionaries(
        optional(role=st.sampled_from(["system", "user", "assistant", "tool", "robot"])),
        optional=optional(content=TEXT | st.none(), tool_calls=st.lists(call, max_size=2) | st.none(),
                          tool_call_id=TEXT, name=NAME))
    function = st.fixed_dictionaries(optional(name=NAME), optional=optional(
        description=TEXT, strict=st.booleans(), parameters=st.just({"type": "object", "properties": {}})))
    tool = st.fixed_dictionaries(optional(function=function), optional=optional(type=st.just("function")))
    choice = (st.sampled_from(["none", "auto", "required", "sometimes"])
              | st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({"name": NAME})}))
    sampling = st.fixed_dictionaries({}, optional=optional(
        temperature=st.floats(-0.5, 5.5), top_k=st.integers(-1, 100_001), top_p=st.floats(0, 1.5),
        min_p=st.floats(0, 1), repeat_penalty=st.floats(0, 11), presence_penalty=st.floats(-2.5, 2.5),
        frequency_penalty=st.floats(-2, 2), penalty_last_n=st.integers(-2, 64), seed=st.integers(-1, 2**32),
        logit_bias=st.dictionaries(st.integers(0, 500), FLOATS, max_size=3), grammar=st.just('root ::= "a"'),
        json_schema=st.sampled_from([{"type": "string"}, {"x": float("nan")}, {}])))
    body = st.fixed_dictionaries({}, optional=optional(
        max_tokens=st.integers(0, 300), n=st.integers(0, 65), stop=st.lists(TEXT | STOPS_AT_THE_LIMIT, max_size=3),
        ignore_eos=st.booleans(), sampling=sampling, priority=st.integers(-101, 101), deadline=FLOATS | st.none(),
        tools=st.lists(tool, max_size=3) | st.none(), tool_choice=choice, parallel_tool_calls=st.booleans(),
        reasoning_format=st.sampled_from(["deepseek", "none", "other"]), logprobs=st.integers(-1, 21) | st.none()))
    source = st.one_of(st.fixed_dictionaries(optional(prompt=TEXT)),
                       st.fixed_dictionaries(optional(messages=st.lists(message, min_size=1, max_size=3))),
                       st.fixed_dictionaries(optional(prompt=TEXT, messages=st.lists(message, max_size=1))),
                       st.just({}))
    return st.builds(lambda a, b: {**a, **b}, source, body)


def _verdict(model: type[BaseModel], body: dict[str, Any]) -> str | list[tuple[Any, ...]]:
    """What a model makes of a request: its JSON, or its errors."""
    try:
        return model.model_validate(body).model_dump_json()
    except ValidationError as exc:
        return [(e["type"], e["loc"], e["msg"]) for e in exc.errors()]


def _edge_cases() -> list[dict[str, Any]]:
    """A request on each side of every rule the validators state, so each is tried whatever hypothesis draws."""
    tool = {"function": {"name": "f"}}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    called = [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]
    return [
        {}, {"prompt": "a", **chat}, {"prompt": "a", "stop": [""]}, {"prompt": "a", "stop": ["s" * 256]},
        {"prompt": "a", "stop": ["s" * 257]},
        *({"prompt": "a", "sampling": {"logit_bias": {1: bias}}} for bias in (float("inf"), float("-inf"),
                                                                                float("nan"), 3.0)),
        {"prompt": "a", "sampling": {"grammar": 'root ::= "a"', "json_schema": {}}},
        {"prompt": "a", "sampling": {"json_schema": {"x": float("nan")}}},
        *({"messages": [{"role": role, "content": None, "tool_calls": called}]} for role in ("assistant", "tool")),
        {**chat, "tools": [tool, tool]}, {"prompt": "a", "tools": [tool]},
        {**chat, "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        {**chat, "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "f"}}},
        {**chat, "tool_choice": "required"}, {**chat, "tools": [tool], "tool_choice": "required"},
        {**chat, "tools": [tool], "sampling": {"json_schema": {}}},
        {**chat, "tools": [tool], "sampling": {"grammar": 'root ::= "a"'}},
        {**chat, "tools": [tool], "tool_choice": "none", "sampling": {"grammar": 'root ::= "a"'}},
        {**chat, "tools": [tool], "ignore_eos": True},
        {**chat, "tools": [tool], "tool_choice": "none", "ignore_eos": True},
    ]


def _with_examples(test: Any) -> Any:
    for case in _edge_cases():
        test = example(case)(test)
    return test


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@_with_examples
@given(requests(lambda values: st.one_of(values, values, values, JUNK)) | requests(lambda values: values))
def test_the_wire_accepts_what_the_engine_accepts_and_refuses_the_rest_alike(body: dict[str, Any]) -> None:
    assert _verdict(wire.GenerationParams, body) == _verdict(engine_request.GenerationParams, body)


EMBEDDING_INPUTS = st.lists(TEXT, max_size=3) | st.lists(st.lists(st.integers(-2, 2**31), max_size=3), max_size=3)


@example({"inputs": ["a", ""]})
@example({"inputs": [[0], []]})
@example({"inputs": [[0, -1]]})
@example({"inputs": [[0, 1], [2]], "truncate": True})
@given(st.fixed_dictionaries({}, optional={"inputs": EMBEDDING_INPUTS | JUNK, "truncate": st.booleans() | JUNK}))
def test_the_wire_accepts_the_embeddings_the_engine_accepts_and_refuses_the_rest_alike(body: dict[str, Any]) -> None:
    assert _verdict(wire.EmbeddingParams, body) == _verdict(engine_request.EmbeddingParams, body)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(requests(lambda values: values).filter(lambda body: isinstance(_verdict(JobRequest, body), str)),
       st.integers(1, 300), st.integers(0, 64), st.booleans())
def test_a_job_reaches_the_engine_as_it_was_enqueued(body: dict[str, Any], max_tokens: int, priority_class: int,
                                                      lent_reserve: bool) -> None:
    job = JobRequest.model_validate(body)
    decoded = decode_payload(encode_payload(job)).request      # through the queue, as a worker reads it
    assert isinstance(decoded, JobRequest)
    resume = [7] * min(max_tokens - 1, 3) if job.n == 1 else []
    request = to_engine_request(decoded, request_id="j", max_tokens=max_tokens, priority_class=priority_class,
                                lent_reserve=lent_reserve, resume_tokens=resume)
    assert (request.id, request.max_tokens, request.priority_class, request.lent_reserve, request.resume_tokens) == \
           ("j", max_tokens, priority_class, lent_reserve, resume)
    # Compared as values, not JSON text: a -0.0 penalty equal to its 0.0 default is left out of the
    # payload and comes back as 0.0, the same value (Hypothesis found it).
    fields = set(wire.GenerationParams.model_fields) - {"max_tokens"}
    assert request.model_dump(mode="json", include=fields) == job.model_dump(mode="json", include=fields)
    back = wire.GenerationParams.model_validate(request.model_dump(include=set(wire.GenerationParams.model_fields)))
    assert back.model_dump(mode="json", exclude={"max_tokens"}) == job.model_dump(mode="json", include=fields)


@given(st.lists(TEXT.filter(bool), min_size=1, max_size=4) | st.lists(st.lists(st.integers(0, 2**31), min_size=1,
                                                                               max_size=4), min_size=1, max_size=4),
       st.booleans())
def test_an_embedding_job_reaches_the_engine_as_it_was_enqueued(inputs: list[Any], truncate: bool) -> None:
    job = EmbeddingJobRequest(inputs=inputs, truncate=truncate)
    decoded = decode_payload(encode_payload(job)).request
    assert isinstance(decoded, EmbeddingJobRequest)
    request = to_engine_embedding_request(decoded, request_id="e")
    assert request.id == "e"
    assert wire.EmbeddingParams.model_validate(request.model_dump(exclude={"id"})).model_dump() == \
           job.model_dump(include=set(wire.EmbeddingParams.model_fields))


# ---------------------------------------------------------------------- events: nothing lost at the edge
def _engine(value: BaseModel, engine_type: type[BaseModel]) -> Any:
    return engine_type.model_validate(value.model_dump())


LOGPROB_FIELDS = {"id": st.integers(0, 2**31), "token": TEXT, "token_bytes": st.lists(st.integers(0, 255), max_size=4),
                  "logprob": st.floats(allow_nan=False)}
TOKEN_LOGPROBS = st.builds(wire.TokenLogprob, top=st.lists(st.builds(wire.TopLogprob, **LOGPROB_FIELDS), max_size=3),
                           **LOGPROB_FIELDS)
TOOL_CALL_PIECES = st.lists(st.builds(wire.ToolCallDelta, index=st.integers(0, 9), id=TEXT | st.none(),
                                     name=TEXT | st.none(), arguments=TEXT), max_size=3)
TIME = st.floats(0, 1e9)
TOKENS = st.integers(0, 10**6)
DONES = st.builds(Done, choice=st.integers(0, 63), finish_reason=st.sampled_from(wire.FinishReason),
                  usage=st.builds(wire.Usage, prompt_tokens=TOKENS, completion_tokens=TOKENS,
                                  cached_prompt_tokens=TOKENS, reasoning_tokens=TOKENS),
                  timings=st.builds(wire.Timings, queue_ms=TIME, ttft_ms=TIME | st.none(), total_ms=TIME,
                                    decode_tokens_per_s=TIME | st.none()),
                  error=st.none() | st.builds(wire.ErrorInfo, code=TEXT, message=TEXT, retryable=st.booleans(),
                                              field=TEXT | st.none()),
                  stop_sequence=TEXT | st.none())


@given(TOOL_CALL_PIECES, st.lists(TOKEN_LOGPROBS, max_size=3))
def test_a_text_deltas_pieces_cross_the_edge_whole(tool_calls: list[wire.ToolCallDelta],
                                                   logprobs: list[wire.TokenLogprob]) -> None:
    """A delta's text, reasoning and token ids are str and int on both sides and are written as
    they are; its tool-call pieces and logprobs cross in the wire's types, nothing lost."""
    crossed_calls = wire_tool_calls([engine_reply_parser.ToolCallDelta(**dataclasses.asdict(d)) for d in tool_calls])
    crossed_logprobs = wire_logprobs([_engine(lp, engine_events.TokenLogprob) for lp in logprobs])
    assert crossed_calls == tool_calls and all(type(d) is wire.ToolCallDelta for d in crossed_calls)
    assert crossed_logprobs == logprobs and all(type(lp) is wire.TokenLogprob for lp in crossed_logprobs)


def test_a_text_delta_holds_only_what_a_chunk_entry_carries() -> None:
    """The fields of the engine's delta are a chunk's (less the attempt, which the worker adds) and
    the request id: a field added to the engine's delta must be given a place on the wire here."""
    chunk_fields = set(inspect.signature(encode_chunk).parameters) - {"attempt"}
    assert {f.name for f in dataclasses.fields(TextDelta)} - {"request_id"} == chunk_fields


@given(DONES)
def test_a_finished_choice_crosses_the_edge_whole(done: Done) -> None:
    event = Finished(request_id="j", choice=done.choice, finish_reason=engine_events.FinishReason(done.finish_reason),
                     usage=_engine(done.usage, engine_events.Usage),
                     timings=_engine(done.timings, engine_events.Timings),
                     error=None if done.error is None else _engine(done.error, engine_events.ErrorInfo),
                     stop_sequence=done.stop_sequence)
    crossed = from_engine_finished(event)
    assert crossed == done and type(crossed.finish_reason) is wire.FinishReason
