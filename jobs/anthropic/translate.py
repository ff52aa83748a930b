"""Anthropic Messages requests -> slotq ``JobRequest``; slotq results -> Anthropic Messages.

A Messages request becomes the very job a chat completion does (messages, tools, sampling), so
the engine, the queue and every limit treat both alike:

* ``system`` (a string or text blocks) is the conversation's first message, a system message;
* an assistant turn's text blocks are its content and its ``tool_use`` blocks its tool calls
  (``input`` written as JSON arguments); its thinking blocks are left out, as chat templates leave
  out earlier turns' reasoning;
* a user turn's ``tool_result`` blocks are tool messages answering the call they name (first, so
  each follows the turn that made its call), then its text blocks one user message. A result with
  ``is_error`` reads ``Error: <content>``;
* ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` is ``auto`` / ``required`` / the named
  function / ``none``; ``disable_parallel_tool_use`` sets ``parallel_tool_calls`` (which slotq keeps
  off unless asked, see GenerationParams);
* ``stop_sequences`` are the job's ``stop``, ``output_config.format`` its ``json_schema``, and
  ``metadata.user_id`` its metadata.

Every refusal is an :class:`ApiError` naming the field as Anthropic's request spells it.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from slotq.jobs.anthropic.wire import (
    CountTokensRequest,
    Message,
    MessagesRequest,
    StopReason,
    TextBlock,
    TextOut,
    ThinkingOut,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOut,
    Usage,
)
from slotq.jobs.openai.errors import ApiError, from_validation, public_param
from slotq.jobs.openai.translate import answered_model
from slotq.jobs.openai.wire import SlotqInfo
from slotq.jobs.protocol.schemas import JobRequest, JobResult
from slotq.jobs.protocol.wire import FinishReason
from slotq.jobs.protocol.wire import Usage as JobUsage

_STOP_REASONS: dict[FinishReason, StopReason] = {FinishReason.STOP: "end_turn", FinishReason.LENGTH: "max_tokens",
                                                 FinishReason.TOOL_CALLS: "tool_use"}
# A JobRequest field -> the Messages request's name for it, where they differ.
_WIRE_NAMES = {"stop": "stop_sequences", "sampling.json_schema": "output_config.format", "prompt": "messages"}


def wire_param(field: str | None) -> str | None:
    """A job layer field as a Messages request names it (``stop`` is ``stop_sequences``)."""
    return _WIRE_NAMES.get(field, public_param(field)) if field is not None else None


def _rename(loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
    """A JobRequest validation error's location in the Messages request's names. A message's index
    in the job is not the request's (system, tool results), so errors there name ``messages``."""
    if loc[:1] == ("sampling",):
        return (wire_param(f"sampling.{loc[1]}") or "",) if len(loc) > 1 else ()
    if loc[:1] == ("tools",) and len(loc) >= 4 and loc[2] == "function":
        return ("tools", loc[1], "input_schema" if loc[3] == "parameters" else loc[3], *loc[4:])
    if loc[:1] in (("messages",), ("metadata",)):
        return loc[:1]
    return (wire_param(str(loc[0])) or "", *loc[1:]) if loc else loc


