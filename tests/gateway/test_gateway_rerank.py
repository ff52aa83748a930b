"""``/v1/rerank`` end to end over HTTP (httpx, no SDK: OpenAI has no rerank API): real Valkey, a ``slotq worker``
on the suite's tiny reranker and one on the tiny generator, and a ``slotq gateway`` process. Bodies and answers
in llama-server's shapes (Jina's, and TEI's with ``texts``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from slotq.engine import EngineConfig
from slotq.engine.request import RerankRequest
from slotq.engine.rerank import RerankEngine
from tests.support.gateway import Stack

pytestmark = pytest.mark.timeout(180)

QUERY = "cat"
DOCUMENTS = ["the cat sat on the mat", "queues hold jobs", "a", "hello world", "slots and batches"]
SHAPE = {"slots": 4, "ctx": 256, "batch": 256, "threads": 1}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path, tiny_reranker_path: Path) -> Iterator[Stack]:
    with Stack.started(tmp_path_factory.mktemp("gateway-rerank"), tiny_model_path) as s:
        s.start_worker("gw-generator", "tiny-gen")
        s.start_worker("gw-ranker", "tiny-rank", queue="slotq:rerank", model=tiny_reranker_path,
                       flash_attention="off", **SHAPE)
        s.start_gateway("gateway-1").wait_ready()
        s.wait_for_models({"tiny-gen", "tiny-rank"})
        yield s


@pytest.fixture(scope="module")
def expected(tiny_reranker_path: Path) -> tuple[list[float], int]:
    """The scores and tokens of QUERY x DOCUMENTS from the engine in this process: what the worker must answer."""
    async def score() -> tuple[list[float], int]:
        engine = await RerankEngine.start(EngineConfig(model_path=tiny_reranker_path, flash_attention="off", **SHAPE))
        try:
            ranking = await engine.rerank(RerankRequest(query=QUERY, documents=DOCUMENTS))
        finally:
            await engine.close()
        return [float(s) for s in ranking.scores], ranking.prompt_tokens
    return asyncio.run(score())


def post(stack: Stack, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{stack.url}{path}", json=body, timeout=60)


def test_rerank_in_llama_servers_shape(stack: Stack, expected: tuple[list[float], int]) -> None:
    scores, tokens = expected
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -scores[i])
    reply = post(stack, "/v1/rerank", {"model": "tiny-rank", "query": QUERY, "documents": DOCUMENTS})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["model"] == "tiny-rank" and body["object"] == "list" and reply.headers["x-slotq-job-id"]
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert [r["index"] for r in body["results"]] == order                     # most relevant first
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx([scores[i] for i in order], abs=1e-3)
    assert all("document" not in r for r in body["results"])
    top = post(stack, "/v1/rerank", {"model": "tiny-rank", "query": QUERY, "documents": DOCUMENTS, "top_n": 2,
                                     "return_documents": True}).json()
    assert [(r["index"], r["document"]["text"]) for r in top["results"]] == [(i, DOCUMENTS[i]) for i in order[:2]]
    job = httpx.get(f"{stack.url}/v1/jobs/{reply.headers['x-slotq-job-id']}", timeout=10).json()
    assert job["result"]["scores"] == pytest.approx(scores, abs=1e-3)            # in document order
    assert [r["index"] for r in job["response"]["results"]] == order
    models = {m["id"]: m["kind"] for m in httpx.get(f"{stack.url}/v1/models", timeout=10).json()["data"]}
    assert models == {"tiny-gen": "generation", "tiny-rank": "rerank"}


def test_every_path_and_teis_shape(stack: Stack, expected: tuple[list[float], int]) -> None:
    """llama-server's four paths; a body without ``model`` goes to the one reranker served; ``texts`` is TEI's."""
    scores, _tokens = expected
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -scores[i])
    for path in ("/v1/reranking", "/rerank", "/reranking"):
        body = post(stack, path, {"query": QUERY, "documents": DOCUMENTS}).json()
        assert body["model"] == "tiny-rank" and [r["index"] for r in body["results"]] == order, path
    tei = post(stack, "/rerank", {"query": QUERY, "texts": DOCUMENTS, "return_text": True, "top_n": 3}).json()
    assert [(r["index"], r["text"]) for r in tei] == [(i, DOCUMENTS[i]) for i in order[:3]]
    assert [r["score"] for r in tei] == pytest.approx([scores[i] for i in order[:3]], abs=1e-3)


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"query": QUERY, "documents": []}, "documents", "at least 1 item"),
    ({"query": QUERY, "documents": ["d"] * 1001}, "documents", "at most 1000 items"),
    ({"query": QUERY, "texts": ["d"] * 1001}, "texts", "at most 1000 items"),
    ({"query": QUERY}, "documents", "give the texts to score"),
    ({"query": QUERY, "documents": ["d"], "texts": ["d"]}, "documents", "give the texts to score"),
    ({"query": QUERY, "documents": ["d"], "top_n": 0}, "top_n", "greater than or equal to 1"),
    ({"documents": ["d"]}, "query", "required"),
    ({"query": QUERY, "documents": ["short", "abc " * 80]}, "documents",
     "document 1 with the query is 329 tokens; a query and a document together may have at most 256"),
    ({"query": QUERY, "texts": ["short", "abc " * 80]}, "texts", "may have at most 256"),
    ({"query": QUERY * 300, "documents": ["d"]}, "query", "may have at most 256"),
])
def test_bad_input_is_a_400_naming_the_field_and_the_limit(stack: Stack, body: dict[str, object], param: str,
                                                         words: str) -> None:
    reply = post(stack, "/v1/rerank", {"model": "tiny-rank", **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_model_that_cannot_rank_is_refused_by_name(stack: Stack) -> None:
    reply = post(stack, "/v1/rerank", {"model": "tiny-gen", "query": QUERY, "documents": DOCUMENTS})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "model_cannot_rank" and error["param"] == "model"
    assert "model 'tiny-gen' cannot rank: it serves generation jobs" in error["message"]
    assert post(stack, "/v1/rerank", {"model": "nope", "query": QUERY, "documents": ["d"]}).status_code == 404
    chat = post(stack, "/v1/chat/completions", {"model": "tiny-rank", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "wrong_model_kind"
