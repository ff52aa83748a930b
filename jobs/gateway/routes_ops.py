"""Operations: ``/health`` and ``/metrics`` (open, for probes and scrapers) and the small JSON
API behind the dashboard (``/api/...``: every tenant's queues, workers and dead letters, so for
admin keys only; without keys, for every loopback caller)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from slotq.jobs.gateway import metrics as gateway_metrics
from slotq.jobs.gateway.auth import require_admin
from slotq.jobs.gateway.errors import ApiError
from slotq.jobs.gateway.routes_openai import gateway_of
from slotq.jobs.protocol import dead_letters

HEALTH_TIMEOUT_S = 2.0     # the client retries Redis for ~30 s; a probe wants an answer now

router = APIRouter()
api = APIRouter(prefix="/api", dependencies=[Depends(require_admin)])


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 when Redis answers (with the live workers per model), 503 when it does not."""
    gateway = gateway_of(request)
    try:
        async with asyncio.timeout(HEALTH_TIMEOUT_S):
            await gateway.client.redis.ping()
            routes = await gateway.router.routes()
    except Exception as exc:  # any failure to reach Redis is "unavailable"
        return JSONResponse({"status": "unavailable", "redis": f"{type(exc).__name__}: {exc}", "models": {}},
                            status_code=503)
    models = {m: {"queue": r.queue, "workers": len(r.workers), "slots_busy": r.slots_busy, "slots_total": r.slots_total}
              for m, r in sorted(routes.items())}
    return JSONResponse({"status": "ok", "redis": "ok", "models": models})


@router.get("/metrics")
async def metrics() -> Response:
    """The gateway's own metrics; each worker serves its own (SLOTQ_METRICS_PORT)."""
    return Response(generate_latest(gateway_metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)


@api.get("/fleet")
async def fleet(request: Request) -> dict[str, Any]:
    """Every live worker and, per queue, depth and oldest wait: what the dashboard polls."""
    gateway = gateway_of(request)
    workers = await gateway.client.workers()
    names = sorted({w.queue for w in workers} | {gateway.settings.queue_name})
    infos = await asyncio.gather(*(gateway.queue(name).queue_info() for name in names))
    queues = [i.model_dump(mode="json", exclude={"workers"}) | {"models": sorted({w.model for w in i.workers}),
                                                                "workers": len(i.workers)} for i in infos]
    return {"time": time.time(), "queues": queues, "workers": [w.model_dump() for w in workers],
            "dead_letters": await dead_letters.count(gateway.client.redis)}


@api.get("/history")
async def history(request: Request) -> dict[str, Any]:
    """The last 15 minutes per lane (tokens/s, waiting, running, preemptions) and the waiting jobs
    per tenant, for the dashboard's charts (:mod:`slotq.jobs.gateway.history`)."""
    return request.app.state.history.snapshot()


@api.get("/dead-letters")
async def list_dead_letters(request: Request, limit: int = 100) -> dict[str, Any]:
    redis = gateway_of(request).client.redis
    letters = [await dead_letters.get(redis, job_id) for job_id in await dead_letters.list_ids(redis, limit)]
    return {"data": [letter.model_dump(mode="json", exclude={"payload"}) for letter in letters if letter]}


@api.post("/dead-letters/{job_id}/requeue")
async def requeue_dead_letter(job_id: str, request: Request) -> dict[str, Any]:
    """Run the job again under the same id, on the queue the gateway enqueued it on."""
    gateway = gateway_of(request)
    if await dead_letters.get(gateway.client.redis, job_id) is None:
        raise ApiError(404, f"no dead letter {job_id!r}", param="job_id", code="dead_letter_not_found")
    client, _record = await gateway.locate(job_id)
    return {"id": job_id, "requeued": await client.requeue_dead_letter(job_id)}