def job_messages(request: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as the job's chat messages (see the module docstring). A ``tool_result``
    must answer a ``tool_use`` of an earlier assistant turn, as Anthropic's API requires: a result
    for no call would reach the prompt as an orphan."""
    out: list[dict[str, Any]] = []
    if request.system_text is not None:
        out.append({"role": "system", "content": request.system_text})
    call_ids: set[str] = set()
    for i, message in enumerate(request.messages):
        text = "".join(block.text for block in message.content if isinstance(block, TextBlock))
        if message.role == "assistant":
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in message.content if isinstance(b, ToolUseBlock)]
            call_ids.update(b.id for b in message.content if isinstance(b, ToolUseBlock))
            out.append({"role": "assistant", "content": text, "tool_calls": calls or None})
            continue
        results = [(j, b) for j, b in enumerate(message.content) if isinstance(b, ToolResultBlock)]
        for j, result in results:
            if result.tool_use_id not in call_ids:
                param = f"messages[{i}].content[{j}].tool_use_id"
                raise ApiError.invalid(f"{param}: {result.tool_use_id!r} answers no tool_use block of an earlier "
                                       "assistant turn", param)
            out.append({"role": "tool", "tool_call_id": result.tool_use_id,
                        "content": f"Error: {result.text}" if result.is_error else result.text})
        if text or not results:
            out.append({"role": "user", "content": text})
    return out


def _conversation(request: CountTokensRequest) -> dict[str, Any]:
    """The JobRequest fields a conversation sets: messages, tools and the choice among them."""
    fields: dict[str, Any] = {"messages": job_messages(request)}
    if request.tools:
        fields["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                             "parameters": t.input_schema}} for t in request.tools]
    choice = request.tool_choice
    if choice is not None:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
            "type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use is not None:
            fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return fields


def _validated(fields: dict[str, Any]) -> JobRequest:
    try:
        return JobRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise from_validation(exc, _rename) from None


def to_job_request(request: MessagesRequest, *, idempotency_key: str | None = None, tenant: str | None = None,
                   lane: str | None = None) -> JobRequest:
    """The job a Messages request runs; its validation errors come back as a 400 under the
    request's names. ``idempotency_key`` (the header's) and ``lane`` apply when the body sets none."""
    sampling: dict[str, Any] = {"temperature": request.temperature, "top_p": request.top_p, "top_k": request.top_k}
    output_format = request.output_config.format if request.output_config else None
    if output_format is not None:
        sampling["json_schema"] = output_format.schema_
    user_id = request.metadata.user_id if request.metadata else None
    fields = _conversation(request) | {
        "max_tokens": request.max_tokens, "stop": request.stop_sequences,
        "sampling": {k: v for k, v in sampling.items() if v is not None},
        "lane": lane if request.lane is None else request.lane, "priority": request.priority,
        "deadline": request.deadline, "metadata": None if user_id is None else {"user_id": user_id},
        "idempotency_key": request.idempotency_key or idempotency_key, "tenant": tenant,
    }
    return _validated(fields)


def to_count_job(request: CountTokensRequest, *, tenant: str | None = None, lane: str | None = None) -> JobRequest:
    """The job that counts a conversation's tokens: the same prompt, rendered and tokenized by a
    worker's engine (only workers hold the tokenizer and the chat template), with one greedy token
    generated. A forced tool choice is counted as ``auto``, whose prompt is the same in a template
    that renders tools itself (a forced call cut at one token would not finish); in slotq's generic
    tool format the two differ by one sentence of the instructions."""
    fields = _conversation(request) | {"max_tokens": 1, "sampling": {"temperature": 0.0},
                                       "lane": lane if request.lane is None else request.lane, "tenant": tenant}
    if fields.get("tool_choice") not in (None, "none"):
        fields["tool_choice"] = "auto"
    return _validated(fields)


def stop_reason(reason: FinishReason | None, stop_sequence: str | None = None) -> StopReason | None:
    """Anthropic's name for a finish reason that ends a reply normally: ``stop_sequence`` when one of
    the request's ``stop_sequences`` ended it (the worker reports which), ``end_turn`` when the model did."""
    if reason == FinishReason.STOP and stop_sequence is not None:
        return "stop_sequence"
    return _STOP_REASONS.get(reason) if reason is not None else None


def usage_out(usage: JobUsage) -> Usage:
    return Usage(input_tokens=usage.prompt_tokens - usage.cached_prompt_tokens, output_tokens=usage.completion_tokens,
                 cache_read_input_tokens=usage.cached_prompt_tokens)


def message_id(job_id: str) -> str:
    return f"msg_{job_id}"


def tool_input(arguments: str) -> dict[str, Any] | None:
    """A call's arguments as ``tool_use.input``; None for text that is no JSON object (a call that
    ``max_tokens`` cut short)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def to_message(result: JobResult, model: str) -> Message:
    """A finished job as Anthropic's Message: its thinking, its text, then its calls. A call cut
    short by ``max_tokens`` has no complete input and is left out (``stop_reason`` is
    ``max_tokens``); the job's result (``GET /v1/jobs/{id}``) keeps its text. ``model`` is the name
    asked for; the Message names the model that served the job (:func:`answered_model`)."""
    content: list[ThinkingOut | TextOut | ToolUseOut] = []
    reason, stop = result.finish_reason, result.stop_sequence
    if result.choices:
        choice = result.choices[0]
        reason, stop = choice.finish_reason, choice.stop_sequence
        if choice.reasoning:
            content.append(ThinkingOut(thinking=choice.reasoning))
        if choice.text:
            content.append(TextOut(text=choice.text))
        for call in choice.tool_calls:
            arguments = tool_input(call.function.arguments)
            if arguments is not None:
                content.append(ToolUseOut(id=call.id, name=call.function.name, input=arguments))
    elif result.text:
        content.append(TextOut(text=result.text))
    return Message(id=message_id(result.id), model=answered_model(model, result.model), content=content,
                   stop_reason=stop_reason(reason, stop), stop_sequence=stop if reason == FinishReason.STOP else None,
                   usage=usage_out(result.usage),
                   slotq=SlotqInfo(job_id=result.id, worker=result.worker, attempts=result.attempts))

