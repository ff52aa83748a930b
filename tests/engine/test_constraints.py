"""Structured output under bounded cost (issue 32): the probe's schema bombs, in the engine on real
llama.cpp (the tiny model) and in the producer's check, which needs no model.

Before llguidance, ``minItems: 100000000`` became a grammar of gigabytes in the worker (about 17
bytes per item: the tests below measure that growth at 10^5 items instead of taking 12 GB), and an
enum of 100,000 values made every decode step of the batch wait seconds.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest
from llama_cpp import llama_grammar

from slotq.engine import FinishReason, GrammarError, SamplingParams
from slotq.engine.constraints import check_constraint
from slotq.engine.grammar_knobs import GrammarKnobs
from tests.support.engine import greedy, run_one, running_engine

MIN_ITEMS_BOMB = {"type": "array", "minItems": 100_000_000, "items": {"type": "string"}}   # 77 bytes as JSON
ENUM_BOMB = {"enum": [f"v{i}" for i in range(100_000)]}


def constrained(schema: dict) -> SamplingParams:
    return SamplingParams(temperature=0, json_schema=schema)


def test_the_old_converter_grows_with_min_items_and_the_new_check_does_not() -> None:
    """What made the bomb: llama-cpp-python's converter writes every required item out."""
    small = llama_grammar.json_schema_to_gbnf(json.dumps({**MIN_ITEMS_BOMB, "minItems": 1_000}))
    large = llama_grammar.json_schema_to_gbnf(json.dumps({**MIN_ITEMS_BOMB, "minItems": 100_000}))
    assert len(large) > 90 * len(small) > 90_000          # linear in minItems: 10^8 would be ~1.7 GB
    check_constraint(SamplingParams(json_schema=MIN_ITEMS_BOMB), GrammarKnobs())   # llguidance: symbolic, accepted


def test_the_producer_check_refuses_the_enum_bomb_naming_the_field_and_the_limit() -> None:
    with pytest.raises(GrammarError) as info:
        check_constraint(SamplingParams(json_schema=ENUM_BOMB), GrammarKnobs())
    assert info.value.field == "sampling.json_schema"
    assert "SLOTQ_GRAMMAR_INITIAL_FUEL=1000000" in str(info.value)


def test_the_limits_are_the_settings() -> None:
    schema = {"enum": [f"value-{i}" for i in range(2_000)]}
    check_constraint(SamplingParams(json_schema=schema), GrammarKnobs())
    with pytest.raises(GrammarError, match="SLOTQ_GRAMMAR_INITIAL_FUEL=10000"):
        check_constraint(SamplingParams(json_schema=schema), GrammarKnobs(grammar_initial_fuel=10_000))


def test_a_gbnf_grammar_is_checked_the_same_way() -> None:
    many = "root ::= " + " | ".join(f'"w{i}"' for i in range(5_000))
    with pytest.raises(GrammarError) as info:
        check_constraint(SamplingParams(grammar=many), GrammarKnobs(grammar_initial_fuel=10_000))
    assert info.value.field == "sampling.grammar" and "SLOTQ_GRAMMAR_INITIAL_FUEL" in str(info.value)
    with pytest.raises(GrammarError, match="root"):
        check_constraint(SamplingParams(grammar='rule ::= "a"'), GrammarKnobs())


def test_the_producer_refuses_what_only_a_worker_could_find_too_large() -> None:
    """llguidance asserts fewer than 65,525 symbols only when it builds the matcher with a model's
    tokenizer; the producer's check must refuse such a grammar too, or the two would disagree."""
    many_rules = "root ::= " + "x " * 90_000 + '\nx ::= "a"?\n'
    with pytest.raises(GrammarError, match="SLOTQ_GRAMMAR_MAX_SIZE=50000"):
        check_constraint(SamplingParams(grammar=many_rules), GrammarKnobs())


async def test_the_engine_refuses_the_enum_bomb_and_runs_the_min_items_one_in_bounded_memory(
        tiny_model_path: Path) -> None:
    async with running_engine(tiny_model_path, slots=2) as engine:
        with pytest.raises(GrammarError) as info:
            engine.submit(greedy("x", 3, ignore_eos=False, sampling=constrained(ENUM_BOMB)))
        assert info.value.field == "sampling.json_schema" and "SLOTQ_GRAMMAR_INITIAL_FUEL" in str(info.value)

        before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        text, tokens, [finished] = await run_one(engine, greedy("x", 3, ignore_eos=False,
                                                                sampling=constrained(MIN_ITEMS_BOMB)))
        assert finished.finish_reason == FinishReason.LENGTH and len(tokens) == 3 and text.startswith("[")
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kb < 100 * 1024   # KB: < 100 MB grown

        _, tokens, [finished] = await run_one(engine, greedy("y", 5))              # the engine serves on
        assert len(tokens) == 5 and finished.error is None


async def test_integer_bounds_and_enums_hold(tiny_model_path: Path) -> None:
    """llama-cpp-python's converter ignored minimum/maximum; llguidance enforces them."""
    schema = {"type": "object", "required": ["n", "c"], "additionalProperties": False,
              "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 7}, "c": {"enum": ["x", "y"]}}}
    async with running_engine(tiny_model_path, slots=2) as engine:
        for prompt in ("a", "b", "c"):
            text, _, [finished] = await run_one(engine, greedy(prompt, 40, ignore_eos=False,
                                                               sampling=constrained(schema)))
            assert finished.finish_reason == FinishReason.STOP, text
            value = json.loads(text)
            assert 3 <= value["n"] <= 7 and value["c"] in ("x", "y")
