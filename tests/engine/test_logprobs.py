"""Logprobs on real llama.cpp (the tiny model): each generated token's log probability and the top
alternatives, from the raw logits row before the sampler chain and the constraint mask touch it.

The reference is computed independently: llama-cpp-python's high-level ``Llama`` evaluates the
prompt and the generated tokens with every position's logits kept, and numpy takes their
log-softmax in float64.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from llama_cpp import Llama

from slotq.engine import Engine, GenerationRequest, SamplingParams, TextDelta, TokenLogprob
from slotq.engine.logprobs import StepLogprobs, as_event
from tests.support.engine import greedy, running_engine

TOLERANCE = 1e-4       # the float32 logits rounded to 7 significant digits
# The reference's context: no flash attention (with it, the logits differ by up to ~3e-3 here) and one
# token per micro-batch, so both round every row the same way.
EXACT = {"slots": 2, "ubatch": 1, "flash_attention": "off"}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


async def logprobs_of(engine: Engine, request: GenerationRequest) -> tuple[list[int], list[TokenLogprob]]:
    """Choice 0's tokens and logprobs, checking there is exactly one logprob per token in each delta."""
    tokens: list[int] = []
    logprobs: list[TokenLogprob] = []
    async for event in engine.submit(request):
        if isinstance(event, TextDelta) and event.choice == 0:
            assert event.logprobs is not None and len(event.logprobs) == len(event.token_ids)
            tokens += event.token_ids
            logprobs += event.logprobs
    return tokens, logprobs


def reference_logprobs(model_path: Path, prompt_tokens: list[int], generated: list[int]) -> np.ndarray:
    """log-softmax of the raw logits that chose each generated token, one row per token."""
    llm = Llama(model_path=str(model_path), n_ctx=512, n_threads=1, logits_all=True, verbose=False)
    try:
        for token in prompt_tokens + generated[:-1]:       # one token per batch, as the engine (EXACT) runs
            llm.eval([token])
        rows = np.array(llm.scores[len(prompt_tokens) - 1:len(prompt_tokens) - 1 + len(generated)], dtype=np.float64)
    finally:
        llm.close()
    peak = rows.max(axis=1, keepdims=True)
    return rows - peak - np.log(np.exp(rows - peak).sum(axis=1, keepdims=True))


def assert_matches_reference(reference: np.ndarray, tokens: list[int], logprobs: list[TokenLogprob], k: int) -> None:
    for position, (token, entry) in enumerate(zip(tokens, logprobs, strict=True)):
        row = reference[position]
        assert entry.id == token
        assert entry.logprob <= 0
        assert entry.logprob == pytest.approx(row[token], abs=TOLERANCE), position
        assert len(entry.top) == k
        assert [alt.logprob for alt in entry.top] == sorted((alt.logprob for alt in entry.top), reverse=True)
        assert {alt.id for alt in entry.top} == set(np.argsort(-row)[:k].tolist()), position
        for alt in entry.top:
            assert alt.logprob == pytest.approx(row[alt.id], abs=TOLERANCE)


async def test_greedy_logprobs_are_the_raw_log_softmax_and_the_chosen_token_is_the_best(tiny_model_path: Path) -> None:
    async with running_engine(tiny_model_path, **EXACT) as engine:
        request = greedy("The queue", 12, logprobs=3)
        tokens, logprobs = await logprobs_of(engine, request)
        prompt = engine.prompt_tokens(request)
        plain_events = [e async for e in engine.submit(greedy("The queue", 3)) if isinstance(e, TextDelta)]
    assert len(tokens) == 12
    assert_matches_reference(reference_logprobs(tiny_model_path, prompt, tokens), tokens, logprobs, k=3)
    for entry in logprobs:
        assert entry.top[0].id == entry.id and entry.top[0].logprob == entry.logprob     # greedy: the best one
        assert bytes(entry.token_bytes).decode("utf-8", errors="replace") in (entry.token, "\ufffd") \
            or entry.token.startswith("bytes:")
    assert all(event.logprobs is None for event in plain_events)     # not asked: none computed


async def test_logprobs_are_the_same_whatever_the_temperature(tiny_model_path: Path) -> None:
    """The distribution before temperature: a hot sample's first token has the greedy one's alternatives."""
    async with running_engine(tiny_model_path, slots=2) as engine:
        _, cold = await logprobs_of(engine, greedy("Hot or cold", 1, logprobs=5))
        _, hot = await logprobs_of(engine, greedy("Hot or cold", 1, logprobs=5,
                                                  sampling=SamplingParams(temperature=4.0, top_k=0, top_p=1.0,
                                                                          min_p=0.0, seed=7)))
    assert [(alt.id, alt.logprob) for alt in hot[0].top] == [(alt.id, alt.logprob) for alt in cold[0].top]


