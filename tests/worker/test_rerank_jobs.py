"""Rerank jobs through the queue: a worker on the suite's tiny reranker (real Valkey), the producer's
``rerank``/``enqueue_rerank``, the payload's kind, and what cannot rank failing by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from slotq.engine import EngineConfig
from slotq.engine.errors import ModelCannotRank
from slotq.engine.request import RerankRequest
from slotq.engine.rerank import RerankEngine
from slotq.jobs.errors import JobFailed, JobRejected
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.payload import SCHEMA_VERSION, decode_payload, encode_payload
from slotq.jobs.protocol.schemas import JobKind, JobStatus, RerankJobRequest
from tests.support.jobs import settings_for

QUERY = "cat"
DOCUMENTS = ["the cat sat on the mat", "queues hold jobs", "a", "hello world"]
EXACT = {"flash_attention": "off"}      # a pair then scores the same in any batch (tests/engine/test_rerank.py)


def test_payloads_name_the_rerank_kind() -> None:
    job = RerankJobRequest(query=QUERY, documents=DOCUMENTS, lane="bulk")
    payload = encode_payload(job)
    assert payload["kind"] == "rerank" and payload["schema_version"] == "{}.{}".format(*SCHEMA_VERSION)
    assert SCHEMA_VERSION >= (1, 5)                                 # the version that added the kind
    assert decode_payload(payload).request == job
    empty = decode_payload({**payload, "documents": []})
    assert empty.error is not None and "documents" in empty.error.message
    with pytest.raises(ValueError, match="at most 1000 items"):
        RerankJobRequest(query=QUERY, documents=["d"] * 1001)


async def test_rerank_through_the_queue(start_worker, client: SlotqClient, tiny_reranker_path: Path) -> None:
    worker = await start_worker(model=str(tiny_reranker_path), ctx=256, batch=256, **EXACT)
    assert worker.kind == JobKind.RERANK                            # detected from the GGUF's rank pooling
    [info] = (await client.queue_info()).workers
    assert info.kind == JobKind.RERANK and info.ctx == 256
    result = await client.rerank(QUERY, DOCUMENTS, timeout=60, metadata={"doc": 1})
    engine = await RerankEngine.start(EngineConfig(model_path=tiny_reranker_path, slots=2, ctx=256, batch=256,
                                                   threads=1, **EXACT))
    try:
        direct = await engine.rerank(RerankRequest(query=QUERY, documents=DOCUMENTS))
    finally:
        await engine.close()
    assert np.allclose(result.scores, direct.scores, atol=1e-3) and result.usage.prompt_tokens == direct.prompt_tokens
    assert result.ranked() == sorted(range(4), key=lambda i: -direct.scores[i])
    assert result.ranked(2) == result.ranked()[:2]
    handle = await client.enqueue_rerank(RerankJobRequest(query=QUERY, documents=DOCUMENTS[:1]),
                                         idempotency_key="rr-1")
    job = await handle.result(timeout=60)
    assert job.status == JobStatus.SUCCEEDED and job.scores == pytest.approx(result.scores[:1], abs=1e-3)
    assert job.model == "tiny-reranker" and job.model_fingerprint


async def test_a_document_over_the_limit_fails_by_name(start_worker, client: SlotqClient,
                                                       tiny_reranker_path: Path) -> None:
    await start_worker(model=str(tiny_reranker_path), ctx=128, batch=128)
    with pytest.raises(JobFailed, match=r"invalid_request: document 1 with the query is \d+ tokens; a query and a "
                                        r"document together may have at most 128"):
        await client.rerank(QUERY, ["short", "abc " * 40], timeout=60)
    with pytest.raises(JobRejected, match="document 0 and the query have 3003 characters") as refused:
        await client.enqueue_rerank(QUERY, ["x" * 3000])
    assert refused.value.field == "documents"


async def test_what_cannot_rank_is_refused_by_name(start_worker, client: SlotqClient, redis_url: str) -> None:
    """A rerank job on a generator's queue fails by name (the producer refuses it once it knows the workers),
    and a worker asked to rank a model without rank pooling does not start."""
    stray = await client.enqueue_rerank(QUERY, DOCUMENTS)
    await start_worker(worker_name="generator")
    failed = await stray.result(timeout=60)
    assert failed.status == JobStatus.FAILED and failed.error.code == "wrong_job_kind" and not failed.error.retryable
    assert "a rerank job reached a worker of generation jobs (generator" in failed.error.message
    assert "reranker GGUF, or --rerank" in failed.error.message
    fresh = SlotqClient(client.redis, client.settings, owns_connection=False)
    with pytest.raises(JobRejected, match="serve generation jobs, not rerank jobs"):
        await fresh.enqueue_rerank(QUERY, DOCUMENTS)
    with pytest.raises(ModelCannotRank, match="tiny.gguf cannot rank: its pooling is none, not rank"):
        await start_worker(worker_name="not-a-ranker", rerank=True, queue_name="slotq:rerank")
    with pytest.raises(ValueError, match="embeddings and rerank .* are both set"):
        settings_for(redis_url, embeddings=True, rerank=True)
