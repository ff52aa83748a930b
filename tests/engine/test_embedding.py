"""The embedding engine (slotq.engine.embedding) on real llama.cpp: batching, pooling, normalisation, limits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from slotq.engine import EngineConfig, InvalidRequest
from slotq.engine.embedding import EmbeddingEngine, is_embedding_model, normalize
from slotq.engine.request import EmbeddingRequest, GenerationRequest
from tests.support.tiny_model import write_tiny_llama


@pytest.fixture
async def embedder(tiny_model_path: Path) -> AsyncIterator[EmbeddingEngine]:
    engine = await EmbeddingEngine.start(EngineConfig(model_path=tiny_model_path, slots=8, ctx=256, batch=256,
                                                      threads=1))
    try:
        yield engine
    finally:
        await engine.close()


def test_normalize_as_llama_server() -> None:
    rows = np.array([[3.0, -4.0], [0.0, 0.0], [1.0, 1.0]], np.float32)
    assert np.allclose(normalize(rows, 2), [[0.6, -0.8], [0, 0], [2 ** -0.5, 2 ** -0.5]])
    assert np.allclose(normalize(rows, 1), [[3 / 7, -4 / 7], [0, 0], [0.5, 0.5]])
    assert np.allclose(normalize(rows, 0)[0], [3 * 32760 / 4, -32760])
    assert np.allclose(normalize(rows, 3)[0], np.array([3, -4]) / (27 + 64) ** (1 / 3))
    assert normalize(rows, -1) is rows


async def test_inputs_batched_into_one_decode_equal_each_alone(embedder: EmbeddingEngine) -> None:
    """Inputs of different lengths in one decode: each pooled over all of its own tokens (a KV stream
    per sequence made llama.cpp split the longer ones across micro-batches and pool only a part)."""
    texts = ["the cat sat on the mat", "hello world", "a", "queues and slots " * 5]
    alone = [(await embedder.embed(EmbeddingRequest(inputs=[t]))).vectors[0] for t in texts]
    steps = embedder.stats().decode_steps
    together = await embedder.embed(EmbeddingRequest(inputs=texts))
    assert embedder.stats().decode_steps - steps == 1
    for one, other in zip(alone, together.vectors, strict=True):
        assert float(one @ other) > 0.9999          # the same vector; llama.cpp sums in another order per batch shape
    assert np.allclose(np.linalg.norm(together.vectors, axis=1), 1.0, atol=1e-5)   # L2 by default
    concurrent = await asyncio.gather(*(embedder.embed(EmbeddingRequest(inputs=[t])) for t in texts))
    for one, other in zip(alone, concurrent, strict=True):
        assert float(one @ other.vectors[0]) > 0.9999


async def test_token_arrays_and_usage(embedder: EmbeddingEngine) -> None:
    tokens = embedder.model.tokenize("hello world")
    by_text = await embedder.embed(EmbeddingRequest(inputs=["hello world"]))
    by_tokens = await embedder.embed(EmbeddingRequest(inputs=[tokens]))
    assert np.allclose(by_text.vectors, by_tokens.vectors, atol=1e-5)
    assert by_text.prompt_tokens == by_tokens.prompt_tokens == len(tokens)
    with pytest.raises(InvalidRequest, match="input 0: token id 99999 is outside the vocabulary") as bad:
        await embedder.embed(EmbeddingRequest(inputs=[[1, 99999]]))
    assert bad.value.field == "input"


async def test_an_input_over_the_limit_is_refused_unless_truncated(embedder: EmbeddingEngine) -> None:
    long_text = "abc " * 200           # beyond 256 tokens
    with pytest.raises(InvalidRequest, match=r"input 1 is \d+ tokens; an input may have at most 256") as refused:
        await embedder.embed(EmbeddingRequest(inputs=["short", long_text]))
    assert refused.value.field == "input" and not refused.value.retryable
    cut = await embedder.embed(EmbeddingRequest(inputs=["short", long_text], truncate=True))
    assert cut.truncated_inputs == 1
    assert cut.prompt_tokens == len(embedder.model.tokenize("short")) + 256


async def test_generation_requests_are_refused_by_name(embedder: EmbeddingEngine) -> None:
    with pytest.raises(InvalidRequest, match="a generation job reached an embedding worker"):
        await embedder.submit_async(GenerationRequest(prompt="hi"))


async def test_a_cancelled_caller_drops_its_inputs(embedder: EmbeddingEngine) -> None:
    many = EmbeddingRequest(inputs=[f"text number {i}" for i in range(400)])
    task = asyncio.create_task(embedder.embed(many))
    while embedder.stats().decode_steps == 0:
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await embedder.embed(EmbeddingRequest(inputs=["after"]))).vectors.shape == (1, 128)
    assert embedder.stats().slots_busy == 0 and embedder.stats().waiting == 0


async def test_a_closed_engine_refuses(tiny_model_path: Path) -> None:
    engine = await EmbeddingEngine.start(EngineConfig(model_path=tiny_model_path, slots=2, ctx=128, batch=128,
                                                      threads=1))
    await engine.close()
    with pytest.raises(Exception, match="closed"):
        await engine.embed(EmbeddingRequest(inputs=["x"]))


def test_embedding_models_are_told_from_the_gguf(tiny_model_path: Path, tmp_path: Path) -> None:
    assert not is_embedding_model(tiny_model_path)             # a text generator declares no pooling
    pooled = write_tiny_llama(tmp_path / "pooled.gguf", pooling_type=1)
    assert is_embedding_model(pooled)


async def test_the_bundled_model_with_mean_pooling(real_model_path: Path) -> None:
    engine = await EmbeddingEngine.start(EngineConfig(model_path=real_model_path, slots=4, ctx=512, batch=512,
                                                      threads=1))
    try:
        assert engine.pooling == "mean" and engine.dimensions == 576
        result = await engine.embed(EmbeddingRequest(inputs=["The cat sat on the mat.", "A cat was sitting on a rug.",
                                                             "Quarterly revenue grew by 4 percent."]))
        cat, rug, revenue = result.vectors
        assert float(cat @ rug) > float(cat @ revenue)      # similar sentences lie closer
    finally:
        await engine.close()
