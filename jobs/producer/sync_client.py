"""A blocking facade over :class:`~slotq.jobs.producer.client.SlotqClient` for Flask, Django and scripts.

One background thread runs an event loop that owns the async client; each call hands a coroutine
to it and waits. Safe to share between threads of a WSGI server.

    client = SyncSlotqClient("redis://localhost:6379/0")
    job_id = client.enqueue("Hello", max_tokens=32)
    for text in client.text(job_id):
        print(text, end="")
    print(client.result(job_id, timeout=60).status)
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

from slotq.jobs.producer.client import EmbeddingInputs, EmbeddingResult, RerankResult, SlotqClient
from slotq.jobs.protocol.schemas import (
    EmbeddingJobRequest,
    JobRequest,
    JobResult,
    JobStatus,
    QueueInfo,
    StreamEntry,
)
from slotq.jobs.settings import ClientSettings

T = TypeVar("T")


async def _next(agen: AsyncIterator[T]) -> T:
    """The iterator's next item, as a coroutine (what run_coroutine_threadsafe takes; ``__anext__``
    is only typed as an awaitable)."""
    return await anext(agen)


class SyncSlotqClient:
    def __init__(self, redis_url: str, settings: ClientSettings | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="slotq-client", daemon=True)
        self._thread.start()
        self._client: SlotqClient = self._call(SlotqClient.connect(redis_url, settings))

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        while True:
            try:
                yield self._call(_next(agen))
            except StopAsyncIteration:
                return

    def enqueue(self, request: JobRequest | str, **fields: Any) -> str:
        """Returns the job id (the same id for the same idempotency key)."""
        return self._call(self._client.enqueue(request, **fields)).id

    def enqueue_embedding(self, request: EmbeddingJobRequest | EmbeddingInputs, **fields: Any) -> str:
        """Queue an embedding job (see :meth:`SlotqClient.enqueue_embedding`); returns the job id."""
        return self._call(self._client.enqueue_embedding(request, **fields)).id

    def embed(self, inputs: EmbeddingJobRequest | EmbeddingInputs, *, timeout: float | None = None,
              **fields: Any) -> EmbeddingResult:
        """Embed and wait for the vectors (see :meth:`SlotqClient.embed`)."""
        return self._call(self._client.embed(inputs, timeout=timeout, **fields))

    def rerank(self, query: str, documents: Sequence[str], *, timeout: float | None = None,
               **fields: Any) -> RerankResult:
        """Score documents against a query and wait for the scores (see :meth:`SlotqClient.rerank`)."""
        return self._call(self._client.rerank(query, documents, timeout=timeout, **fields))

    def stream(self, job_id: str, last_id: str = "0-0") -> Iterator[StreamEntry]:
        return self._iterate(self._client.stream(job_id, last_id=last_id))

    def text(self, job_id: str) -> Iterator[str]:
        return self._iterate(self._client.text(job_id))

    def result(self, job_id: str, timeout: float | None = None) -> JobResult:
        return self._call(self._client.result(job_id, timeout=timeout))

    def status(self, job_id: str) -> JobStatus:
        return self._call(self._client.status(job_id))

    def cancel(self, job_id: str) -> bool:
        return self._call(self._client.cancel(job_id))

    def queue_info(self) -> QueueInfo:
        return self._call(self._client.queue_info())

    def close(self) -> None:
        self._call(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> SyncSlotqClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
