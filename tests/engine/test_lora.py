"""LoRA adapters on real llama.cpp with the tiny model and the suite's own tiny adapter
(tests/support/tiny_model.py): an adapter changes the output, scale 0 is the base model, sequences
of different adapter sets batched on one engine get what each gets alone (scheduler rule 10: both
sets progress, and neither reuses the other's prefix cache), and bad names and scales are refused by
field. The pure policy is in test_scheduler_lora.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from pydantic import ValidationError

from slotq.engine import EngineConfig, GenerationRequest, InvalidRequest, LoraRef
from tests.support.engine import greedy, run_one, running_engine
from tests.support.tiny_model import write_lora

PROMPT = "hello world"


@pytest.fixture(scope="module")
def adapter_path(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Path:
    return write_lora(tmp_path_factory.mktemp("lora") / "style.gguf", tiny_model_path)


def _lora(*refs: LoraRef) -> GenerationRequest:
    return greedy(PROMPT, 16, lora=list(refs))


async def test_an_adapter_changes_the_output_and_scale_zero_gives_the_base_models_tokens(
        tiny_model_path: Path, adapter_path: Path) -> None:
    async with running_engine(tiny_model_path, slots=2, lora=f"style={adapter_path}") as engine:
        _, base, _ = await run_one(engine, _lora())
        _, styled, _ = await run_one(engine, _lora(LoraRef(id="style")))
        _, by_id, _ = await run_one(engine, _lora(LoraRef(id=0, scale=1.0)))
        _, zero, _ = await run_one(engine, _lora(LoraRef(id="style", scale=0.0)))
        _, half, _ = await run_one(engine, _lora(LoraRef(id=0, scale=0.5)))
    assert len(base) == len(styled) == 16
    assert styled != base
    assert by_id == styled                  # a name and its index are one adapter; 1.0 is its configured scale
    assert zero == base
    assert half not in (base, styled)


async def test_sets_batched_together_each_get_their_solo_tokens(tiny_model_path: Path, adapter_path: Path) -> None:
    """Four requests, two per set, on one engine with turns of at most 2 steps: each gets the tokens it gets
    alone, so the step ran each sequence under its own adapters and no set reused the other's cells."""
    async with running_engine(tiny_model_path, slots=4, lora=f"style={adapter_path}",
                              lora_turn_max_steps=2) as engine:
        _, base, _ = await run_one(engine, _lora())
        _, styled, _ = await run_one(engine, _lora(LoraRef(id="style")))
        results = await asyncio.gather(*(run_one(engine, _lora(*([LoraRef(id="style")] if i % 2 else [])))
                                         for i in range(4)))
        stats = engine.stats()
    assert [tokens for _, tokens, _ in results] == [base, styled, base, styled]
    assert stats.lora_switches >= 16 // 2      # both sets progressed turn by turn, not one after the other
    assert 0 < stats.lora_switch_seconds < stats.decode_seconds         # the switches' decodes, timed apart


async def test_unknown_adapters_and_bad_scales_are_refused_by_field(tiny_model_path: Path,
                                                                     adapter_path: Path) -> None:
    async with running_engine(tiny_model_path, slots=2, lora=f"style={adapter_path}") as engine:
        for refs, field in [([LoraRef(id="nope")], "lora[0].id"), ([LoraRef(id=0), LoraRef(id=3)], "lora[1].id"),
                            ([LoraRef(id=0), LoraRef(id="style")], "lora[1].id")]:
            with pytest.raises(InvalidRequest) as info:
                engine.submit(_lora(*refs))
            assert info.value.field == field
        _, tokens, _ = await run_one(engine, _lora(LoraRef(id="style")))   # and it keeps serving
        assert len(tokens) == 16
    for bad in (float("nan"), 1e6):
        with pytest.raises(ValidationError, match=r"lora\.0\.scale"):
            GenerationRequest.model_validate({"prompt": "x", "lora": [{"id": 0, "scale": bad}]})


def test_the_setting_is_checked_at_start_up(tiny_model_path: Path, adapter_path: Path) -> None:
    config = EngineConfig(model_path=tiny_model_path, lora=f" a={adapter_path}:0.5 , b={adapter_path}")
    assert [(s.name, s.path, s.scale) for s in config.lora_adapters] == [("a", adapter_path, 0.5),
                                                                        ("b", adapter_path, 1.0)]
    for bad, says in [("nopath", "name=path"), (f"a={adapter_path},a={adapter_path}", "twice"),
                      ("a=/no/such.gguf", "no such file"), (f"bad name={adapter_path}", "must match")]:
        with pytest.raises(ValidationError, match=says):
            EngineConfig(model_path=tiny_model_path, lora=bad)
