"""OpenAI Batch API lines: ``{"custom_id", "method": "POST", "url", "body"}`` in, OpenAI's batch
output shape out.

A line's ``body`` is a ``/v1/chat/completions``, ``/v1/completions`` or ``/v1/embeddings`` request,
translated exactly as the gateway translates it (:mod:`slotq.jobs.openai`): the same parameters,
limits and errors, and the finished job becomes the same ``chat.completion``, ``text_completion`` or
embeddings ``list`` object,
wrapped as ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``.

A body the endpoint would refuse gets the endpoint's answer, as OpenAI's batch output does for a
request that failed: ``response`` holds the status code and the gateway's error body. ``error``
is for lines that are no request at all (not JSON, another URL, a repeated ``custom_id``) and for
requests the batch never ran (its completion window ran out). A line differs from a gateway
request in two ways only: it cannot stream, and it cannot set ``idempotency_key`` (a line's job id
is derived from the input, so a rerun finds it); its ``lane`` is the run's unless it names one.
"""

from __future__ import annotations

import time
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from slotq.jobs.openai import translate
from slotq.jobs.openai.errors import ApiError
from slotq.jobs.openai.translate import AnyKind, AnyWireRequest
from slotq.jobs.openai.wire import EmbeddingsRequest
from slotq.jobs.protocol.schemas import AnyJobRequest, JobResult, split_job_id
from slotq.jobs.protocol.wire import ErrorInfo

# Why a line may not set its own idempotency key (slotq lines and OpenAI bodies alike).
KEY_SET_BY_BULK = ("idempotency_key: set by slotq bulk (a line's job id derives from the input and its line number); "
                   "remove it")


class Endpoint(StrEnum):
    CHAT = "/v1/chat/completions"
    TEXT = "/v1/completions"
    EMBEDDINGS = "/v1/embeddings"

    @property
    def kind(self) -> AnyKind:
        return _ENDPOINT_KINDS[self]


_ENDPOINT_KINDS: dict[Endpoint, AnyKind] = {Endpoint.CHAT: "chat", Endpoint.TEXT: "text",
                                            Endpoint.EMBEDDINGS: "embedding"}


class BatchLine(BaseModel):
    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: str
    body: dict[str, Any]

    @model_validator(mode="after")
    def _known_url(self) -> BatchLine:
        if self.url not in tuple(Endpoint):
            raise ValueError(f"url {self.url!r}: slotq runs {', '.join(Endpoint)}")
        return self


def to_job_request(endpoint: Endpoint, body: dict[str, Any], *,
                   lane: str) -> tuple[AnyWireRequest, AnyJobRequest]:
    """The body as the gateway reads it, and its job in ``lane`` unless the body names a lane.
    Raises :class:`ApiError`: the gateway's answer to the same body, or one of a line's two rules."""
    request = translate.parse_request(endpoint.kind, body)
    if not isinstance(request, EmbeddingsRequest) and request.stream:
        raise ApiError.invalid("stream: a batch line cannot stream; its response is written to the output file",
                               "stream")
    if request.idempotency_key is not None:
        raise ApiError.invalid(KEY_SET_BY_BULK, "idempotency_key")
    if isinstance(request, EmbeddingsRequest):
        return request, translate.to_embedding_job(request, lane=lane)
    return request, translate.to_job_request(request, lane=lane)


# ---------------------------------------------------------------------- output
def request_id(job_id: str) -> str:
    """OpenAI's ``batch_req_...`` id of a line's output (the job id without the colons and its tenant)."""
    return "batch_req_" + split_job_id(job_id)[0].replace("bulk:", "", 1).replace(":", "_")


def output_record(custom_id: str, job_id: str, endpoint: Endpoint, model: str, result: JobResult,
                  encoding_format: str = "float") -> dict[str, Any]:
    body = translate.to_response(endpoint.kind, result, model, int(time.time()),
                                 encoding_format).model_dump(mode="json")
    return {"id": request_id(job_id), "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": job_id, "body": body}, "error": None}


def refused_record(custom_id: str | None, error: ApiError) -> dict[str, Any]:
    """A line whose body the endpoint refused: its HTTP answer, as the gateway would have sent it.
    No job ran, so there is no request id."""
    return {"id": None, "custom_id": custom_id,
            "response": {"status_code": error.status, "request_id": None, "body": error.body()}, "error": None}


def error_record(custom_id: str | None, job_id: str | None, error: ErrorInfo, *, ran: bool) -> dict[str, Any]:
    """A line that failed. ``ran``: the job ran and failed (an error response, as the API would have
    returned it); otherwise the line never became a job (OpenAI's request-level ``error``)."""
    rid = request_id(job_id) if job_id else None
    if not ran:
        return {"id": rid, "custom_id": custom_id, "response": None,
                "error": {"code": error.code, "message": error.message}}
    status = 500 if error.retryable else 400
    kind = "server_error" if error.retryable else "invalid_request_error"
    return {"id": rid, "custom_id": custom_id, "response": {"status_code": status, "request_id": job_id, "body": {
        "error": {"message": error.message, "type": kind, "param": None, "code": error.code}}}, "error": None}


def job_id_in(record: dict[str, Any]) -> str | None:
    response = record.get("response")
    return response.get("request_id") if isinstance(response, dict) else None
