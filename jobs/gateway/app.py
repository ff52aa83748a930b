"""The gateway's ASGI app: OpenAI's API (Batch and Responses APIs and webhooks included), Anthropic's Messages API,
background jobs, health, metrics and the dashboard.

No interactive API docs page: FastAPI's loads Swagger UI from a CDN, which an offline deployment
cannot reach. ``/openapi.json`` describes the API for any OpenAPI viewer or client generator.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.staticfiles import StaticFiles
from starlette.routing import Match, Mount
from starlette.types import Scope

from slotq.jobs.gateway import (
    http_errors,
    routes_anthropic,
    routes_batches,
    routes_files,
    routes_jobs,
    routes_openai,
    routes_ops,
    routes_rerank,
    routes_responses,
    routes_webhooks,
)
from slotq.jobs.gateway.auth import KeyRing
from slotq.jobs.gateway.batch_driver import BatchDriver
from slotq.jobs.gateway.batches import BatchStore
from slotq.jobs.gateway.files import FileStore
from slotq.jobs.gateway.history import FleetHistory
from slotq.jobs.gateway.limits import AmbiguousFraming, BodyLimits, KeylessGuard
from slotq.jobs.gateway.metrics import MetricsMiddleware
from slotq.jobs.gateway.response_watch import ResponseWatcher
from slotq.jobs.gateway.service import Gateway
from slotq.jobs.gateway.settings import GatewaySettings
from slotq.jobs.gateway.shards import ShardsView
from slotq.jobs.gateway.surfaces import PrivatePort, SecurityHeaders
from slotq.jobs.gateway.webhook_delivery import WebhookSender
from slotq.jobs.gateway.webhooks import WebhookStore
from slotq.jobs.producer.client import SlotqClient

STATIC_DIR = Path(__file__).parent / "static"
API_PREFIXES = ("/v1/", "/api/")


class Dashboard(Mount):
    """The dashboard's files at ``/``, leaving the API's paths to the router: a wrong method on an
    API route is its 405, and an unknown API path a JSON 404, not a missing file."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope.get("path", "").startswith(API_PREFIXES):
            return Match.NONE, {}
        return super().matches(scope)


def create_app(settings: GatewaySettings, redis_url: str) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.gateway = gateway = Gateway(await SlotqClient.connect(redis_url, settings), settings)
        app.state.files = files = FileStore(
            gateway.client.redis, settings.files_dir, max_bytes=settings.gateway_max_file_mb << 20,
            tenant_max_files=settings.gateway_tenant_max_files,
            tenant_max_bytes=settings.gateway_tenant_max_files_mb << 20,
            default_expiry_s=settings.gateway_file_expiry_s)
        app.state.batches = batches = BatchStore(gateway.client.redis, lease_s=settings.gateway_batch_lease_s)
        app.state.batch_driver = driver = BatchDriver(gateway, batches, files)
        driver.start()
        files.start(in_use=batches.active_input_ids)
        app.state.history = history = FleetHistory(gateway)
        history.start()
        app.state.shards = ShardsView(gateway)
        app.state.webhooks = WebhookStore(gateway.client.redis, allow_private=settings.gateway_webhook_allow_private,
                                          tenant_max_endpoints=settings.gateway_webhook_tenant_max_endpoints)
        app.state.webhook_sender = sender = WebhookSender(gateway.client.redis, settings)
        sender.start()
        app.state.response_watcher = watcher = ResponseWatcher(gateway)
        watcher.start()
        try:
            yield
        finally:
            await watcher.close()
            await sender.close()
            await history.close()
            await files.close()
            await driver.close()
            await gateway.close()

    app = FastAPI(title="slotq gateway", summary="OpenAI-compatible API on a durable llama.cpp job queue",
                  lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.settings = settings
    app.state.keys = KeyRing(settings)
    http_errors.install(app)
    for router in (routes_openai.router, routes_rerank.router, routes_responses.router, routes_anthropic.router,
                   routes_jobs.router, routes_files.router, routes_batches.router, routes_webhooks.router,
                   routes_webhooks.event_types, routes_ops.router, routes_ops.api):
        app.include_router(router)
    app.router.routes.append(Dashboard("/", SecurityHeaders(StaticFiles(directory=STATIC_DIR, html=True)),
                                       name="dashboard"))
    # Starlette runs the middleware added last first: metrics see every answer; ambiguous framing is
    # refused before anything else can answer and leave the connection open.
    app.add_middleware(BodyLimits, settings=settings)
    if not settings.has_keys:
        app.add_middleware(KeylessGuard, settings=settings)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Slotq-Job-Id", "Retry-After"])
    if settings.gateway_metrics_port:
        app.add_middleware(PrivatePort, metrics_port=settings.gateway_metrics_port)
    app.add_middleware(AmbiguousFraming)
    app.add_middleware(MetricsMiddleware)
    return app
