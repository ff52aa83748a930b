"""OpenAI requests -> slotq ``JobRequest``; slotq results -> OpenAI response objects.

One translation for every way a body arrives: the gateway's routes (FastAPI validates the same
:mod:`~slotq.jobs.openai.wire` models and reports through the same ``from_validation``) and
OpenAI Batch lines (:func:`parse_request`). Every refusal is an :class:`ApiError` naming the
parameter as the request spelled it, with the limit: ``temperature: Input should be less than or
equal to 2 (got 9)``.

Finish reasons: ``stop``, ``length`` and ``tool_calls`` pass through. A job that was cancelled or whose deadline
passed did not finish its reply, so OpenAI's ``finish_reason`` has no honest value for it: the
gateway reports it as an error instead (409 ``job_cancelled`` / 504 ``deadline_exceeded``, or an
``error`` event in a stream), and the partial text stays available at ``GET /v1/jobs/{id}``.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, overload

from pydantic import ValidationError

from slotq.jobs.openai.errors import ApiError, from_validation, public_param
from slotq.jobs.openai.wire import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatLogprobs,
    CompletionRequest,
    CompletionTokensDetails,
    EmbeddingData,
    EmbeddingsRequest,
    EmbeddingsResponse,
    EmbeddingsUsage,
    PromptTokensDetails,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    SlotqInfo,
    TeiRank,
    TextChoice,
    TextCompletion,
    TextLogprobs,
    TokenLogprobOut,
    TopLogprobOut,
    UsageOut,
)
from slotq.jobs.protocol.schemas import (
    ChoiceResult,
    EmbeddingJobRequest,
    JobRequest,
    JobResult,
    JobStatus,
    RerankJobRequest,
    decode_vector,
)
from slotq.jobs.protocol.wire import FinishReason, TokenLogprob, ToolChoice, Usage

Kind = Literal["chat", "text"]
WireRequest = ChatCompletionRequest | CompletionRequest
AnyKind = Literal["chat", "text", "embedding"]
AnyWireRequest = WireRequest | EmbeddingsRequest
ResponseKind = Literal["chat", "text", "embedding", "rerank"]     # what a job's record says it answers
REQUEST_MODELS: dict[AnyKind, type[AnyWireRequest]] = {"chat": ChatCompletionRequest, "text": CompletionRequest,
                                                       "embedding": EmbeddingsRequest}


def kind_of(request: WireRequest) -> Kind:
    return "chat" if isinstance(request, ChatCompletionRequest) else "text"


@overload
def parse_request(kind: Kind, body: dict[str, Any]) -> WireRequest: ...
@overload
def parse_request(kind: AnyKind, body: dict[str, Any]) -> AnyWireRequest: ...
def parse_request(kind: AnyKind, body: dict[str, Any]) -> AnyWireRequest:
    """A ``/v1/chat/completions`` (``chat``), ``/v1/completions`` (``text``) or ``/v1/embeddings``
    (``embedding``) body, validated as the gateway's route validates it; a 400 naming the parameter
    otherwise."""
    try:
        return REQUEST_MODELS[kind].model_validate(body)
    except ValidationError as exc:
        raise from_validation(exc) from None


def to_job_request(request: WireRequest, *, idempotency_key: str | None = None, tenant: str | None = None,
                   lane: str | None = None) -> JobRequest:
    """Build the caller's job; its validation errors come back as a 400 under the request's
    parameter names. ``idempotency_key`` (the header's) and ``lane`` apply when the body sets none;
    without ``tenant`` the job keeps JobRequest's default (a bulk run sets its own at enqueue)."""
    sampling = {
        "temperature": request.temperature, "top_p": request.top_p, "top_k": request.top_k, "min_p": request.min_p,
        "seed": request.seed, "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty, "repeat_penalty": request.repeat_penalty,
        "penalty_last_n": request.repeat_last_n, "logit_bias": request.logit_bias, "grammar": request.grammar,
        "json_schema": request.json_schema,
    }
    fields: dict[str, Any] = {
        "max_tokens": request.max_tokens, "n": request.n, "stop": request.stop_list, "ignore_eos": request.ignore_eos,
        "lane": lane if request.lane is None else request.lane, "priority": request.priority,
        "deadline": request.deadline, "metadata": request.metadata,
        "idempotency_key": request.idempotency_key or idempotency_key, "tenant": tenant,
        "logprobs": request.logprobs_k, "lora": request.lora,
    }
    if isinstance(request, ChatCompletionRequest):
        fields["messages"] = [{"role": "system" if m.role == "developer" else m.role, "content": m.content or "",
                               "tool_calls": m.tool_calls, "tool_call_id": m.tool_call_id, "name": m.name}
                              for m in request.messages]
        fields.update(tools=request.tools, tool_choice=request.tool_choice,
                      parallel_tool_calls=request.parallel_tool_calls, reasoning_format=request.reasoning_format)
        if request.max_completion_tokens is not None:
            fields["max_tokens"] = request.max_completion_tokens
        fmt = request.response_format
        if fmt is not None and fmt.type != "text" and format_shapes_reply(request.tools, request.tool_choice):
            if request.json_schema is not None or request.grammar is not None:
                raise ApiError.invalid("response_format: give response_format, json_schema or grammar, not several",
                                       "response_format")
            sampling["json_schema"] = fmt.json_schema.schema_ if fmt.json_schema else {"type": "object"}
    else:
        fields["prompt"] = request.prompt_text

    def rename(loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
        if loc == ("sampling",):               # a rule across sampling fields: no single parameter
            return ()
        if loc[:1] == ("sampling",) and len(loc) > 1:
            return (wire_param(request)(f"sampling.{loc[1]}") or "", *loc[2:])
        if loc == ("max_tokens",):
            return (wire_param(request)("max_tokens") or "",)
        return loc

    fields["sampling"] = {k: v for k, v in sampling.items() if v is not None}
    try:
        return JobRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise from_validation(exc, rename) from None


def format_shapes_reply(tools: Sequence[object] | None, tool_choice: ToolChoice | Mapping[str, Any] | None) -> bool:
    """Whether a request's response format (``response_format``, the Responses API's ``text.format``)
    shapes its reply. ``tool_choice`` is a chat request's (an option, or a named function) or a
    Responses request's (an option, or its ``{"type": "function", "name": ...}`` object). Not when it
    forces a call (``required`` or a named function): the reply is then a call, which its
    ``parameters`` constrain, with no text for a format to shape, as on OpenAI. instructor's Responses
    mode sends its schema both ways. Under ``auto`` the reply may be text, so the format applies, and
    with tools the job refuses the pair (a 400 naming ``tools``)."""
    return not tools or tool_choice is None or tool_choice in ("auto", "none")


def wire_param(request: AnyWireRequest) -> Callable[[str | None], str | None]:
    """A JobRequest field's name as this request spelled it: ``max_completion_tokens`` or
    ``response_format`` for a chat request that used them, ``top_k`` for ``sampling.top_k``.
    It keeps only those names, not the request (a bulk run holds one per line in flight)."""
    renamed: dict[str, str] = {}
    if isinstance(request, ChatCompletionRequest):
        if request.max_completion_tokens is not None:
            renamed["max_tokens"] = "max_completion_tokens"
        if request.response_format is not None and request.response_format.type != "text":
            renamed["sampling.json_schema"] = "response_format"

    def name(field: str | None) -> str | None:
        return renamed[field] if field is not None and field in renamed else public_param(field)
    return name


def finish_reason(reason: FinishReason | None) -> str | None:
    """OpenAI's name for a finish reason that ends a reply normally (see the module docstring)."""
    return reason.value if reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.TOOL_CALLS) else None


def usage_out(usage: Usage) -> UsageOut:
    return UsageOut(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                    total_tokens=usage.prompt_tokens + usage.completion_tokens,
                    prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_prompt_tokens),
                    completion_tokens_details=CompletionTokensDetails(reasoning_tokens=usage.reasoning_tokens))


