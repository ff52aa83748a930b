"""Prometheus metrics of the gateway (``GET /metrics``), named ``slotq_gateway_*``.

Every label comes from a bounded set, whatever a caller sends: the route is the template of the
route that matched (never the path, which holds job ids), ``static`` or ``unmatched``; the method is
one of HTTP's standard ones or ``other`` (h11 accepts any token as a method, and one request with a
12,000-byte method used to add 24 KB to every scrape for good); the status is a number.

The families with a ``tenant`` label are kept apart (:data:`TENANT_REGISTRY`): a tenant's name and
usage are no business of other tenants, so ``/metrics`` shows them only to the fleet view (an admin
key, the private metrics port, or keyless mode; :mod:`slotq.jobs.gateway.routes_ops`).

They live in registries of their own, and this module imports nothing of the worker's: the worker's
families (``slotq.jobs.worker.metrics``) are defined when that module is imported, and on the default
registry a gateway would export them as constant zeros, which alerts would read as an idle fleet.
"""

from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REGISTRY = CollectorRegistry()
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)
GCCollector(registry=REGISTRY)

TENANT_REGISTRY = CollectorRegistry()

# The request histogram's bucket edges (seconds): from a probe's few milliseconds to a completion
# answered in one piece after minutes of generation. Defined here, not shared with the worker's
# LATENCY_BUCKETS (queue pickup, time to first token), which happen to have the same values today:
# the two measure different spans, no dashboard or alert sets one beside the other, and either may
# change without the other.
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

STANDARD_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})


def method_label(method: str) -> str:
    """The method as a label: one of HTTP's standard methods (RFC 9110, and PATCH), else ``other``."""
    return method if method in STANDARD_METHODS else "other"


def exposition(*, tenants: bool) -> bytes:
    """The text format of the gateway's metrics, with the per-tenant families or without."""
    text = generate_latest(REGISTRY)
    return text + generate_latest(TENANT_REGISTRY) if tenants else text


REQUESTS = Counter("slotq_gateway_requests", "HTTP requests by route, method and status", ["route", "method", "status"],
                   registry=REGISTRY)
REQUEST_SECONDS = Histogram("slotq_gateway_request_duration_seconds", "Request start to the end of the response",
                            ["route"], buckets=REQUEST_BUCKETS, registry=REGISTRY)
STREAMS_ACTIVE = Gauge("slotq_gateway_streams_active", "SSE responses being served now", registry=REGISTRY)
DISCONNECT_CANCELS = Counter("slotq_gateway_disconnect_cancels", "Jobs cancelled because their client disconnected",
                             registry=REGISTRY)
# Per tenant: tenants come from the configured keys, so the label set stays as small as the key list.
TENANT_JOBS = Counter("slotq_gateway_tenant_jobs", "Jobs created through the API, by tenant", ["tenant"],
                      registry=TENANT_REGISTRY)
TENANT_TOKENS = Counter("slotq_gateway_tenant_reserved_tokens",
                        "Tokens the tenant's new jobs reserved (what SLOTQ_TENANT_TOKENS_PER_MIN counts), by tenant",
                        ["tenant"], registry=TENANT_REGISTRY)
QUOTA_REFUSALS = Counter("slotq_gateway_quota_refusals",
                         ("Requests refused with 429 by a tenant's quota, "
                          "by tenant and quota (waiting, in_flight, tokens)"),
                         ["tenant", "quota"], registry=TENANT_REGISTRY)


class MetricsMiddleware:
    """Pure ASGI (no buffering of streamed bodies)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", None) or ("static" if status < 400 else "unmatched")
            REQUESTS.labels(route=route, method=method_label(scope["method"]), status=str(status)).inc()
            REQUEST_SECONDS.labels(route=route).observe(time.perf_counter() - started)