async def test_a_constrained_request_reports_the_unconstrained_logprobs(tiny_model_path: Path) -> None:
    """The constraint mask writes -inf into the row; the logprobs are read before it, so they are
    the model's own, and the best alternatives include tokens the schema forbids."""
    async with running_engine(tiny_model_path, **EXACT) as engine:
        request = greedy("JSON:", 6, ignore_eos=False, logprobs=4,
                         sampling=SamplingParams(temperature=0, json_schema=SCHEMA))
        tokens, logprobs = await logprobs_of(engine, request)
        prompt = engine.prompt_tokens(request)
    assert tokens and bytes(logprobs[0].token_bytes).startswith(b"{")
    assert_matches_reference(reference_logprobs(tiny_model_path, prompt, tokens), tokens, logprobs, k=4)
    assert any(entry.top[0].id != entry.id for entry in logprobs), "the schema never overruled the model's best"


async def test_every_choice_of_a_constrained_n2_request_reads_the_unmasked_row(tiny_model_path: Path) -> None:
    """The choices of one request sample their first token from the same row; the first one's mask
    must not leak into the second one's logprobs."""
    async with running_engine(tiny_model_path, slots=4) as engine:
        request = greedy("JSON:", 2, ignore_eos=False, n=2, logprobs=4,
                         sampling=SamplingParams(temperature=0, json_schema=SCHEMA))
        first: dict[int, TokenLogprob] = {}
        async for event in engine.submit(request):
            if isinstance(event, TextDelta) and event.logprobs:
                first.setdefault(event.choice, event.logprobs[0])
    assert first[0] == first[1]
    assert first[0].top[0].id != first[0].id          # the best token is one the schema forbids


def test_logprobs_are_bounded_by_openais_limit() -> None:
    with pytest.raises(ValueError, match="less than or equal to 20"):
        GenerationRequest(prompt="x", logprobs=21)
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        GenerationRequest(prompt="x", logprobs=-1)


def float64_log_softmax(rows: np.ndarray) -> np.ndarray:
    shifted = rows.astype(np.float64) - rows.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


@pytest.mark.parametrize("n_vocab", [151_936, 1_000, 70])
def test_a_steps_rows_in_one_call_match_a_float64_log_softmax_row_by_row(n_vocab: int) -> None:
    """Rows of different tops in one block (a 151k vocabulary, one that the top-k's groups do not
    divide, and one with fewer groups than ``top``): each row's own logprobs within float32
    tolerance, its top in order (ties by id), and the sampled token's entry beside it."""
    rng = np.random.default_rng(7)
    rows = rng.normal(0, 4, (5, n_vocab)).astype(np.float32)
    rows[1, 10:14] = rows[1].max() + 1          # a tie at the top: the lower ids first
    rows[3, -1] = rows[3].max() + 2             # the best token is the last id (a leftover past the groups)
    tops = [20, 3, 0, 20, 1]
    reference = float64_log_softmax(rows)
    result = StepLogprobs().compute(list(rows), tops, [lambda token: str(token).encode()] * len(rows))
    for i, (row, top) in enumerate(zip(result, tops, strict=True)):
        sampled = int(rng.integers(n_vocab))
        entry = row.of(sampled)
        assert entry.chosen.id == sampled and entry.chosen.token == str(sampled)
        assert entry.chosen.logprob == pytest.approx(reference[i, sampled], abs=TOLERANCE)
        expected = np.lexsort((np.arange(n_vocab), -reference[i]))[:top].tolist()    # best first, ties by id
        assert [alt.id for alt in entry.top] == expected, i
        for alt in entry.top:
            assert alt.logprob == pytest.approx(reference[i, alt.id], abs=TOLERANCE)
        event = as_event(entry)
        assert (event.id, event.logprob, [alt.id for alt in event.top]) == (sampled, entry.chosen.logprob, expected)
        assert event.token_bytes == list(str(sampled).encode())


def test_a_block_that_is_not_one_row_per_top_is_refused() -> None:
    with pytest.raises(ValueError, match="rows: expected one"):
        StepLogprobs().compute([], [], [])
    with pytest.raises(ValueError, match="rows: expected one"):
        StepLogprobs().compute(list(np.zeros((2, 8), dtype=np.float32)), [1], [lambda token: b""])