def unfinished_error(result: JobResult, param: Callable[[str | None], str | None] = public_param) -> ApiError | None:
    """Why a job's result is not a reply: failed, cancelled, past its deadline, or gone."""
    if result.status == JobStatus.FAILED:
        return ApiError.from_job_error(result.error, result.id, param)
    if result.status == JobStatus.CANCELLED:
        return ApiError(409, f"job {result.id} was cancelled; its partial result is at /v1/jobs/{result.id}",
                        type="invalid_request_error", code="job_cancelled")
    if result.status == JobStatus.NOT_FOUND:
        return ApiError.job_not_found(result.id)
    if FinishReason.DEADLINE in (result.finish_reason, *(c.finish_reason for c in result.choices)):
        return ApiError.deadline(f"job {result.id}: the deadline passed after {result.usage.completion_tokens} "
                                 f"tokens; the partial result is at /v1/jobs/{result.id}")
    return None


def assistant_message(choice: ChoiceResult) -> AssistantMessage:
    """A choice as OpenAI's message: a reply that only called tools has null content."""
    return AssistantMessage(content=None if choice.tool_calls and not choice.text else choice.text,
                            tool_calls=choice.tool_calls or None, reasoning_content=choice.reasoning or None)


def chat_logprobs(logprobs: list[TokenLogprob]) -> ChatLogprobs:
    """A chat choice's (or chunk's) ``logprobs``: OpenAI's ``content`` list."""
    return ChatLogprobs(content=[TokenLogprobOut(
        token=lp.token, logprob=lp.logprob, bytes=lp.token_bytes,
        top_logprobs=[TopLogprobOut(token=alt.token, logprob=alt.logprob, bytes=alt.token_bytes) for alt in lp.top])
        for lp in logprobs])


