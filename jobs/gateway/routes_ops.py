"""Operations: ``/health``, ``/ready`` and ``/metrics`` (open, for probes and scrapers) and the small
JSON API behind the dashboard (``/api/...``: every tenant's queues, workers and dead letters, so for
admin keys only; without keys, for every loopback caller).

What the open endpoints show depends on who asks (:func:`sees_fleet`): to anyone, whether the
gateway can serve and the gateway's own request metrics; to the fleet view (an admin key, the
private metrics port, or keyless mode), also the models, workers and busy slots in ``/health`` and
the per-tenant families in ``/metrics``. A tenant never learns another tenant's name or usage, nor
the fleet's size, from a probe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from slotq.jobs.gateway import metrics as gateway_metrics
from slotq.jobs.gateway.auth import KeyRing, authenticate, require_admin
from slotq.jobs.gateway.history import FleetHistory
from slotq.jobs.gateway.routes_openai import gateway_of
from slotq.jobs.gateway.routing import ModelRoute
from slotq.jobs.gateway.shards import ShardsView
from slotq.jobs.gateway.surfaces import on_private_port
from slotq.jobs.gateway.webhooks import WebhookStore
from slotq.jobs.openai.errors import ApiError
from slotq.jobs.protocol import dead_letters

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0     # the client retries Redis for ~30 s; a probe wants an answer now

router = APIRouter()
api = APIRouter(prefix="/api", dependencies=[Depends(require_admin)])


async def sees_fleet(request: Request) -> bool:
    """Whether this request gets the fleet view: on the private metrics port, without keys
    configured (every caller is on loopback and sees ``/api`` anyway), or with an admin key. No
    ``Authorization`` header is the public view; a key that is not an admin's is refused (401, 403)
    rather than quietly shown less, so a scraper with a wrong key is noticed."""
    if on_private_port(request.scope, request.app.state.settings.gateway_metrics_port):
        return True
    keys: KeyRing = request.app.state.keys
    if not keys.required:
        return True
    if "authorization" not in request.headers:
        return False
    await require_admin(await authenticate(request))
    return True


async def _redis_answers(request: Request) -> Exception | None:
    """None when Redis answers a PING within HEALTH_TIMEOUT_S, else why not: logged here, and shown
    to the fleet view only (it names Redis' host)."""
    try:
        async with asyncio.timeout(HEALTH_TIMEOUT_S):
            await gateway_of(request).client.redis.ping()
    except Exception as exc:  # any failure to reach Redis is "unavailable"
        log.warning("%s: Redis unavailable (%s: %s)", request.url.path, type(exc).__name__, exc)
        return exc
    return None


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 ``{"status": "ok"}`` when Redis answers, 503 ``unavailable`` when it does not; the fleet
    view adds the live workers per model, or Redis' error."""
    fleet = await sees_fleet(request)
    failure = await _redis_answers(request)
    routes: dict[str, ModelRoute] = {}
    if failure is None and fleet:
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):
                routes = await gateway_of(request).router.routes()
        except Exception as exc:  # as for the PING
            log.warning("/health: the workers' heartbeats could not be read (%s: %s)", type(exc).__name__, exc)
            failure = exc
    if failure is not None:
        body: dict[str, Any] = {"status": "unavailable"}
        if fleet:
            body |= {"redis": f"{type(failure).__name__}: {failure}", "models": {}}
        return JSONResponse(body, status_code=503)
    if not fleet:
        return JSONResponse({"status": "ok"})
    models = {m: {"queue": r.queue, "workers": len(r.workers), "slots_busy": r.slots_busy, "slots_total": r.slots_total}
              for m, r in sorted(routes.items())}
    return JSONResponse({"status": "ok", "redis": "ok", "models": models})


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """Kubernetes' readinessProbe, as the worker's ``/ready``: 200 while Redis answers and the
    gateway's background tasks (batch driver, file sweep, webhook sender, response watcher) run; 503 with
    the state otherwise.
    (uvicorn serves nothing before the lifespan has started them, as a worker answers nothing
    ready before its warm-up.) A Redis outage takes replicas out of the load balancer; it never
    restarts them (liveness is a TCP check)."""
    state = request.app.state
    if await _redis_answers(request) is not None:
        ok, detail = False, "redis_unavailable"
    elif stopped := [name for name, task in (("batch_driver", state.batch_driver), ("file_sweep", state.files),
                                             ("webhook_sender", state.webhook_sender),
                                             ("response_watcher", state.response_watcher)) if not task.running]:
        ok, detail = False, f"{stopped[0]}_stopped"
    else:
        ok, detail = True, "ready"
    return JSONResponse({"ok": ok, "state": detail}, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """The gateway's own metrics; each worker serves its own (SLOTQ_METRICS_PORT). The per-tenant
    families are for the fleet view only."""
    return Response(gateway_metrics.exposition(tenants=await sees_fleet(request)), media_type=CONTENT_TYPE_LATEST)


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


@api.get("/shards")
async def shards(request: Request) -> dict[str, Any]:
    """On a Redis Cluster, each primary and its share of the gateway's queue (``slotq status``' shard table):
    what the dashboard's Shards section polls. ``clustered: false`` and no shards on one Redis. Read at most
    once per few seconds per gateway process, however many dashboards ask (:mod:`slotq.jobs.gateway.shards`)."""
    view: ShardsView = request.app.state.shards
    return await view.answer()


@api.get("/history")
async def history(request: Request) -> dict[str, Any]:
    """The last 15 minutes per lane (tokens/s, waiting, running, preemptions) and the waiting jobs
    per tenant, for the dashboard's charts (:mod:`slotq.jobs.gateway.history`)."""
    fleet_history: FleetHistory = request.app.state.history
    return fleet_history.snapshot()


@api.get("/dead-letters")
async def list_dead_letters(request: Request, limit: int = 100) -> dict[str, Any]:
    redis = gateway_of(request).client.redis
    letters = [await dead_letters.get(redis, job_id) for job_id in await dead_letters.list_ids(redis, limit)]
    return {"data": [letter.model_dump(mode="json", exclude={"payload"}) for letter in letters if letter]}


@api.get("/webhook-attempts")
async def list_webhook_attempts(request: Request, limit: Annotated[int, Query(ge=1, le=100)] = 50) -> dict[str, Any]:
    """Every tenant's most recent webhook delivery attempts, newest first."""
    webhooks: WebhookStore = request.app.state.webhooks
    return {"data": [attempt.model_dump(mode="json") for attempt in await webhooks.fleet_attempts(limit)]}


@api.post("/dead-letters/{job_id}/requeue")
async def requeue_dead_letter(job_id: str, request: Request) -> dict[str, Any]:
    """Run the job again under the same id, on the queue the gateway enqueued it on."""
    gateway = gateway_of(request)
    if await dead_letters.get(gateway.client.redis, job_id) is None:
        raise ApiError(404, f"no dead letter {job_id!r}", param="job_id", code="dead_letter_not_found")
    client, _record = await gateway.locate(job_id)
    return {"id": job_id, "requeued": await client.requeue_dead_letter(job_id)}
