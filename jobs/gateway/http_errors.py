"""Errors as HTTP responses: an :class:`~slotq.jobs.openai.errors.ApiError` as JSON, and FastAPI's
own errors (bad JSON, 404, 405, body limits) and Redis outages in the same OpenAI shape, or in
Anthropic's on the Messages API's paths (:mod:`slotq.jobs.anthropic.errors`).

Kept apart from :mod:`slotq.jobs.openai.errors` so that the error type, which OpenAI Batch lines
(``slotq bulk``) share, does not import the web stack.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException

from slotq.jobs.anthropic.errors import anthropic_body, speaks_anthropic
from slotq.jobs.errors import RedisUnavailable
from slotq.jobs.openai.errors import ApiError, from_validation

log = logging.getLogger(__name__)

# FastAPI's own HTTP errors (routing, body limits) -> OpenAI-style codes.
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout", 413: "request_too_large"}


def response(error: ApiError, path: str = "") -> JSONResponse:
    """``error`` as the API at ``path`` writes errors: Anthropic's shape on the Messages API, OpenAI's elsewhere."""
    body = anthropic_body(error) if speaks_anthropic(path) else error.body()
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def unknown_route(request: Request) -> str:
    """A 404's message for a path no route serves: the path, and the paths that are served (the
    routes without parameters, the rest lies under them), so a client with a wrong base URL or an
    API this gateway does not speak sees which."""
    served = sorted(path for path in request.app.openapi()["paths"] if "{" not in path)   # cached by FastAPI
    return (f"{request.method} {request.url.path}: no such route. This gateway serves "
            f"{', '.join(served)} (and what lies under them), and its dashboard at /")


def install(app: FastAPI) -> None:
    """Every error response in its API's shape, FastAPI's own (bad JSON, 404, 405) included."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {}
        if err.get("type") == "json_invalid":
            return response(ApiError.invalid(f"the request body is not valid JSON: {err.get('msg')}", None,
                                             code="invalid_json"), request.url.path)
        return response(from_validation(exc), request.url.path)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":     # the router's own: no route has this path
            message = unknown_route(request)
        return response(ApiError(exc.status_code, message, code=_HTTP_CODES.get(exc.status_code),
                                 headers=dict(exc.headers or {})), request.url.path)

    @app.exception_handler(RedisError)
    @app.exception_handler(RedisUnavailable)
    async def _redis_down(request: Request, exc: Exception) -> JSONResponse:
        """Redis out of reach beyond the client's retries: come back later, as /health says. The
        cause names Redis' host and port (and a URL may hold its password): logged, never sent."""
        log.warning("%s %s: Redis unavailable (%s: %s)", request.method, request.url.path, type(exc).__name__, exc)
        return response(ApiError(503, "the queue's Redis is unavailable; retry later",
                                 type="server_error", code="redis_unavailable",
                                 headers={"Retry-After": str(request.app.state.settings.gateway_retry_after_s)}),
                        request.url.path)
