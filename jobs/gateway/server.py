"""``slotq gateway``: check the binding rules, find Redis, run uvicorn (on the API's port, and on
the private metrics port when SLOTQ_GATEWAY_METRICS_PORT is set: one server, one app, two sockets;
the app tells them apart by the socket a request came in on)."""

from __future__ import annotations

import contextlib
import logging
import socket

import uvicorn

from slotq.jobs.gateway.app import create_app
from slotq.jobs.gateway.limits import header_deadline_protocol
from slotq.jobs.gateway.settings import GatewaySettings
from slotq.jobs.gateway.surfaces import AccessLogRedaction
from slotq.jobs.redis_server import running_embedded_url

log = logging.getLogger("slotq.gateway")


def redis_url_for(settings: GatewaySettings) -> str:
    """The configured Redis, or the embedded one that `slotq redis` / `slotq worker` started (waited for
    a while: `slotq worker &` may still be starting it). A gateway never starts a Redis of its own: it
    would be a queue no worker reads."""
    return settings.redis_url or running_embedded_url(settings.embedded_redis_port)


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket as uvicorn binds one (it is passed to uvicorn with the API's own)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"cannot listen on {host}:{port} (SLOTQ_GATEWAY_METRICS_PORT): {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def serve(settings: GatewaySettings) -> None:
    host, port, metrics_port = settings.gateway_host, settings.gateway_port, settings.gateway_metrics_port
    refusal = settings.bind_error(host)
    if refusal:
        raise SystemExit(refusal)
    if not settings.has_keys:
        log.warning("no API keys configured (SLOTQ_API_KEYS): every request is let in, so the gateway serves %s only",
                    host)
    url = redis_url_for(settings)
    protocol = header_deadline_protocol(settings.gateway_header_timeout_s)
    config = uvicorn.Config(create_app(settings, url), host=host, port=port, log_level=settings.log_level.lower(),
                            timeout_graceful_shutdown=5, http=protocol)
    logging.getLogger("uvicorn.access").addFilter(AccessLogRedaction())     # after Config set uvicorn's logging up
    sockets = [config.bind_socket()]
    log.info("slotq gateway on http://%s:%d (dashboard at /, OpenAI API at /v1)", host, port)
    if metrics_port:
        sockets.append(_bind(host, metrics_port))
        log.info("private metrics port http://%s:%d: /metrics with every tenant, /health, /ready, no key "
                 "(SLOTQ_GATEWAY_METRICS_PORT; never publish it)", host, metrics_port)
    server = uvicorn.Server(config)
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=sockets)
    if not server.started:
        raise SystemExit("the gateway did not start (the errors above say why)")
