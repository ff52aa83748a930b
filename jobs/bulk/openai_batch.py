"""OpenAI Batch API lines: ``{"custom_id", "method": "POST", "url", "body"}`` in, OpenAI's batch
output shape out.

A line's ``body`` is a ``/v1/chat/completions`` or ``/v1/completions`` request; it becomes a
:class:`~slotq.jobs.protocol.schemas.JobRequest`, and the finished job becomes the ``chat.completion`` or
``text_completion`` object OpenAI would have returned, wrapped as
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``. Parameters slotq
cannot honour (tools, logprobs, streaming, ...) are refused by name rather than ignored. Limits are
the job layer's (``JobRequest``): a bad value is reported under the body parameter's name.
"""

from __future__ import annotations

import time
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from slotq.engine import ErrorInfo, FinishReason
from slotq.jobs.protocol.schemas import JobRequest, JobResult, split_job_id


class Endpoint(StrEnum):
    CHAT = "/v1/chat/completions"
    TEXT = "/v1/completions"


class BatchLine(BaseModel):
    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: str
    body: dict[str, Any]

    @model_validator(mode="after")
    def _known_url(self) -> BatchLine:
        if self.url not in tuple(Endpoint):
            raise ValueError(f"url {self.url!r}: slotq runs {' and '.join(Endpoint)}")
        return self


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class _JsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class _ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchema | None = None


class _Body(BaseModel):
    """Shape and types only; the limits are JobRequest's."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    max_tokens: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_penalty: float | None = None
    seed: int | None = None
    logit_bias: dict[int, float] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = Field(None, description="accepted and not used")
    stream: Literal[False] = Field(False, description="a batch line cannot stream")
    logprobs: Literal[False] | None = Field(None, description="not available")


class ChatBody(_Body):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    response_format: _ResponseFormat | None = None


class CompletionBody(_Body):
    prompt: str | list[str]


_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repeat_penalty",
             "seed", "logit_bias")


def to_job_request(endpoint: Endpoint, body: dict[str, Any], *, lane: str) -> tuple[JobRequest, str]:
    """(the job, the body's model). Raises ValidationError with body parameter names in ``loc``."""
    parsed: ChatBody | CompletionBody = (ChatBody if endpoint == Endpoint.CHAT else CompletionBody).model_validate(body)
    sampling = {name: getattr(parsed, name) for name in _SAMPLING if getattr(parsed, name) is not None}
    fields: dict[str, Any] = {
        "max_tokens": parsed.max_tokens, "n": parsed.n, "metadata": parsed.metadata, "lane": lane,
        "stop": [parsed.stop] if isinstance(parsed.stop, str) else parsed.stop,
    }
    renamed = {("sampling", "json_schema"): "response_format"}
    if isinstance(parsed, ChatBody):
        fields["messages"] = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                              for m in parsed.messages]
        if parsed.max_completion_tokens is not None:
            fields["max_tokens"] = parsed.max_completion_tokens
            renamed[("max_tokens",)] = "max_completion_tokens"
        fmt = parsed.response_format
        if fmt is not None and fmt.type != "text":
            sampling["json_schema"] = fmt.json_schema.schema_ if fmt.json_schema else {"type": "object"}
    else:
        prompts = [parsed.prompt] if isinstance(parsed.prompt, str) else parsed.prompt
        if len(prompts) != 1:
            raise _body_error("prompt", "give one prompt per batch line", parsed.prompt)
        fields["prompt"] = prompts[0]
    fields["sampling"] = sampling
    try:
        return JobRequest.model_validate({k: v for k, v in fields.items() if v is not None}), parsed.model
    except ValidationError as exc:
        raise _renamed(exc, renamed) from None


def _body_error(param: str, message: str, value: Any) -> ValidationError:
    return ValidationError.from_exception_data("body", [
        {"type": "value_error", "loc": (param,), "input": value, "ctx": {"error": ValueError(message)}}])


def _renamed(exc: ValidationError, renamed: dict[tuple[str, ...], str]) -> ValidationError:
    """JobRequest's errors under the names the body used: ``sampling.temperature`` -> ``temperature``."""
    errors = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        name = renamed.get(loc[:2]) or renamed.get(loc[:1])
        if name is not None:
            loc = (name,)
        elif loc[:1] == ("sampling",):
            loc = loc[1:]
        errors.append({**err, "loc": loc})
    return ValidationError.from_exception_data("body", errors)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- output
def finish_reason(reason: FinishReason | None) -> str | None:
    return reason.value if reason in (FinishReason.STOP, FinishReason.LENGTH) else None


def request_id(job_id: str) -> str:
    """OpenAI's ``batch_req_...`` id of a line's output (the job id without the colons and its tenant)."""
    return "batch_req_" + split_job_id(job_id)[0].replace("bulk:", "", 1).replace(":", "_")


def output_record(custom_id: str, job_id: str, endpoint: Endpoint, model: str, result: JobResult) -> dict[str, Any]:
    usage = {"prompt_tokens": result.usage.prompt_tokens, "completion_tokens": result.usage.completion_tokens,
             "total_tokens": result.usage.prompt_tokens + result.usage.completion_tokens,
             "prompt_tokens_details": {"cached_tokens": result.usage.cached_prompt_tokens}}
    created = int(time.time())
    body: dict[str, Any]
    if endpoint == Endpoint.CHAT:
        body = {"id": f"chatcmpl-{job_id}", "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text, "refusal": None},
                             "logprobs": None, "finish_reason": finish_reason(c.finish_reason)}
                            for c in result.choices], "usage": usage}
    else:
        body = {"id": f"cmpl-{job_id}", "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": c.index, "text": c.text, "logprobs": None,
                             "finish_reason": finish_reason(c.finish_reason)} for c in result.choices],
                "usage": usage}
    return {"id": request_id(job_id), "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": job_id, "body": body}, "error": None}


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
