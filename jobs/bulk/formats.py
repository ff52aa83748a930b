"""One line of a bulk input: what it asks for, and what its output and error records look like.

A line is either

* a **slotq request**: a :class:`~slotq.jobs.protocol.schemas.JobRequest` as JSON (``prompt`` or ``messages``,
  ``max_tokens``, ``sampling``, ...), or an :class:`~slotq.jobs.protocol.schemas.EmbeddingJobRequest`
  (``inputs``: texts or token arrays, ``truncate``) for an embedding model's queue, or a
  :class:`~slotq.jobs.protocol.schemas.RerankJobRequest` (``query``, ``documents``) for a reranker's, plus an optional
  ``id`` (string or integer) that its output carries; without one, the output carries the line
  number; or
* an **OpenAI Batch API line**: ``{"custom_id", "method": "POST", "url", "body"}``
  (:mod:`slotq.jobs.bulk.openai_batch`), whose body is read as the gateway reads it.

Output follows each line's format: a slotq line gives ``{"id", "line", "job_id", "status", "text",
"finish_reason", "usage", "timings", "worker", "attempts", "metadata"}`` (plus ``choices`` when
``n > 1``; an embedding line's ``embeddings``, one little-endian float32 vector in base64 per
input, and ``dimensions``; a rerank line's ``scores``, one per document in document order); an OpenAI
line gives OpenAI's batch output object. Every error record carries ``line``; an OpenAI line that the
endpoint would refuse (a bad body, or refused at enqueue) carries the gateway's HTTP answer in ``response``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import ValidationError

from slotq.jobs.bulk import openai_batch
from slotq.jobs.bulk.openai_batch import KEY_SET_BY_BULK, Endpoint
from slotq.jobs.errors import JobRejected
from slotq.jobs.openai.errors import ApiError, public_param
from slotq.jobs.openai.translate import finish_reason, wire_param
from slotq.jobs.openai.wire import EmbeddingsRequest
from slotq.jobs.protocol.schemas import (
    AnyJobRequest,
    EmbeddingJobRequest,
    JobRequest,
    JobResult,
    JobStatus,
    RerankJobRequest,
)
from slotq.jobs.protocol.wire import ErrorInfo


class LineFormat(StrEnum):
    SLOTQ = "slotq"
    OPENAI = "openai"


@dataclass
class BulkLine:
    """A line ready to enqueue."""

    number: int
    format: LineFormat
    key: str                          # what the output carries: custom_id, the line's id, or its number
    request: AnyJobRequest
    endpoint: Endpoint | None = None  # OpenAI lines
    model: str = ""                   # OpenAI lines: the body's model, echoed in the response
    own_key: bool = True              # False when the key is the line number (the line gave no id)
    param: Callable[[str | None], str | None] = public_param   # a job field as the line's body named it
    encoding_format: str = "float"    # OpenAI embedding lines: how their vectors are written


class LineError(Exception):
    """A line that cannot become a job; the run records it and carries on. ``response``: for an
    OpenAI line, the HTTP error the gateway answers to the same body (its record carries it)."""

    def __init__(self, code: str, message: str, *, format: LineFormat = LineFormat.SLOTQ,
                 key: str | None = None, response: ApiError | None = None) -> None:
        super().__init__(message)
        self.error = ErrorInfo(code=code, message=message, retryable=False)
        self.format = format
        self.key = key
        self.response = response

    @classmethod
    def refused(cls, error: ApiError, key: str | None) -> LineError:
        return cls(error.code or "invalid_request", error.message, format=LineFormat.OPENAI, key=key, response=error)


def rejected(line: BulkLine, exc: JobRejected) -> LineError:
    """A line that enqueue refused (e.g. ``max_tokens`` beyond every worker's context)."""
    if line.format == LineFormat.OPENAI:
        return LineError.refused(ApiError.from_rejection(exc, line.param), line.key)
    return LineError("rejected", str(exc), key=line.key)


def _is_openai(obj: dict[str, Any]) -> bool:
    return "custom_id" in obj or ("url" in obj and "body" in obj)


def _key(obj: dict[str, Any]) -> Any:
    return obj.get("custom_id") if _is_openai(obj) else obj.get("id")


def raw_key(raw: bytes) -> str | None:
    """The id a line gives itself (``custom_id`` or ``id``), or None; cheap for lines without one."""
    if b'"custom_id"' not in raw and b'"id"' not in raw:
        return None
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    key = _key(obj) if isinstance(obj, dict) else None
    return key if isinstance(key, str) else str(key) if type(key) is int else None


def parse_line(raw: bytes, number: int, *, lane: str) -> BulkLine:
    """Raises LineError naming the problem (and the field)."""
    try:
        obj = json.loads(raw.decode())
    except UnicodeDecodeError as exc:
        raise LineError("invalid_json", f"the line is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    except ValueError as exc:
        raise LineError("invalid_json", f"the line is not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise LineError("invalid_line", f"a line must be a JSON object, not {type(obj).__name__}")
    if _is_openai(obj):
        return _openai_line(obj, number, lane)
    return _slotq_line(obj, number, lane)


def _slotq_line(obj: dict[str, Any], number: int, lane: str) -> BulkLine:
    own_key = "id" in obj
    key = obj.pop("id", number)
    if type(key) not in (str, int):
        raise LineError("invalid_request", f"id: must be a string or an integer (got {key!r})")
    key = str(key)
    if "idempotency_key" in obj:
        raise LineError("invalid_request", KEY_SET_BY_BULK, key=key)
    obj.setdefault("lane", lane)
    model: type[AnyJobRequest] = (EmbeddingJobRequest if "inputs" in obj
                                  else RerankJobRequest if "documents" in obj else JobRequest)
    try:
        return BulkLine(number, LineFormat.SLOTQ, key, model.model_validate(obj), own_key=own_key)
    except ValidationError as exc:
        raise LineError("invalid_request", describe(exc), key=key) from None


def _openai_line(obj: dict[str, Any], number: int, lane: str) -> BulkLine:
    key = obj.get("custom_id")
    key = key if isinstance(key, str) else None
    try:
        line = openai_batch.BatchLine.model_validate(obj)
    except ValidationError as exc:
        raise LineError("invalid_request", describe(exc), format=LineFormat.OPENAI, key=key) from None
    endpoint = Endpoint(line.url)
    try:
        request, job = openai_batch.to_job_request(endpoint, line.body, lane=lane)
    except ApiError as exc:
        raise LineError.refused(exc, line.custom_id) from None
    encoding = request.encoding_format if isinstance(request, EmbeddingsRequest) else "float"
    return BulkLine(number, LineFormat.OPENAI, line.custom_id, job, endpoint, request.model, param=wire_param(request),
                    encoding_format=encoding)


def describe(exc: ValidationError) -> str:
    """``sampling.temperature: Input should be less than or equal to 5 (got 7.0)``; problems joined by '; '."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) if err["loc"] else "line"
        got = f" (got {err['input']!r})" if err.get("type") != "missing" and not isinstance(
            err.get("input"), dict | list) else ""
        parts.append(f"{where}: {err['msg']}{got}")
    return "; ".join(parts)


# ---------------------------------------------------------------------- records
def failure_of(line: BulkLine, result: JobResult) -> ErrorInfo | None:
    """Why a finished job is not a successful line; None when it is one."""
    if result.status == JobStatus.CANCELLED:
        return ErrorInfo(code="cancelled", message=f"job {result.id} was cancelled", retryable=False)
    if result.status != JobStatus.SUCCEEDED:
        return result.error or ErrorInfo(code="job_failed", message=f"job {result.id} {result.status.value}",
                                         retryable=False)
    if line.format == LineFormat.OPENAI and any(finish_reason(c.finish_reason) is None for c in result.choices):
        return ErrorInfo(code="deadline_exceeded", retryable=False,
                         message=f"job {result.id}: the deadline passed after {result.usage.completion_tokens} tokens")
    return None


def output_record(line: BulkLine, job_id: str, result: JobResult) -> dict[str, Any]:
    if line.format == LineFormat.OPENAI:
        assert line.endpoint is not None
        return openai_batch.output_record(line.key, job_id, line.endpoint, line.model, result, line.encoding_format)
    exclude = {"id", "error"} | ({"choices"} if len(result.choices) <= 1 else set()) | (
        set() if isinstance(line.request, EmbeddingJobRequest) else {"embeddings", "dimensions"}) | (
        set() if isinstance(line.request, RerankJobRequest) else {"scores"})
    return {"id": line.key, "line": line.number, "job_id": job_id, **result.model_dump(mode="json", exclude=exclude)}


def error_record(number: int, error: ErrorInfo, *, format: LineFormat, key: str | None,
                 job_id: str | None, response: ApiError | None = None) -> dict[str, Any]:
    """A failed line. ``job_id`` is None when the line never became a job (malformed, rejected);
    ``response``: the gateway's answer to an OpenAI line's body (:attr:`LineError.response`)."""
    if format == LineFormat.OPENAI:
        if response is not None:
            return {**openai_batch.refused_record(key, response), "line": number}
        return {**openai_batch.error_record(key, job_id, error, ran=job_id is not None), "line": number}
    return {"id": key, "line": number, "job_id": job_id, "error": error.model_dump(mode="json")}


def job_id_in(record: Any) -> str | None:
    """The job id an output record carries (how a rerun knows the line is done)."""
    if not isinstance(record, dict):
        return None
    if "custom_id" in record:
        return openai_batch.job_id_in(record)
    value = record.get("job_id")
    return value if isinstance(value, str) else None
