"""Structured output under bounded cost (issue 32): the probe's schema bombs, in the engine on real
llama.cpp (the tiny model) and in the producer's check, which needs no model.

Before llguidance, ``minItems: 100000000`` became a grammar of gigabytes in the worker (about 17
bytes per item: the tests below measure that growth at 10^5 items instead of taking 12 GB), and an
enum of 100,000 values made every decode step of the batch wait seconds.
"""

from __future__ import annotations

import ctypes
import json
import resource
from pathlib import Path

import numpy as np
import pytest
from llama_cpp import llama_grammar

from slotq.engine import FinishReason, GrammarError, SamplingParams
from slotq.engine.config import EngineConfig
from slotq.engine.constraints import (
    ConstraintCompiler,
    StepMasks,
    TokenMatcher,
    check_constraint,
    constraint_for,
    forbid,
)
from slotq.engine.grammar_knobs import GrammarKnobs
from slotq.engine.llama_model import LlamaModel
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


def reference_mask(logits: np.ndarray, matcher: TokenMatcher) -> np.ndarray:
    """A row masked the plain way: llguidance's byte per token (0: not allowed), -inf where it is 0."""
    allowed = np.frombuffer(matcher._matcher.compute_logit_bias(), dtype=np.uint8)[:len(logits)]
    return np.where(allowed == 0, np.float32(-np.inf), logits)


@pytest.mark.parametrize("allowed_share", [0.0, 0.0001, 0.01, 0.3, 1.0])
def test_forbid_writes_minus_infinity_exactly_where_the_bits_are_clear(allowed_share: float) -> None:
    """Both ways (few words allowing a token: -inf everywhere and the allowed put back; many:
    every bit unpacked), and a vocabulary that ends inside a word."""
    n_vocab = 151_930
    rng = np.random.default_rng(int(allowed_share * 1e4))
    allowed = rng.random(n_vocab) < allowed_share
    words = np.packbits(np.concatenate([allowed, np.zeros(-n_vocab % 32, bool)]), bitorder="little").view(np.int32)
    row = rng.normal(0, 1, n_vocab).astype(np.float32)
    expected = np.where(allowed, row, np.float32(-np.inf))
    forbid(row, words)
    assert np.array_equal(row, expected)


def test_a_steps_masks_filled_together_equal_each_matchers_own(tiny_model_path: Path) -> None:
    """StepMasks writes exactly the -inf each matcher's own mask writes, at every state of a walk
    through the schema; the row it masked is left alone by the matcher's next mask call (and only
    that call: the next step's apply clears a mark that was not used)."""
    schema = {"type": "object", "required": ["n", "c"], "additionalProperties": False,
              "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 7}, "c": {"enum": ["xy", "yz"]}}}
    model = LlamaModel(EngineConfig(model_path=tiny_model_path, slots=1, ctx=128, threads=1))
    try:
        compiler = ConstraintCompiler(model.vocab, model.n_vocab, [model.eos_token], GrammarKnobs())
        constraint = constraint_for(constrained(schema))
        assert constraint is not None
        batched = [compiler.matcher(constraint, []) for _ in range(3)]
        alone = [compiler.matcher(constraint, []) for _ in range(3)]
        reference = [compiler.matcher(constraint, []) for _ in range(3)]
        masks = StepMasks(model.n_vocab)
        rng = np.random.default_rng(3)
        walk = list(b'{"n":5,"c":"yz"}')
        for step in range(len(walk)):
            logits = rng.normal(0, 1, (3, model.n_vocab)).astype(np.float32)
            rows, own = logits.copy(), logits.copy()
            masks.apply([(matcher, rows[i]) for i, matcher in enumerate(batched)])
            for i, matcher in enumerate(alone):
                matcher.mask(own[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
            assert np.array_equal(rows, own), step
            assert np.array_equal(rows, [reference_mask(logits[i], matcher) for i, matcher in enumerate(reference)])
            assert np.isinf(rows).any(axis=1).all()                 # the schema forbids something at every step
            rows[0] = logits[0]                                      # the same row, unmasked again in place
            batched[0].mask(rows[0].ctypes.data_as(ctypes.POINTER(ctypes.c_float)))   # marked: left alone
            assert np.array_equal(rows[0], logits[0])
            fresh = logits[1].copy()
            batched[1].mask(fresh.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))    # another row: masked
            assert np.array_equal(fresh, own[1])
            token = next(t for t in range(model.n_vocab) if model.token_bytes(t, special=False) == bytes([walk[step]]))
            for matcher in (*batched, *alone, *reference):
                matcher.accept(token)
        masks.apply([])                                              # the marks of the last step expire
        row = rng.normal(0, 1, model.n_vocab).astype(np.float32)
        batched[2].mask(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
        assert np.isinf(row).any()
    finally:
        model.close()
