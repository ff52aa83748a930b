"""``slotq gateway``: check the binding rules, find Redis, run uvicorn."""

from __future__ import annotations

import logging

import uvicorn

from slotq.jobs.cli.redis_server import port_is_serving
from slotq.jobs.gateway.app import create_app
from slotq.jobs.gateway.limits import header_deadline_protocol
from slotq.jobs.gateway.settings import GatewaySettings

log = logging.getLogger("slotq.gateway")


def redis_url_for(settings: GatewaySettings) -> str:
    """The configured Redis, or the embedded one that `slotq redis` / `slotq worker` started. A
    gateway never starts a Redis of its own: it would be a queue no worker reads."""
    if settings.redis_url:
        return settings.redis_url
    if not port_is_serving(settings.embedded_redis_port):
        raise SystemExit(f"no Redis: set SLOTQ_REDIS_URL, or start one with `slotq redis` or `slotq worker` "
                         f"(embedded, port {settings.embedded_redis_port})")
    return f"redis://127.0.0.1:{settings.embedded_redis_port}/0"


def serve(settings: GatewaySettings) -> None:
    host, port = settings.gateway_host, settings.gateway_port
    refusal = settings.bind_error(host)
    if refusal:
        raise SystemExit(refusal)
    if not settings.has_keys:
        log.warning("no API keys configured (SLOTQ_API_KEYS): every request is let in, so the gateway serves %s only",
                    host)
    url = redis_url_for(settings)
    log.info("slotq gateway on http://%s:%d (dashboard at /, OpenAI API at /v1)", host, port)
    uvicorn.run(create_app(settings, url), host=host, port=port, log_level=settings.log_level.lower(),
                timeout_graceful_shutdown=5, http=header_deadline_protocol(settings.gateway_header_timeout_s))
