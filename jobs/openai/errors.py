"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the gateway reports goes through :class:`ApiError`, so clients written for the
OpenAI API (the official SDKs map the HTTP status to an exception class) see what they expect.
OpenAI Batch lines report a refused body with the same error (:mod:`slotq.jobs.bulk.openai_batch`),
so this module imports no web framework: the HTTP side is :mod:`slotq.jobs.gateway.http_errors`, and
the errors of a stream served over SSE are :mod:`slotq.jobs.gateway.sse`'s.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from slotq.jobs.errors import JobRejected
from slotq.jobs.protocol.wire import ErrorInfo

# Job error codes (engine and job layer) that mean "the request itself is bad": HTTP 400.
BAD_REQUEST_CODES = frozenset({"invalid_request", "prompt_too_long", "invalid_grammar", "invalid_payload"})
# The request parameter that sets a JobRequest field, where the names differ ("sampling.top_k" -> "top_k").
_PUBLIC_NAMES = {"sampling.penalty_last_n": "repeat_last_n", "resume_tokens": None, "inputs": "input"}
# What enqueue refused (JobRejected.field) -> OpenAI's code for it.
_REJECTION_CODES = {"max_tokens": "context_length_exceeded", "prompt": "prompt_too_long", "messages": "prompt_too_long",
                    "inputs": "context_length_exceeded", "model": "wrong_model_kind"}


def public_param(field: str | None) -> str | None:
    """A job layer field name as a request names it: ``sampling.json_schema`` is ``json_schema``."""
    if field is None:
        return None
    if field in _PUBLIC_NAMES:
        return _PUBLIC_NAMES[field]
    return field.removeprefix("sampling.")


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    # ------------------------------------------------------------------ the common cases
    @classmethod
    def invalid(cls, message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
        return cls(400, message, param=param, code=code)

    @classmethod
    def job_not_found(cls, job_id: str) -> ApiError:
        return cls(404, f"no job {job_id!r} (never created, or its result expired)", param="job_id",
                   code="job_not_found")

    @classmethod
    def deadline(cls, message: str) -> ApiError:
        return cls(504, message, type="timeout", code="deadline_exceeded")

    @classmethod
    def from_job_error(cls, error: ErrorInfo | None, job_id: str,
                       param: Callable[[str | None], str | None] = public_param) -> ApiError:
        """A job that ended with an error: the request's fault (400, ``param`` naming the field as
        the request did), its deadline (504), or ours (500)."""
        if error is None:
            return cls(500, f"job {job_id} failed", type="server_error", code="job_failed")
        if error.code in BAD_REQUEST_CODES:
            name = param(error.field)
            message = error.message
            if error.field and name and message.startswith(f"{error.field}:"):
                message = name + message[len(error.field):]
            return cls(400, message, param=name, code=error.code)
        if error.code == "expired":
            return cls.deadline(f"job {job_id}: {error.message}")
        return cls(500, f"job {job_id} failed: {error.message}", type="server_error", code=error.code)

    @classmethod
    def from_rejection(cls, exc: JobRejected, param: Callable[[str | None], str | None] = public_param) -> ApiError:
        """A request enqueue refused (e.g. ``max_tokens`` beyond every worker's context): a 400 naming
        the parameter as the request did, in the message too (a message that starts with the job
        layer's field name, as the engine's checks write them, starts with the request's name)."""
        message, public = str(exc), param(exc.field)
        if public and message.startswith(f"{exc.field}: "):
            message = f"{public}{message[len(exc.field):]}"
        return cls.invalid(message, public, code=_REJECTION_CODES.get(exc.field, "invalid_value"))


def param_path(loc: Sequence[str | int]) -> str | None:
    """pydantic's error location as an OpenAI ``param``: ``messages[0].content``."""
    out = ""
    for part in loc:
        if part == "[key]":              # pydantic's marker for a bad dict key; the key itself precedes it
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


class ValidationFailure(Protocol):
    """pydantic's ``ValidationError`` or FastAPI's ``RequestValidationError``: what failed, where."""

    def errors(self) -> Sequence[Any]: ...


_LEADING_FIELD = re.compile(r"^([a-z_]+(?:\[\d+\])?(?:\.[a-z_]+(?:\[\d+\])?)*): ")   # tools, messages[3].tool_call_id


def from_validation(exc: ValidationFailure,
                    rename: Callable[[tuple[str | int, ...]], tuple[str | int, ...]] = lambda loc: loc) -> ApiError:
    """The first validation error as a 400 naming the parameter and the limit. ``rename`` maps a
    location in the model that failed (e.g. slotq's JobRequest) to the request's own names."""
    err = exc.errors()[0]
    loc = tuple(err["loc"])
    if loc and loc[0] == "body":             # FastAPI prefixes the request body
        loc = loc[1:]
    param = param_path(rename(loc))
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        return ApiError.invalid(f"{param}: not supported by slotq", param, code="unsupported_parameter")
    if err["type"] == "missing":
        return ApiError.invalid(f"{param}: required", param, code="missing_required_parameter")
    value = err.get("input")
    shown = f" (got {value!r})" if isinstance(value, int | float | bool | str) and len(repr(value)) < 80 else ""
    if not param:           # a rule across fields names the one at fault first ("tool_choice: ...")
        named = _LEADING_FIELD.match(msg)
        return ApiError.invalid(f"{msg}{shown}", named[1] if named else None)
    return ApiError.invalid(f"{param}: {msg}{shown}", param)
