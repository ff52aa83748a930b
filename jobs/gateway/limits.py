"""What the gateway refuses before any route runs, and before anything reaches Redis.

* :class:`AmbiguousFraming` (pure ASGI, outside every other check): a request with both
  ``Content-Length`` and ``Transfer-Encoding`` is a 400 and its connection is closed (RFC 9112
  §6.3). uvicorn frames such a body by its chunked encoding and keeps the connection open, so a
  proxy in front that trusts ``Content-Length`` would read a different request boundary than the
  gateway does: the bytes it takes for the end of one body are, here, a second request (request
  smuggling). Closing the connection discards whatever was sent after the headers.
* :class:`BodyLimits` (pure ASGI): a body larger than its cap is a 413, decided from
  ``Content-Length`` before a byte of it is read, or as soon as a chunked body passes the cap; a
  body that has not fully arrived within ``gateway_body_timeout_s`` is a 408. Both close the
  connection, so the rest of the body is never read.
* :func:`header_deadline_protocol`: uvicorn bounds the wait *between* requests
  (``timeout_keep_alive``) but not a request whose headers trickle in; this protocol closes a
  connection whose request headers are not complete within ``gateway_header_timeout_s``.
* :class:`KeylessGuard` (pure ASGI, only when no API keys are configured): the gateway then trusts
  every request from loopback, so a web page the user visits must not be able to reach it. Hosts
  other than loopback names and ``gateway_allowed_hosts`` are refused (DNS rebinding), and so is a
  state-changing request from a foreign ``Origin`` (a multipart or form post needs no CORS
  preflight, so the browser would send it).
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

import h11
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from slotq.jobs.gateway.http_errors import response
from slotq.jobs.gateway.settings import LOOPBACK_HOSTS, GatewaySettings
from slotq.jobs.openai.errors import ApiError

log = logging.getLogger(__name__)

MULTIPART_SLACK = 64 * 1024      # a file upload's other form parts and boundaries around the file
FILE_UPLOAD = ("POST", "/v1/files")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
CLOSE = {"Connection": "close"}


class AmbiguousFraming:
    """Refuses a request that declares its body's length twice (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            names = {name.lower() for name, _ in scope["headers"]}
            if b"content-length" in names and b"transfer-encoding" in names:
                error = ApiError(400, "the request has both Content-Length and Transfer-Encoding, which frame its "
                                      "body differently (RFC 9112 section 6.3): send one of them",
                                 code="ambiguous_framing", headers=CLOSE)
                await response(error, scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimits:
    """Caps the size of a request body and the time it may take to arrive."""

    def __init__(self, app: ASGIApp, settings: GatewaySettings) -> None:
        self.app = app
        self.max_body = int(settings.gateway_max_body_mb * (1 << 20))
        self.max_upload = (settings.gateway_max_file_mb << 20) + MULTIPART_SLACK
        self.timeout_s = settings.gateway_body_timeout_s

    def _limit(self, scope: Scope) -> tuple[int, str]:
        if (scope["method"], scope["path"].rstrip("/")) == FILE_UPLOAD:
            return self.max_upload, f"{self.max_upload - MULTIPART_SLACK >> 20} MB (SLOTQ_GATEWAY_MAX_FILE_MB)"
        return self.max_body, f"{self.max_body / (1 << 20):g} MB (SLOTQ_GATEWAY_MAX_BODY_MB)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, shown = self._limit(scope)
        too_large = f"the request body is larger than the limit of {shown}"
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            error = ApiError(413, too_large, code="request_too_large", headers=CLOSE)
            await response(error, scope["path"])(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        received = 0
        body_done = False

        async def bounded_receive() -> Message:
            """The app's receive: bounded while the body arrives, plain after (disconnect waits)."""
            nonlocal received, body_done
            if body_done:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise HTTPException(408, f"the request body did not arrive within {self.timeout_s:g} s "
                                         "(SLOTQ_GATEWAY_BODY_TIMEOUT_S)", headers=CLOSE) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise HTTPException(413, too_large, headers=CLOSE)
                body_done = not message.get("more_body", False)
            return message

        await self.app(scope, bounded_receive, send)


def header_deadline_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline on request headers (pass it as ``http=``)."""

    class HeaderDeadlineProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()                   # the next request on this connection gets its own deadline

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:       # its headers are in
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self._header_timer = self.loop.call_later(timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.info("closing a connection from %s: no complete request headers within %g s "
                         "(SLOTQ_GATEWAY_HEADER_TIMEOUT_S)", self.client, timeout_s)
                self.transport.close()

    return HeaderDeadlineProtocol


def _host_name(host: str) -> str:
    """``example.com:8000`` -> ``example.com``; ``[::1]:8000`` -> ``::1``."""
    return urlsplit(f"//{host}").hostname or ""


class KeylessGuard:
    """Refuses foreign Hosts and cross-origin state-changing requests (see the module docstring)."""

    def __init__(self, app: ASGIApp, settings: GatewaySettings) -> None:
        self.app = app
        self.hosts = LOOPBACK_HOSTS | {h.lower() for h in settings.gateway_allowed_hosts}
        self.origins = frozenset(settings.cors_origins)

    def refusal(self, scope: Scope) -> ApiError | None:
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
        host = headers.get("host", "")
        if _host_name(host) not in self.hosts:
            return ApiError(400, f"Host {host!r} is not served: without API keys the gateway answers only to "
                                 "loopback names and SLOTQ_GATEWAY_ALLOWED_HOSTS", param="Host", code="invalid_host")
        if scope["method"] in SAFE_METHODS:
            return None
        origin = headers.get("origin")
        same_origin = origin is not None and urlsplit(origin).netloc == host
        # no '*' here: settings refuse SLOTQ_CORS_ORIGINS=* without keys (GatewaySettings)
        foreign = (origin is not None and not same_origin and origin not in self.origins
                   or origin is None and headers.get("sec-fetch-site") == "cross-site")
        if foreign:
            return ApiError(403, f"a {scope['method']} from origin {origin or '(cross-site)'} is refused: without API "
                                 "keys only the gateway's own pages and SLOTQ_CORS_ORIGINS may change anything",
                            type="permission_error", param="Origin", code="cross_origin_refused")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = self.refusal(scope) if scope["type"] == "http" else None
        if error is None:
            await self.app(scope, receive, send)
        else:
            await response(error, scope["path"])(scope, receive, send)