class TextOffsets:
    """Where each token of one choice starts in its generated text, in characters. A token that
    ends inside a character (its bytes are a piece of it) is followed by the others at the same
    offset: the character starts there. One per choice, fed every token in order."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0

    def next(self, token_bytes: list[int]) -> int:
        start = self._chars
        self._chars += len(self._decoder.decode(bytes(token_bytes)))
        return start


def text_logprobs(logprobs: list[TokenLogprob], offsets: TextOffsets) -> TextLogprobs:
    """A completion choice's (or chunk's) ``logprobs`` in OpenAI's legacy shape; the sampled token
    is in its position's ``top_logprobs`` too, as OpenAI's (up to logprobs + 1 entries)."""
    return TextLogprobs(tokens=[lp.token for lp in logprobs], token_logprobs=[lp.logprob for lp in logprobs],
                        top_logprobs=[{**{alt.token: alt.logprob for alt in lp.top}, lp.token: lp.logprob}
                                      for lp in logprobs],
                        text_offset=[offsets.next(lp.token_bytes) for lp in logprobs])


def answered_model(asked: str, served: str | None) -> str:
    """The model an answer names, in every API alike (chat, Responses, Messages, streamed or not):
    the model that served the job when its result or final entry says, but ``base:adapter`` as asked
    when ``base`` served it (:mod:`slotq.jobs.gateway.adapters`), so a client that named a LoRA
    adapter sees the name it asked for."""
    if served is None or asked.startswith(f"{served}:"):
        return asked
    return served


def completion_id(kind: Kind, job_id: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{job_id}"


def to_response(kind: ResponseKind, result: JobResult, model: str, created: int, encoding_format: str = "float"
                ) -> ChatCompletion | TextCompletion | EmbeddingsResponse | RerankResponse:
    """A finished job as OpenAI's ``chat.completion``, ``text_completion`` or embeddings ``list`` object
    (``encoding_format``: the embedding request's), or a rerank job as llama-server's answer (every document,
    without its text: the job keeps scores only). ``model`` is the name asked for; the response names
    the model that served the job when its result says (``system_fingerprint``: its GGUF's fingerprint), or
    ``base:adapter`` as asked when ``base`` served it (a LoRA adapter of that model)."""
    model = answered_model(model, result.model)
    if kind == "embedding":
        return to_embeddings_response(result, model, encoding_format)
    if kind == "rerank":
        return to_rerank_response(result, model)
    slotq = SlotqInfo(job_id=result.id, worker=result.worker, attempts=result.attempts)
    usage = usage_out(result.usage)
    rid = completion_id(kind, result.id)
    if kind == "chat":
        return ChatCompletion(id=rid, created=created, model=model, usage=usage, slotq=slotq,
                              system_fingerprint=result.model_fingerprint, choices=[
            ChatChoice(index=c.index, message=assistant_message(c), finish_reason=finish_reason(c.finish_reason),
                       logprobs=None if c.logprobs is None else chat_logprobs(c.logprobs))
            for c in result.choices])
    return TextCompletion(id=rid, created=created, model=model, usage=usage, slotq=slotq,
                          system_fingerprint=result.model_fingerprint, choices=[
        TextChoice(index=c.index, text=c.text, logprobs=None if c.logprobs is None else text_logprobs(
            c.logprobs, TextOffsets()), finish_reason=finish_reason(c.finish_reason)) for c in result.choices])


def to_embedding_job(request: EmbeddingsRequest, *, idempotency_key: str | None = None, tenant: str | None = None,
                     lane: str | None = None) -> EmbeddingJobRequest:
    """The caller's embedding job; its validation errors come back as a 400 naming ``input`` (or the
    field), as :func:`to_job_request` does for generation."""
    fields: dict[str, Any] = {
        "inputs": request.inputs, "truncate": request.truncate, "lane": lane if request.lane is None else request.lane,
        "metadata": request.metadata, "idempotency_key": request.idempotency_key or idempotency_key, "tenant": tenant,
    }

    def rename(loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
        return ("input", *loc[1:]) if loc[:1] == ("inputs",) else loc

    try:
        return EmbeddingJobRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise from_validation(exc, rename) from None


def to_embeddings_response(result: JobResult, model: str, encoding_format: str = "float") -> EmbeddingsResponse:
    """A finished embedding job as OpenAI's ``list`` of ``embedding`` objects. The job keeps each
    vector as OpenAI's base64 already, so ``base64`` passes it through."""
    data = [EmbeddingData(index=i, embedding=encoded if encoding_format == "base64" else decode_vector(encoded))
            for i, encoded in enumerate(result.embeddings)]
    about = SlotqInfo(job_id=result.id, worker=result.worker, attempts=result.attempts)
    return EmbeddingsResponse(data=data, model=result.model or model, slotq=about,
                              usage=EmbeddingsUsage(prompt_tokens=result.usage.prompt_tokens,
                                                    total_tokens=result.usage.prompt_tokens))


def to_rerank_job(request: RerankRequest, *, idempotency_key: str | None = None, tenant: str | None = None
                  ) -> RerankJobRequest:
    """The caller's rerank job; its validation errors come back as a 400 naming the field as the request
    spelled it (``documents`` or ``texts``) and the limit."""
    items = "texts" if request.tei else "documents"
    fields: dict[str, Any] = {
        "query": request.query, "documents": request.items, "lane": request.lane, "metadata": request.metadata,
        "idempotency_key": request.idempotency_key or idempotency_key, "tenant": tenant,
    }

    def rename(loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
        return (items, *loc[1:]) if loc[:1] == ("documents",) else loc

    try:
        return RerankJobRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise from_validation(exc, rename) from None


def to_rerank_response(result: JobResult, model: str, documents: Sequence[str] | None = None,
                       top_n: int | None = None) -> RerankResponse:
    """A finished rerank job as llama-server's answer: results most relevant first, the first ``top_n``,
    each with its document when ``documents`` are given (``return_documents``)."""
    about = SlotqInfo(job_id=result.id, worker=result.worker, attempts=result.attempts)
    tokens = result.usage.prompt_tokens
    return RerankResponse(model=result.model or model, slotq=about,
                          usage=EmbeddingsUsage(prompt_tokens=tokens, total_tokens=tokens), results=[
        RerankResult(index=i, relevance_score=result.scores[i],
                     document=None if documents is None else RerankDocument(text=documents[i]))
        for i in result.ranked(top_n)])


def to_tei_ranks(result: JobResult, texts: Sequence[str] | None = None, top_n: int | None = None) -> list[TeiRank]:
    """A finished rerank job as TEI's answer (llama-server's for a body with ``texts``): a bare list, most
    relevant first, each with its text when ``texts`` are given (``return_text``)."""
    return [TeiRank(index=i, score=result.scores[i], text=None if texts is None else texts[i])
            for i in result.ranked(top_n)]
