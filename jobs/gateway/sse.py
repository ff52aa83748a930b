"""Serving a job's stream over Server-Sent Events, and noticing clients that leave.

A feed task reads the job's Redis stream through the client API into a small queue, so the HTTP
side can wait with a timeout (and send keep-alive comments) without cancelling the read. When the
client disconnects, Starlette cancels the response body (uvicorn reports the disconnect at once),
and the job is cancelled unless the request asked to keep it; a request that only reads an
existing job (a resume, a second reader) never cancels it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from slotq.jobs.errors import JobNotFound, StreamGone
from slotq.jobs.gateway import metrics
from slotq.jobs.gateway.chunks import comment
from slotq.jobs.gateway.service import Gateway
from slotq.jobs.openai.errors import ApiError
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.schemas import StreamEntry

log = logging.getLogger(__name__)

T = TypeVar("T")
DEADLINE_GRACE_S = 2.0       # after a request's deadline, the worker's final event gets this long to arrive
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    """The HTTP client disconnected while the gateway was waiting."""


class Renderer(Protocol):
    finished: bool

    def opening(self) -> list[str]: ...
    def feed(self, entry: StreamEntry) -> list[str]: ...
    def failed(self, error: ApiError) -> list[str]:
        """The stream ends early with ``error`` (unreadable, or past the request's deadline)."""
        ...


def stream_error(exc: Exception, job_id: str) -> ApiError:
    """A job's stream that could not be read to its end: gone for good (410: read the job's
    result instead), no such job (404), or Redis out of reach (503: resume with Last-Event-ID;
    the cause, which names Redis' host, is logged here and not sent)."""
    if isinstance(exc, JobNotFound):
        return ApiError.job_not_found(job_id)
    if isinstance(exc, StreamGone):
        return ApiError(410, f"{exc} (GET /v1/jobs/{job_id} has the result)", type="invalid_request_error",
                        code="stream_gone")
    log.warning("job %s: lost its stream (%s: %s)", job_id, type(exc).__name__, exc)
    return ApiError(503, f"lost the job's stream ({type(exc).__name__}); resume with Last-Event-ID",
                    type="server_error", code="stream_unavailable")


class EntryFeed:
    """The job's stream entries, read from the start by a background task. The client's stream
    ends with the final entry or raises, so the feed's last item is one of those."""

    def __init__(self, client: SlotqClient, job_id: str) -> None:
        self._queue: asyncio.Queue[StreamEntry | Exception] = asyncio.Queue(maxsize=256)
        self._task = asyncio.create_task(self._pump(client, job_id), name=f"slotq-sse-{job_id}")

    async def _pump(self, client: SlotqClient, job_id: str) -> None:
        try:
            async for entry in client.stream(job_id):
                await self._queue.put(entry)
        except Exception as exc:  # handed to the reader, who reports it
            await self._queue.put(exc)

    async def next(self, timeout: float) -> StreamEntry | None:
        """The next entry, or None if none came within ``timeout``.
        Raises what the read raised (Redis unreachable beyond the client's retries)."""
        try:
            async with asyncio.timeout(timeout):     # not wait_for: see slotq.jobs.aio.wait_until_set
                item = await self._queue.get()
        except TimeoutError:
            return None
        if isinstance(item, Exception):
            raise item
        return item

    def close(self) -> None:
        self._task.cancel()


async def until_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable``; raise ClientGone (and cancel it) if the client disconnects first."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.create_task(disconnected())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
    if not work.done() or work.cancelled():
        raise ClientGone
    return work.result()


async def open_stream(request: Request, gateway: Gateway, client: SlotqClient, job_id: str, renderer: Renderer, *,
                      cancel_on_disconnect: bool, deadline: float | None,
                      headers: dict[str, str], first_error: Callable[[StreamEntry], ApiError | None] | None = None,
                      ) -> Response:
    """Start reading the job's stream (from its start: the renderer skips what the client already
    has, see ``chunks``) and answer with SSE. Up to one keep-alive interval is spent
    waiting for the first entry before the status line goes out, so a job that fails at once (a
    prompt too long for the model, say) is answered with a proper HTTP error via ``first_error``."""
    feed = EntryFeed(client, job_id)
    try:
        first = await until_disconnected(request, feed.next(gateway.settings.gateway_keepalive_s))
    except ClientGone:
        feed.close()
        if cancel_on_disconnect:
            gateway.client_left(client, job_id)
        return Response(status_code=499)
    except Exception as exc:
        feed.close()
        raise stream_error(exc, job_id) from exc
    error = first_error(first) if first_error is not None and first is not None else None
    if error is not None:
        feed.close()
        raise error
    return StreamingResponse(_events(gateway, client, job_id, renderer, feed, first, cancel_on_disconnect, deadline),
                             media_type="text/event-stream", headers=SSE_HEADERS | headers)


async def _events(gateway: Gateway, client: SlotqClient, job_id: str, renderer: Renderer, feed: EntryFeed,
                  first: StreamEntry | None, cancel_on_disconnect: bool,
                  deadline: float | None) -> AsyncIterator[str]:
    """The response body: the events for ``first`` and every later entry, a comment every
    ``gateway_keepalive_s`` while the stream is quiet."""
    keepalive = gateway.settings.gateway_keepalive_s
    completed = False
    metrics.STREAMS_ACTIVE.inc()
    try:
        for event in renderer.opening():
            yield event
        item = first           # an entry, or None: the stream was quiet for a keep-alive interval
        while True:
            if item is None:
                if deadline is not None and time.time() > deadline + DEADLINE_GRACE_S:
                    gateway.cancel_soon(client, job_id)
                    for event in renderer.failed(ApiError.deadline(f"job {job_id}: the deadline passed before it "
                                                                   "finished")):
                        yield event
                    break
                yield comment("keep-alive")
            else:
                for event in renderer.feed(item):
                    yield event
                if renderer.finished:
                    break
            try:
                item = await feed.next(keepalive)
            except Exception as exc:  # the stream is gone, or Redis unreachable beyond the client's retries
                for event in renderer.failed(stream_error(exc, job_id)):
                    yield event
                break
        completed = True
    finally:
        metrics.STREAMS_ACTIVE.dec()
        feed.close()
        if not completed and cancel_on_disconnect:
            gateway.client_left(client, job_id)
