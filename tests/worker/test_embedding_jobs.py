"""Embedding jobs through the queue: an embedding worker (tiny model, real Valkey), the producer's
``embed``/``enqueue_embedding``, the payload's kind, and jobs of the wrong kind failing by name."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from slotq.engine import EngineConfig
from slotq.engine.embedding import EmbeddingEngine
from slotq.engine.request import EmbeddingRequest
from slotq.jobs.errors import JobFailed, JobRejected
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.producer.sync_client import SyncSlotqClient
from slotq.jobs.protocol.payload import SCHEMA_VERSION, decode_payload, encode_payload
from slotq.jobs.protocol.schemas import EmbeddingJobRequest, EntryKind, JobKind, JobRequest, JobStatus
from tests.support.jobs import collect_stream, job_request, settings_for
from tests.support.tiny_model import write_tiny_llama

TEXTS = ["the cat sat on the mat", "hello world", "queues and slots"]


def test_payloads_name_their_kind() -> None:
    embedding = EmbeddingJobRequest(inputs=TEXTS, truncate=True, lane="bulk")
    payload = encode_payload(embedding)
    assert payload["kind"] == "embedding" and payload["schema_version"] == "{}.{}".format(*SCHEMA_VERSION)
    assert decode_payload(payload).request == embedding
    generation = encode_payload(JobRequest(prompt="hi"))
    assert "kind" not in generation                           # a generation payload reads as before
    assert isinstance(decode_payload(generation).request, JobRequest)
    bad = decode_payload({**payload, "kind": "summary"})
    assert bad.error is not None and "kind must be one of generation, embedding, rerank" in bad.error.message


async def test_embed_through_the_queue(start_worker, client: SlotqClient, tiny_model_path: Path) -> None:
    worker = await start_worker(embeddings=True, slots=8)
    assert worker.kind == JobKind.EMBEDDING
    [info] = (await client.queue_info()).workers
    assert info.kind == JobKind.EMBEDDING and info.ctx == 512
    result = await client.embed(TEXTS, timeout=60)
    assert len(result.vectors) == 3 and result.dimensions == 128
    assert np.allclose(np.linalg.norm(np.array(result.vectors), axis=1), 1.0, atol=1e-5)
    engine = await EmbeddingEngine.start(EngineConfig(model_path=tiny_model_path, slots=2, ctx=512, batch=512,
                                                      threads=1))
    try:
        direct = await engine.embed(EmbeddingRequest(inputs=TEXTS))
    finally:
        await engine.close()
    assert np.all(np.sum(np.array(result.vectors) * direct.vectors, axis=1) > 0.9999)    # the same vectors
    assert result.usage.prompt_tokens == direct.prompt_tokens
    one = await client.embed("hello world", timeout=60)
    assert float(np.dot(one.vectors[0], result.vectors[1])) > 0.9999


async def test_embedding_job_stream_result_and_idempotency(start_worker, client: SlotqClient) -> None:
    await start_worker(embeddings=True)
    handle = await client.enqueue_embedding(TEXTS, idempotency_key="emb-1", metadata={"doc": 7})
    again = await client.enqueue_embedding(TEXTS, idempotency_key="emb-1")
    assert again.id == handle.id and not again.created
    [final] = await collect_stream(client, handle.id)
    assert final.kind == EntryKind.DONE and final.final and final.usage.prompt_tokens > 0
    result = await handle.result(timeout=60)
    assert result.status == JobStatus.SUCCEEDED and result.metadata == {"doc": 7} and len(result.vectors()) == 3


async def test_an_input_over_the_limit_fails_by_name_unless_truncated(start_worker, client: SlotqClient) -> None:
    await start_worker(embeddings=True, ctx=128, batch=128)
    with pytest.raises(JobFailed, match=r"invalid_request: input 1 is \d+ tokens; an input may have at most 128"):
        await client.embed(["short", "abc " * 100], timeout=60)
    cut = await client.embed(["short", "abc " * 100], truncate=True, timeout=60)
    assert len(cut.vectors) == 2
    with pytest.raises(JobRejected, match="input 0 has 3000 characters") as refused:      # 128 x 16 characters
        await client.enqueue_embedding(["x" * 3000])
    assert refused.value.field == "inputs"


async def test_a_job_of_the_other_kind_fails_by_name(start_worker, client: SlotqClient, redis_url: str) -> None:
    """Either kind reaching a worker of the other fails at once, not retried, and the worker goes on.
    The producer refuses both while the queue's live workers say which kind they serve."""
    stray_embedding = await client.enqueue_embedding(TEXTS)        # no worker yet: nothing to check against
    generator = await start_worker(worker_name="generator")
    failed = await stray_embedding.result(timeout=60)
    assert failed.status == JobStatus.FAILED and failed.error.code == "wrong_job_kind" and not failed.error.retryable
    assert "an embedding job reached a worker of generation jobs (generator" in failed.error.message
    assert (await (await client.enqueue(job_request())).result(timeout=60)).status == JobStatus.SUCCEEDED
    fresh = SlotqClient(client.redis, client.settings, owns_connection=False)     # no cached view of the workers
    with pytest.raises(JobRejected, match="serve generation jobs, not embedding jobs") as refused:
        await fresh.enqueue_embedding(TEXTS)
    assert refused.value.field == "model"
    generator.request_stop("test", grace_s=0)

    other = SlotqClient(client.redis, settings_for(redis_url, queue_name="slotq:embed"), owns_connection=False)
    stray_generation = await other.enqueue(job_request())
    await start_worker(worker_name="embedder", embeddings=True, queue_name="slotq:embed")
    failed = await other.result(stray_generation.id, timeout=60)
    assert failed.status == JobStatus.FAILED and failed.error.code == "wrong_job_kind"
    assert "a generation job reached a worker of embedding jobs (embedder" in failed.error.message
    assert len((await other.embed(TEXTS, timeout=60)).vectors) == 3
    other = SlotqClient(client.redis, other.settings, owns_connection=False)
    with pytest.raises(JobRejected, match="serve embedding jobs, not generation jobs"):
        await other.enqueue(job_request())


async def test_the_kind_is_detected_from_the_gguf(start_worker, client: SlotqClient, tmp_path: Path) -> None:
    pooled = write_tiny_llama(tmp_path / "embedder.gguf", pooling_type=2)      # cls
    worker = await start_worker(model=str(pooled))
    assert worker.kind == JobKind.EMBEDDING
    assert len((await client.embed(TEXTS, timeout=60)).vectors) == 3


async def test_sync_client_embeds(start_worker, redis_url: str) -> None:
    await start_worker(embeddings=True)

    def use() -> list[list[float]]:
        with SyncSlotqClient(redis_url, settings_for(redis_url)) as sync:
            job_id = sync.enqueue_embedding([[1, 60, 61, 62]])
            assert len(sync.result(job_id, timeout=60).vectors()) == 1
            return sync.embed(TEXTS, timeout=60).vectors

    assert len(await asyncio.to_thread(use)) == 3


@pytest.mark.parametrize(("argv", "embeddings"), [([], None), (["--embeddings"], True), (["--no-embeddings"], False)])
def test_slotq_worker_embeddings_flag(argv: list[str], embeddings: bool | None, monkeypatch, tmp_path: Path) -> None:
    from slotq.jobs.cli.commands.common import worker_settings
    from slotq.jobs.cli.parser import build_parser

    monkeypatch.chdir(tmp_path)                       # no .env of the checkout
    monkeypatch.delenv("SLOTQ_EMBEDDINGS", raising=False)
    settings = worker_settings(build_parser().parse_args(["worker", *argv]))
    assert settings.embeddings is embeddings
