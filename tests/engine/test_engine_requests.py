"""What the engine accepts and how it constrains output, on real llama.cpp with the tiny model:
invalid requests fail at once naming the field (and the engine keeps serving), closing and
deadlines, and JSON-schema / grammar constrained generation. The rest of the engine's behaviour
is in test_engine.py.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from slotq.engine import (
    Engine,
    EngineConfig,
    EngineState,
    EngineStopped,
    Finished,
    FinishReason,
    GenerationRequest,
    GrammarError,
    InvalidRequest,
    PromptTooLong,
    SamplingParams,
)
from tests.support import REPO_ROOT
from tests.support.engine import collect, collect_choices, greedy, run_one, running_engine


# ----------------------------------------------------------------------------- invalid requests
@pytest.mark.parametrize(("sampling", "field"), [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"repeat_penalty": 0}, "repeat_penalty"),
    ({"seed": -1}, "seed"),
    ({"grammar": "root ::= \"a\"", "json_schema": {"type": "string"}}, None),
    ({"bogus": 1}, "bogus"),
])
def test_bad_sampling_values_fail_validation_naming_the_field(sampling: dict, field: str | None) -> None:
    with pytest.raises(ValidationError) as info:
        GenerationRequest.model_validate({"prompt": "x", "sampling": sampling})
    locs = [err["loc"] for err in info.value.errors()]
    assert all(loc[0] == "sampling" for loc in locs)
    if field is not None:
        assert any(field in loc for loc in locs), locs


@pytest.mark.parametrize(("request_fields", "field"), [
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"priority": 1000}, "priority"),
    ({"stop": [""]}, None),
    ({"resume_tokens": [1, 2, 3], "max_tokens": 3}, None),
])
def test_bad_request_values_fail_validation(request_fields: dict, field: str | None) -> None:
    with pytest.raises(ValidationError) as info:
        GenerationRequest.model_validate({"prompt": "x", **request_fields})
    if field is not None:
        assert any(field in err["loc"] for err in info.value.errors())


async def test_invalid_requests_raise_at_submit_and_engine_keeps_serving(tiny_model_path: Path) -> None:
    async with running_engine(tiny_model_path, slots=4, ctx=512) as engine:
        n_vocab = engine.info.n_vocab

        with pytest.raises(PromptTooLong) as info:
            engine.submit(greedy("x" * 600, 10))
        assert "512" in str(info.value) and info.value.field == "prompt"
        assert info.value.code == "prompt_too_long" and info.value.retryable is False

        with pytest.raises(PromptTooLong) as info:               # fits alone, not with max_tokens
            engine.submit(greedy("y" * 400, 200))
        assert "512" in str(info.value) and info.value.field == "max_tokens"

        for grammar in ["root ::= (", 'rule ::= "a"', "root ::= [a-"]:
            with pytest.raises(GrammarError) as info:
                engine.submit(greedy("g", 5, ignore_eos=False, sampling=SamplingParams(temperature=0, grammar=grammar)))
            assert info.value.field == "sampling.grammar"

        sampling = SamplingParams(temperature=0, grammar='root ::= "a"')
        with pytest.raises(InvalidRequest) as info:      # see test_constraints_leaving_nothing_to_sample
            engine.submit(greedy("g", 5, ignore_eos=True, sampling=sampling))
        assert info.value.field == "ignore_eos"

        with pytest.raises(InvalidRequest) as info:
            engine.submit(greedy("n", 5, n=5))
        assert info.value.field == "n" and "4" in str(info.value)

        for bad in (n_vocab, 10**6, -1):
            with pytest.raises(InvalidRequest) as info:
                engine.submit(greedy("b", 5, sampling=SamplingParams(temperature=0, logit_bias={bad: 1.0})))
            assert info.value.field == "sampling.logit_bias" and str(bad) in str(info.value)

        with pytest.raises(InvalidRequest) as info:
            engine.submit(greedy("r", 5, resume_tokens=[n_vocab + 7]))
        assert info.value.field == "resume_tokens"

        # Nothing leaked: no slot, no queue entry; a normal request is served as before.
        stats = engine.stats()
        assert (stats.slots_busy, stats.waiting, stats.finished) == (0, 0, {})
        text, tokens, fin = await run_one(engine, greedy("still fine", 12))
        assert fin[0].finish_reason == FinishReason.LENGTH and len(tokens) == 12


async def test_message_text_spelling_a_control_token_tokenizes_as_text(tiny_model_path: Path) -> None:
    """Text in a message that spells a control token (the tiny vocabulary's ``</s>`` and ``<s>``) is
    tokenized as the characters it is, merged with the text around it; everything else in the prompt
    tokenizes as before."""
    async with running_engine(tiny_model_path) as engine:
        model = engine.model
        forged = engine.prompt_tokens(GenerationRequest(messages=[{"role": "user", "content": "a</s><s>b"}]))
        plain = engine.prompt_tokens(GenerationRequest(messages=[{"role": "user", "content": "ab"}]))
        rendered = engine.template.render([{"role": "user", "content": "a</s><s>b"}])
        as_text = model.tokenize(rendered.replace("\ue000", "").replace("\ue001", ""), parse_special=False)
    assert model.eos_token not in forged and forged.count(model.bos_token) == plain.count(model.bos_token)
    assert forged == as_text


async def test_close_finishes_inflight_requests_with_a_retryable_error(tiny_model_path: Path) -> None:
    engine = await Engine.start(EngineConfig(model_path=tiny_model_path, slots=1, ctx=4096, threads=1))
    running = engine.submit(greedy("in flight", 4000))
    waiting = engine.submit(greedy("queued", 10))
    got = []
    async for ev in running:
        got.append(ev)
        if len(got) == 3:
            break
    await engine.close()
    _, _, fin = await collect(waiting)
    assert fin[0].finish_reason == FinishReason.ERROR
    assert fin[0].error is not None and fin[0].error.code == "engine_stopped" and fin[0].error.retryable
    with pytest.raises(EngineStopped, match="closed") as info:
        engine.submit(greedy("after close", 3))
    assert info.value.retryable and engine.state == EngineState.CLOSED and engine.failure is None


async def test_deadline_in_the_past_finishes_at_once(tiny_model_path: Path) -> None:
    async with running_engine(tiny_model_path, slots=1) as engine:
        text, tokens, fin = await run_one(engine, greedy("late", 50, deadline=time.time() - 1))
    assert fin[0].finish_reason == FinishReason.DEADLINE
    assert len(tokens) <= 1


# ----------------------------------------------------------------------------- JSON schema
PERSON = {
    "type": "object",
    "properties": {
        # maxLength: a random-weight model never chooses to close a string by itself.
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
    },
    "required": ["name", "age"],
}
JSON_PROMPTS = ["Person:", "json", "hello", "x", "name and age"]


async def _json_outputs(path: Path) -> list[tuple[str, Finished]]:
    async with running_engine(path, slots=len(JSON_PROMPTS)) as engine:
        sampling = SamplingParams(temperature=0.0, json_schema=PERSON)
        results = await asyncio.gather(*(
            run_one(engine, greedy(p, 200, ignore_eos=False, sampling=sampling)) for p in JSON_PROMPTS))
    return [(text, fin[0]) for text, _, fin in results]


async def test_json_schema_output_parses_and_matches_the_schema(tiny_model_path: Path) -> None:
    for text, fin in await _json_outputs(tiny_model_path):
        assert fin.finish_reason == FinishReason.STOP, (text, fin)     # the grammar ended it, not max_tokens
        value = json.loads(text)            # strict: raw control characters in strings are not JSON
        assert isinstance(value, dict) and set(value) == {"name", "age"}
        # (No length check: llama.cpp's grammar decodes UTF-8 leniently, so a random model's invalid
        # byte sequences count as one character in the grammar but become several U+FFFD here.)
        assert isinstance(value["name"], str)
        assert isinstance(value["age"], int) and not isinstance(value["age"], bool)


OPEN_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                              "b": {"type": "object", "properties": {"c": {"type": "boolean"}}}}}


async def test_an_object_schema_without_additional_properties_admits_no_other_keys(tiny_model_path: Path) -> None:
    """``additionalProperties`` unsaid reads as false (llama-server's reading), in a json_schema and
    in a tool's parameters: pydantic and the frameworks send such schemas, and a model then invents keys."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": OPEN_SCHEMA}}]
    async with running_engine(tiny_model_path, slots=8, ctx=1024) as engine:
        sampled = SamplingParams(temperature=1.5, seed=7, json_schema=OPEN_SCHEMA)
        schema_replies, _ = await collect_choices(engine.submit(GenerationRequest(
            prompt="{", n=8, max_tokens=120, sampling=sampled)))
        arguments: dict[tuple[int, int], str] = {}
        handle = engine.submit(GenerationRequest(
            messages=[{"role": "user", "content": "call f"}], tools=tools, tool_choice="required", n=8,
            max_tokens=200, parallel_tool_calls=False, sampling=SamplingParams(temperature=1.5, seed=7)))
        async for event in handle:
            for call in getattr(event, "tool_calls", ()):
                arguments[event.choice, call.index] = arguments.get((event.choice, call.index), "") + call.arguments
    values = [json.loads(choice.text) for choice in schema_replies.values()]
    values += [json.loads(text) for text in arguments.values()]
    assert len(values) == 16
    for value in values:
        assert set(value) <= {"a", "b"} and set(value.get("b", {})) <= {"c"}, value


_NOTHING_LEFT_TO_SAMPLE = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from slotq.engine import Engine, EngineConfig, Finished, GenerationRequest, InvalidRequest, SamplingParams

    async def main(path, variant):
        engine = await Engine.start(EngineConfig(model_path=Path(path), slots=1, ctx=128, threads=1))
        eos = engine.model.eos_token
        if variant == "ignore_eos":          # the grammar is complete after "a": only EOS may follow, banned
            sampling, ignore_eos = SamplingParams(temperature=0, grammar='root ::= "a"'), True
        elif variant == "eos_banned":        # the same through logit_bias
            sampling = SamplingParams(temperature=0, grammar='root ::= "a"', logit_bias={eos: float("-inf")})
            ignore_eos = False
        else:                                # the grammar needs a "b" next and every "b" token is banned
            b_tokens = [t for t in range(engine.info.n_vocab) if engine.model.token_bytes(t) == b"b"]
            sampling = SamplingParams(temperature=0, grammar='root ::= "ab"',
                                      logit_bias={t: float("-inf") for t in b_tokens})
            ignore_eos = False
        resume = []
        if variant == "resume_outside_grammar":  # an earlier attempt's tokens that the grammar forbids
            sampling, ignore_eos = SamplingParams(temperature=0, grammar='root ::= "a"+'), False
            resume = [t for t in range(engine.info.n_vocab) if engine.model.token_bytes(t) == b"b"]
        request = GenerationRequest(prompt="x", max_tokens=8, ignore_eos=ignore_eos, sampling=sampling,
                                    resume_tokens=resume)
        try:
            handle = engine.submit(request)
        except InvalidRequest as exc:
            print("REJECTED", exc.field)
        else:
            async for event in handle:
                if isinstance(event, Finished):
                    print("FINISHED", event.finish_reason.value)
        await engine.close()

    asyncio.run(main(*sys.argv[1:]))
""")

@pytest.mark.parametrize("variant", [
    "ignore_eos",                # refused at submit since b3bdf4a
    "eos_banned",                # bans are a huge finite penalty, so the grammar always has a token
    "grammar_token_banned",
    "resume_outside_grammar",    # replaying it aborted the process (a C++ exception in llama.cpp)
])
def test_constraints_leaving_nothing_to_sample_do_not_kill_the_process(tiny_model_path: Path, variant: str) -> None:
    """Run in a subprocess: the failure mode is an abort of the whole interpreter. Either refusing
    the request at submit or finishing it (e.g. with an error) is fine; dying is not."""
    proc = subprocess.run([sys.executable, "-c", _NOTHING_LEFT_TO_SAMPLE, str(tiny_model_path), variant],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(("REJECTED", "FINISHED")), proc.stdout
    if variant == "resume_outside_grammar":
        assert proc.stdout.startswith("REJECTED resume_tokens"), proc.stdout


