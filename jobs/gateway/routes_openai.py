"""``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings`` and ``/v1/models``: OpenAI's API on the queue.

A request becomes one job on the queue of the worker fleet that serves its ``model`` (an embedding
request, an embedding job on an embedding model's queue). Streaming
requests are answered from the job's Redis stream (SSE ids = stream ids, so ``Last-Event-ID``
resumes); the others wait for the job's result. Either way the job is durable: retried on another
worker if one dies, and cancelled when its client leaves unless ``keep_on_disconnect`` is set.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request, Response

from slotq.jobs.gateway.adapters import SEPARATOR, adapter_routes, common_adapters
from slotq.jobs.gateway.auth import Caller, CallerDep, authenticate
from slotq.jobs.gateway.chunks import ChunkRenderer, parse_stream_id
from slotq.jobs.gateway.job_results import finished_result
from slotq.jobs.gateway.records import JobRecord
from slotq.jobs.gateway.routing import ModelRoute
from slotq.jobs.gateway.service import Gateway
from slotq.jobs.gateway.sse import ClientGone, open_stream
from slotq.jobs.openai.errors import ApiError, public_param
from slotq.jobs.openai.translate import (
    WireRequest,
    kind_of,
    to_embedding_job,
    to_embeddings_response,
    to_job_request,
    to_response,
    wire_param,
)
from slotq.jobs.openai.wire import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingsRequest,
    ModelCard,
    ModelList,
)
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.schemas import JobStatus

router = APIRouter(prefix="/v1", dependencies=[Depends(authenticate)])


def gateway_of(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


def model_card(route: ModelRoute, adapter: str | None = None) -> ModelCard:
    """A model as ``/v1/models`` lists it, or (``adapter``) the card of one of its LoRA adapters,
    ``base:adapter``. One no worker has loaded (``unloaded``, from the catalog) has no start time
    (``created`` 0) and no slots."""
    return ModelCard(id=route.model if adapter is None else f"{route.model}{SEPARATOR}{adapter}",
                     created=int(min((w.started_at for w in route.workers), default=0)), kind=route.kind,
                     queue=route.queue, workers=len(route.workers), slots_total=route.slots_total,
                     slots_busy=route.slots_busy, status=route.status, load_s=route.load_s,
                     adapters=common_adapters(route.workers) if adapter is None else [],
                     parent=route.model if adapter is not None else None)


@router.get("/models")
async def list_models(request: Request) -> ModelList:
    routes = await gateway_of(request).router.routes()
    cards = [model_card(route) for _model, route in routes.items()]
    cards += [model_card(route, adapter) for route, adapter in adapter_routes(routes).values()]
    return ModelList(data=sorted(cards, key=lambda card: card.id))


@router.get("/models/{model:path}")
async def get_model(model: str, request: Request) -> ModelCard:
    """One served model or LoRA adapter (404 for a name no live worker serves). ``:path``: names may hold a '/'."""
    routes = await gateway_of(request).router.routes()
    route = routes.get(model)
    if route is None and model in (adapters := adapter_routes(routes)):
        return model_card(*adapters[model])
    if route is None:
        raise ApiError(404, f"the model {model!r} does not exist or no live worker serves or can load it",
                       param="model", code="model_not_found")
    return model_card(route)


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, caller: CallerDep) -> Response:
    return await complete(request, caller, body)


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request, caller: CallerDep) -> Response:
    return await complete(request, caller, body)


@router.post("/embeddings")
async def embeddings(body: EmbeddingsRequest, request: Request, caller: CallerDep) -> Response:
    """One embedding job for all the request's inputs: the worker batches them (and other requests')
    into shared decodes. The job keeps running if the client leaves only when it did not create it."""
    gateway = gateway_of(request)
    job = to_embedding_job(body, idempotency_key=request.headers.get("idempotency-key"), tenant=caller.tenant)
    handle, record = await gateway.submit(job, body.model, "embedding")
    try:
        result = await finished_result(request, gateway, handle, deadline=None, owner_cancels=handle.created,
                                       param=public_param)
    except ClientGone:
        return Response(status_code=499)
    return Response(to_embeddings_response(result, record.model, body.encoding_format).model_dump_json(),
                    media_type="application/json", headers={"X-Slotq-Job-Id": handle.id})


async def complete(request: Request, caller: Caller, body: WireRequest) -> Response:
    gateway = gateway_of(request)
    kind = kind_of(body)
    if body.stream and request.headers.get("last-event-id"):
        return await _resume(request, gateway, caller, body)
    job = to_job_request(body, idempotency_key=request.headers.get("idempotency-key"), tenant=caller.tenant)
    handle, record = await gateway.submit(job, body.model, kind, wire_param(body))
    keep = (body.keep_on_disconnect if body.keep_on_disconnect is not None
            else gateway.settings.gateway_keep_on_disconnect)
    owner_cancels = handle.created and not keep       # only the request that created a job cancels it
    headers = {"X-Slotq-Job-Id": handle.id}
    if body.stream:
        renderer = ChunkRenderer(kind, handle.id, record.model, record.created, n=job.n,
                                 include_usage=body.include_usage, param=wire_param(body))
        return await open_stream(request, gateway, handle.client, handle.id, renderer,
                                 cancel_on_disconnect=owner_cancels, deadline=job.deadline, headers=headers,
                                 first_error=renderer.first_error)
    try:
        result = await finished_result(request, gateway, handle, deadline=job.deadline, owner_cancels=owner_cancels,
                                       param=wire_param(body))
    except ClientGone:
        return Response(status_code=499)
    return Response(to_response(kind, result, record.model, record.created).model_dump_json(),
                    media_type="application/json", headers=headers)


async def resumed_job(request: Request, gateway: Gateway, caller: Caller,
                      body_key: str | None) -> tuple[str, str, SlotqClient, JobRecord | None]:
    """(Last-Event-ID, job id, its queue's client, its record) of the job a streaming request with
    ``Last-Event-ID`` resumes: the one created under the same idempotency key (the body's
    ``body_key`` or the header's). Never creates a job."""
    last_id = request.headers["last-event-id"].strip()
    try:
        parse_stream_id(last_id)
    except ValueError as exc:
        raise ApiError.invalid(f"Last-Event-ID: {exc}", "Last-Event-ID") from None
    key = body_key or request.headers.get("idempotency-key")
    if not key:
        raise ApiError.invalid("Last-Event-ID resumes the job created under the same idempotency key, and this request "
                               "has none: send the original request's idempotency_key "
                               "(or read GET /v1/jobs/{id}/events)",
                               "idempotency_key", code="missing_idempotency_key")
    job_id, client, record = await gateway.find(caller.tenant, key)
    if await client.status(job_id) == JobStatus.NOT_FOUND:
        raise ApiError.job_not_found(key)
    return last_id, job_id, client, record


async def _resume(request: Request, gateway: Gateway, caller: Caller, body: WireRequest) -> Response:
    """``Last-Event-ID`` on a streaming request: continue the stream of the job created under the
    same idempotency key, after that event."""
    last_id, job_id, client, record = await resumed_job(request, gateway, caller, body.idempotency_key)
    renderer = ChunkRenderer(kind_of(body), job_id, record.model if record else body.model,
                             record.created if record else int(time.time()), n=body.n or 1,
                             include_usage=body.include_usage, after=last_id, param=wire_param(body))
    return await open_stream(request, gateway, client, job_id, renderer, cancel_on_disconnect=False,
                             deadline=body.deadline, headers={"X-Slotq-Job-Id": job_id})
