"""Errors in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``.

The gateway raises one error type everywhere (:class:`~slotq.jobs.openai.errors.ApiError`); on the
Messages API's paths it is written in Anthropic's shape, its ``type`` chosen by the HTTP status as
Anthropic's API does, so the ``anthropic`` SDK raises the exception class it would raise there
(``BadRequestError``, ``AuthenticationError``, ``RateLimitError``, ...). The parameter at fault is
named in the message (``max_tokens: required``), as Anthropic's body has no ``param`` field.
"""

from __future__ import annotations

from typing import Any

from slotq.jobs.openai.errors import ApiError

MESSAGES_PATH = "/v1/messages"        # this path and those under it answer in Anthropic's shape

# HTTP status -> Anthropic's error type; any other status >= 500 is an ``api_error``, below it an
# ``invalid_request_error``.
ERROR_TYPES = {401: "authentication_error", 402: "billing_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error",
               529: "overloaded_error"}


def speaks_anthropic(path: str) -> bool:
    """Whether a request to ``path`` is answered in Anthropic's shapes (errors included)."""
    return path == MESSAGES_PATH or path.startswith(f"{MESSAGES_PATH}/")


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_body(error: ApiError) -> dict[str, Any]:
    """``error`` as Anthropic writes it; slotq's own ``code`` stays alongside (the SDK keeps the body)."""
    return {"type": "error", "error": {"type": error_type(error.status), "message": error.message,
                                       "code": error.code}}
