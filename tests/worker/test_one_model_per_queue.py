"""A job only ever runs on a worker of its model and kind: real Valkey, real workers on the tiny model.

Two guards, each tested here: a worker refuses to join a queue that a live worker of another model or
kind serves (the queue's serving record, one script), and every job that names a model is checked
by its worker before it runs (a job for another model is dead-lettered by name, never run). Results
and final stream entries say which model served them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from slotq.jobs.errors import JobRejected, QueueServedByAnotherModel
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol import dead_letters
from slotq.jobs.protocol.connection import connect
from slotq.jobs.protocol.redis_queue import RedisQueue
from slotq.jobs.protocol.registry import QueueMembership, QueueServer
from slotq.jobs.protocol.schemas import EntryKind, JobKind, JobStatus
from slotq.jobs.worker.served_model import gguf_fingerprint
from tests.support.jobs import ON_EVERY_BACKEND, collect_stream, job_request
from tests.support.tiny_model import write_tiny_llama

TEXTS = ["the cat sat on the mat", "hello world"]


async def test_two_models_on_the_default_queue(start_worker, client: SlotqClient, tiny_model_path: Path,
                                               tmp_path: Path) -> None:
    """The experiment of issue 44: two workers of two models, both with the default queue, and many jobs.
    The second is refused by name before it loads its model; jobs that name the other model are refused
    by name and kept; none runs on the wrong model. Given its own queue, the second serves its model."""
    other_path = write_tiny_llama(tmp_path / "other.gguf", seed=7)
    # A producer that knows no worker yet (nothing refuses at enqueue) queues jobs for both models.
    wanted = {f"job-{i}": ("model-a", "model-b")[i % 2] for i in range(24)}
    for job_id, model in wanted.items():
        await client.enqueue(job_request(max_tokens=4, idempotency_key=job_id, model=model))
    await start_worker(model_name="model-a", worker_name="worker-a")
    with pytest.raises(QueueServedByAnotherModel) as refused:
        await start_worker(model_name="model-b", worker_name="worker-b", model=str(other_path))
    message = str(refused.value)
    assert "queue 'slotq:queue' is served by model 'model-a' (generation jobs, worker worker-a)" in message
    assert "serves 'model-b'" in message and "SLOTQ_QUEUE_NAME" in message
    assert {w.model for w in await client.workers()} == {"model-a"}
    results = {job_id: await client.result(job_id, timeout=60) for job_id in wanted}
    for job_id, result in results.items():
        if wanted[job_id] == "model-a":
            assert result.status == JobStatus.SUCCEEDED and result.model == "model-a"
            assert result.model_fingerprint == gguf_fingerprint(tiny_model_path)
        else:
            assert result.status == JobStatus.FAILED and result.error.code == "wrong_model"
            assert "asks for model 'model-b', but queue slotq:queue is served by 'model-a'" in result.error.message
            entries = await collect_stream(client, job_id)
            assert [e.kind for e in entries] == [EntryKind.ERROR]          # not one token generated
    assert await dead_letters.by_reason(client.redis) == {"wrong_model": 12}     # kept: none lost

    # Once the producer sees the fleet, it refuses a job for a model the queue does not serve.
    with pytest.raises(JobRejected, match="model 'model-b' is not served on queue 'slotq:queue'") as early:
        await SlotqClient(client.redis, client.settings, owns_connection=False).enqueue(job_request(model="model-b"))
    assert early.value.field == "model"

    # With a queue of its own, model-b serves its jobs; the dead letters go to it and run there.
    await start_worker(model_name="model-b", worker_name="worker-b", model=str(other_path),
                       queue_name="slotq:queue:model-b")
    queue_b = client.for_queue("slotq:queue:model-b")
    result_b = await (await queue_b.enqueue(job_request(max_tokens=4, model="model-b"))).result(timeout=60)
    assert result_b.model == "model-b" and result_b.model_fingerprint == gguf_fingerprint(other_path)
    assert result_b.model_fingerprint != gguf_fingerprint(tiny_model_path)
    [final] = [e for e in await collect_stream(queue_b, result_b.id) if e.final]
    assert (final.model, final.model_fingerprint, final.worker) == ("model-b", result_b.model_fingerprint, "worker-b")


async def test_an_embeddings_worker_beside_a_chat_worker(start_worker, client: SlotqClient) -> None:
    """An embeddings worker with default settings beside a chat worker: refused by name, kind included;
    given its own queue, both kinds are served by their own workers."""
    await start_worker(model_name="chat", worker_name="chat-worker")
    with pytest.raises(QueueServedByAnotherModel, match=r"queue 'slotq:queue' is served by model 'chat' "
                                                        r"\(generation jobs, worker chat-worker\); this worker "
                                                        r"serves 'embed' \(embedding jobs\)"):
        await start_worker(model_name="embed", worker_name="embed-worker", embeddings=True)
    await start_worker(model_name="embed", worker_name="embed-worker", embeddings=True, queue_name="slotq:embed")
    chat = await (await client.enqueue(job_request(max_tokens=4, model="chat"))).result(timeout=60)
    assert chat.status == JobStatus.SUCCEEDED and (chat.model, chat.worker) == ("chat", "chat-worker")
    embedded = await client.for_queue("slotq:embed").embed(TEXTS, model="embed", timeout=60)
    assert len(embedded.vectors) == 2


async def test_a_job_of_the_other_kind_is_refused_by_name_and_kept(start_worker, client: SlotqClient) -> None:
    """A generation job on an embedding worker's queue, queued before any worker was seen: refused by name
    before the engine sees it, and kept as a dead letter."""
    stray = await client.enqueue(job_request())
    await start_worker(model_name="embed", worker_name="embedder", embeddings=True)
    failed = await stray.result(timeout=60)
    assert failed.status == JobStatus.FAILED and failed.error.code == "wrong_job_kind" and failed.model == "embed"
    assert "a generation job reached a worker of embedding jobs (embedder, model embed" in failed.error.message
    assert await dead_letters.by_reason(client.redis) == {"wrong_job_kind": 1}


@pytest.mark.parametrize("redis_backend", ON_EVERY_BACKEND)
async def test_workers_of_two_models_starting_together_never_share_a_queue(redis_url: str) -> None:
    """The join is one script in the queue's slot: of many workers of two models joining at once, those of
    exactly one model are in; an entry past its time (a dead worker) frees the queue; leaving frees it at once."""
    redis = await connect(redis_url, patient=False)
    try:
        keys = RedisQueue(redis, "slotq:queue", ["interactive"]).keys      # laid out for a cluster on one
        memberships = [QueueMembership(redis, keys, QueueServer(worker=f"w{i}", kind=JobKind.GENERATION,
                                                                model=("a", "b")[i % 2])) for i in range(20)]
        answers = await asyncio.gather(*(m.join(ttl_s=30) for m in memberships))
        joined = {m.server.model for m, other in zip(memberships, answers) if other is None}
        assert len(joined) == 1 and sum(other is None for other in answers) == 10
        [winner] = joined
        refused = {other.model for other in answers if other is not None}
        assert refused == {winner}
        embedder = QueueMembership(redis, keys, QueueServer(worker="e", kind=JobKind.EMBEDDING, model=winner))
        assert (await embedder.join(ttl_s=30)).kind == JobKind.GENERATION       # same name, other kind: refused
        for m in memberships:
            if m.server.model == winner:
                await m.leave()
        loser = next(m for m in memberships if m.server.model != winner)
        assert await loser.join(ttl_s=0.05) is None                 # the queue is free once its workers left
        await asyncio.sleep(0.1)
        assert await memberships[0 if winner == "a" else 1].join(ttl_s=30) is None    # ... or their entries expired
    finally:
        await redis.aclose()


async def test_a_worker_whose_queue_was_taken_by_another_model_stops(start_worker, client: SlotqClient,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A worker unheard past its entry's time (stalled, cut off) may find on its next heartbeat that a
    worker of another model took the queue meanwhile: it drains and leaves, and the queue stays theirs."""
    worker = await start_worker(model_name="model-a", lock_ttl_s=3, drain_grace_s=0)
    assert worker.queue is not None
    serving = worker.queue.keys.serving
    async with client.redis.pipeline(transaction=True) as both:      # at once: no heartbeat of its in between
        both.hdel(serving, worker.id)                                # its entry expired while it stalled ...
        both.hset(serving, "newcomer", f"{10**15}\tgeneration\tmodel-b")     # ... and model-b joined
        await both.execute()
    async with asyncio.timeout(30):
        while await client.workers():
            await asyncio.sleep(0.1)
    assert list(await client.redis.hgetall(serving)) == [b"newcomer"]
    assert "queue 'slotq:queue' is served by model 'model-b' (generation jobs, worker newcomer)" in caplog.text
    assert "may not join it" in caplog.text and caplog.text.rstrip().endswith("; stopping")
