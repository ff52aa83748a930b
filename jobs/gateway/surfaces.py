"""What the gateway shows beyond its API, and to whom.

* :class:`PrivatePort` (pure ASGI): the optional metrics port (``SLOTQ_GATEWAY_METRICS_PORT``)
  serves ``/metrics``, ``/health`` and ``/ready`` in full with no key and nothing else; it is meant
  for Prometheus inside the cluster and must never be published (see docs/gateway.md, Security).
* :class:`SecurityHeaders` (pure ASGI, around the dashboard's static files): a Content-Security-
  Policy that lets the page load and call only its own origin and run no inline script, no MIME
  sniffing, and no framing (clickjacking of the requeue button, or of a key typed into the page).
* :class:`AccessLogRedaction`: uvicorn's access log records the request target; a key sent in the
  query string (``?api_key=``, as some clients do) would sit in the log. Only the API's own query
  parameters are kept, and only with a value of the shape the API takes (else ``name=***``); a
  parameter that usually carries a credential keeps its name but not its value, and any other is
  written as ``***`` whole (its name could be the key itself).
"""

from __future__ import annotations

import logging
import re
from urllib.parse import parse_qsl, quote

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from slotq.jobs.gateway.http_errors import response
from slotq.jobs.openai.errors import ApiError

PRIVATE_PATHS = frozenset({"/metrics", "/health", "/ready"})

# What the dashboard needs: its own scripts, styles, and fetch() to its own origin. SVG charts are
# built with DOM calls, and bar widths are set through the CSSOM, which style-src does not govern.
DASHBOARD_HEADERS = [
    (b"content-security-policy", (b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                  b"connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
]

# Query parameters of the API whose values say nothing secret (ids, paging), with the shape such a
# value has: kept in the access log only when it has it (``after=sk-...`` or ``limit=5;key=...`` is a
# value the API never takes, so it could be anything, a key included).
LOGGED_QUERY_PARAMS = {
    "after": re.compile(r"(?:file-|batch_)[0-9A-Za-z_-]{1,100}|\d{1,20}-\d{1,20}"),  # a file, batch or stream id
    "limit": re.compile(r"\d{1,6}"),
    "order": re.compile(r"asc|desc"),
    "purpose": re.compile(r"[a-z_-]{1,32}"),
}
# Names that clients use to send a key in a URL: logged as name=*** (that one was sent is worth knowing).
CREDENTIAL_QUERY_PARAMS = frozenset({"api_key", "api-key", "apikey", "key", "token", "access_token", "auth"})


def on_private_port(scope: Scope, metrics_port: int) -> bool:
    """Whether the request came in on the private metrics port (the socket it arrived on, which a
    caller cannot choose the way it chooses a Host header)."""
    server = scope.get("server")
    return bool(metrics_port) and server is not None and server[1] == metrics_port


class PrivatePort:
    """On the metrics port, only the operations paths; anything else is a 404 there."""

    def __init__(self, app: ASGIApp, metrics_port: int) -> None:
        self.app = app
        self.metrics_port = metrics_port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and on_private_port(scope, self.metrics_port)
                and scope["path"] not in PRIVATE_PATHS):
            error = ApiError(404, f"the metrics port serves {', '.join(sorted(PRIVATE_PATHS))} only",
                             code="not_found")
            await response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class SecurityHeaders:
    """Adds :data:`DASHBOARD_HEADERS` to every response of the wrapped app."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *DASHBOARD_HEADERS]
            await send(message)

        await self.app(scope, receive, with_headers)


def _logged(name: str, value: str) -> str:
    shape = LOGGED_QUERY_PARAMS.get(name)
    if shape is not None:
        return f"{name}={quote(value, safe='')}" if shape.fullmatch(value) else f"{name}=***"
    return f"{name}=***" if name.lower() in CREDENTIAL_QUERY_PARAMS else "***"


def redact_target(target: str) -> str:
    """``/v1/files?limit=5&api_key=sk-1&sk-2`` -> ``/v1/files?limit=5&api_key=***&***``."""
    path, sep, query = target.partition("?")
    if not sep:
        return target
    shown = [_logged(name, value) for name, value in parse_qsl(query, keep_blank_values=True)]
    return f"{path}?{'&'.join(shown)}" if shown else path


class AccessLogRedaction(logging.Filter):
    """On uvicorn's ``uvicorn.access`` logger, whose records carry (client, method, target, http
    version, status) as arguments."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str):
            record.args = (args[0], args[1], redact_target(args[2]), args[3], args[4])
        return True
