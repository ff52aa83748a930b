"""The rerank engine (slotq.engine.rerank) on real llama.cpp with the suite's tiny reranker: pairs joined as
llama-server joins them, batching, limits, and models that cannot rank."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from slotq.engine import EngineConfig, InvalidRequest
from slotq.engine.embedding import EmbeddingEngine, is_embedding_model
from slotq.engine.errors import ModelCannotRank
from slotq.engine.request import GenerationRequest, RerankRequest
from slotq.engine.rerank import RerankEngine, is_rank_model
from tests.support.tiny_model import RANK_SEP, write_tiny_reranker

DOCUMENTS = ["the cat sat on the mat", "queues hold jobs", "a", "slots and batches " * 4, "hello world"]


def _config(path: Path) -> EngineConfig:
    # Flash attention off: on the CPU it rounds through F16 over the decode's whole KV, so a score moves by about
    # 0.5% with the other pairs beside it; without it a pair scores the same alone and batched to 1e-3.
    return EngineConfig(model_path=path, slots=8, ctx=256, batch=256, threads=1, flash_attention="off")


@pytest.fixture
async def ranker(tiny_reranker_path: Path) -> AsyncIterator[RerankEngine]:
    engine = await RerankEngine.start(_config(tiny_reranker_path))
    try:
        yield engine
    finally:
        await engine.close()


async def test_a_pair_is_bos_query_eos_sep_document_eos(ranker: RerankEngine) -> None:
    model = ranker.model
    [pair] = ranker.tokenize(RerankRequest(query="cat", documents=["the mat"]))
    plain = model.tokenize("cat", add_special=False, parse_special=False)
    doc = model.tokenize("the mat", add_special=False, parse_special=False)
    sep = model.token_text(pair[len(plain) + 2])
    assert pair == [model.bos_token, *plain, model.eos_token, pair[len(plain) + 2], *doc, model.eos_token]
    assert sep == RANK_SEP


async def test_a_rerank_template_takes_the_place_of_the_markers(tmp_path: Path) -> None:
    path = write_tiny_reranker(tmp_path / "templated.gguf", rerank_template="<s>q: {query} d: {document}</s>")
    engine = await RerankEngine.start(_config(path))
    try:
        [pair] = engine.tokenize(RerankRequest(query="cat", documents=["mat"]))
        assert pair == engine.model.tokenize("<s>q: cat d: mat</s>", add_special=False, parse_special=True)
        assert pair[0] == engine.model.bos_token and pair[-1] == engine.model.eos_token    # control tokens read
        assert (await engine.rerank(RerankRequest(query="cat", documents=["mat"]))).scores.shape == (1,)
    finally:
        await engine.close()


async def test_scores_in_document_order_batched_as_alone(ranker: RerankEngine) -> None:
    """Every pair of a request in one decode scores as it does alone, in document order; requests sent together
    share decodes."""
    alone = [float((await ranker.rerank(RerankRequest(query="cat", documents=[d]))).scores[0]) for d in DOCUMENTS]
    assert len({round(s, 2) for s in alone}) == len(DOCUMENTS)        # a random head still tells documents apart
    steps = ranker.stats().decode_steps
    together = await ranker.rerank(RerankRequest(query="cat", documents=DOCUMENTS))
    assert ranker.stats().decode_steps - steps == 1
    assert np.allclose(together.scores, alone, atol=1e-3)
    backwards = await ranker.rerank(RerankRequest(query="cat", documents=DOCUMENTS[::-1]))
    assert np.allclose(backwards.scores, alone[::-1], atol=1e-3)
    assert together.prompt_tokens == sum(len(p) for p in ranker.tokenize(RerankRequest(query="cat",
                                                                                       documents=DOCUMENTS)))
    steps = ranker.stats().decode_steps
    concurrent = await asyncio.gather(*(ranker.rerank(RerankRequest(query="cat", documents=[d])) for d in DOCUMENTS))
    assert ranker.stats().decode_steps - steps < len(DOCUMENTS)
    assert np.allclose([r.scores[0] for r in concurrent], alone, atol=1e-3)
    other_query = await ranker.rerank(RerankRequest(query="dog", documents=DOCUMENTS))
    assert not np.allclose(other_query.scores, alone, atol=1e-3)


async def test_a_pair_over_the_limit_is_refused_naming_the_field(ranker: RerankEngine) -> None:
    with pytest.raises(InvalidRequest, match=r"document 1 with the query is \d+ tokens; a query and a document "
                                             r"together may have at most 256") as refused:
        await ranker.rerank(RerankRequest(query="cat", documents=["short", "long text " * 40]))
    assert refused.value.field == "documents" and not refused.value.retryable
    with pytest.raises(InvalidRequest, match=r"the query is \d+ tokens; .* at most 256") as refused:
        await ranker.rerank(RerankRequest(query="long query " * 40, documents=["short"]))
    assert refused.value.field == "query"
    assert (await ranker.rerank(RerankRequest(query="", documents=[""]))).scores.shape == (1,)   # markers alone


async def test_a_model_without_rank_pooling_cannot_rank(tiny_model_path: Path, tiny_reranker_path: Path) -> None:
    assert is_rank_model(tiny_reranker_path) and not is_rank_model(tiny_model_path)
    assert not is_embedding_model(tiny_reranker_path)         # a score, not a vector
    with pytest.raises(ModelCannotRank, match="tiny.gguf cannot rank: its pooling is none, not rank") as refused:
        await RerankEngine.start(_config(tiny_model_path))
    assert refused.value.code == "model_cannot_rank" and refused.value.field == "model"
    with pytest.raises(RuntimeError, match="gives no vector per input"):
        await EmbeddingEngine.start(_config(tiny_reranker_path))


async def test_generation_requests_are_refused_by_name(ranker: RerankEngine) -> None:
    with pytest.raises(InvalidRequest, match="a generation job reached a rerank worker"):
        await ranker.submit_async(GenerationRequest(prompt="hi"))
