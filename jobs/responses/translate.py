"""Responses API requests -> slotq ``JobRequest``; slotq results -> Response objects.

A Responses request becomes the very job a chat completion does (messages, tools, sampling), so
the engine, the queue and every limit treat both alike:

* ``instructions`` is the conversation's first message, a system message; ``input`` as a string is
  one user message;
* a ``message`` item is a message of its role (``developer`` reads ``system``), its text parts
  joined;
* a ``function_call`` item is a tool call of the assistant turn before it (or of a new assistant
  turn when a user or tool message precedes it), its ``call_id`` the call's id; a
  ``function_call_output`` item is the tool message answering it. An output for no earlier call
  is refused naming ``input[i].call_id``, as OpenAI refuses it;
* ``reasoning`` items are left out, as chat templates leave out earlier turns' reasoning;
* ``max_output_tokens`` is the job's ``max_tokens``, ``text.format`` its ``json_schema``
  (``json_object``: any object), ``tool_choice`` maps one to one.

Every refusal is an :class:`ApiError` in OpenAI's shape naming the field as the request spells it.
A reply ``max_output_tokens`` cut is a Response with status ``incomplete`` (reason
``max_output_tokens``), as OpenAI answers it: its text so far, and no call whose arguments the cut
left unfinished.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any, Literal

from pydantic import ValidationError

from slotq.jobs.openai.errors import ApiError, from_validation, public_param
from slotq.jobs.openai.translate import answered_model, format_shapes_reply
from slotq.jobs.openai.wire import SlotqInfo
from slotq.jobs.protocol.schemas import JobRequest, JobResult
from slotq.jobs.protocol.wire import FinishReason, ToolCallSpec, Usage
from slotq.jobs.responses.wire import (
    ITEM_MODELS,
    FunctionCallItem,
    FunctionCallOut,
    FunctionCallOutputItem,
    IncompleteDetails,
    InputItem,
    InputTokensDetails,
    ItemStatus,
    MessageItem,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningOut,
    ReasoningText,
    Response,
    ResponseError,
    ResponsesRequest,
    ResponseUsage,
)

# A JobRequest field -> the Responses request's name for it, where they differ.
_WIRE_NAMES = {"max_tokens": "max_output_tokens", "sampling.json_schema": "text.format", "messages": "input",
               "prompt": "input"}


def wire_param(field: str | None) -> str | None:
    """A job layer field as a Responses request names it (``max_tokens`` is ``max_output_tokens``)."""
    return _WIRE_NAMES.get(field, public_param(field)) if field is not None else None


def _rename(loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
    """A JobRequest validation error's location in the request's names. A message's index in the
    job is not an input item's (instructions, calls merged into one turn), so errors there name ``input``."""
    if loc[:1] == ("sampling",):
        return (wire_param(f"sampling.{loc[1]}") or "",) if len(loc) > 1 else ()
    if loc[:1] == ("tools",) and len(loc) >= 4 and loc[2] == "function":
        return ("tools", loc[1], *loc[3:])
    if loc[:1] in (("messages",), ("metadata",)):
        return ("input",) if loc[0] == "messages" else loc[:1]
    return (wire_param(str(loc[0])) or "", *loc[1:]) if loc else loc


def _in_item(index: int, loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
    return ("input", index, *loc)


def input_items(request: ResponsesRequest) -> list[InputItem]:
    """``input`` as items (a string is one user message), each validated by its ``type`` (an item
    with a ``role`` and no type is a message); a 400 naming ``input[i]`` and the field otherwise."""
    if isinstance(request.input, str):
        return [MessageItem(role="user", content=request.input)]     # type: ignore[arg-type]  # the validator reads it
    items: list[InputItem] = []
    for i, raw in enumerate(request.input):
        kind = raw.get("type", "message" if "role" in raw else None)
        model = ITEM_MODELS.get(kind) if isinstance(kind, str) else None
        if model is None:
            why = ("item_reference needs stored responses, which slotq does not keep yet: send the item itself"
                   if kind == "item_reference" else
                   f"slotq reads {', '.join(map(repr, ITEM_MODELS))} items (and a message as {{role, content}})")
            raise ApiError.invalid(f"input[{i}].type: {kind!r} is not served: {why}", f"input[{i}].type")
        try:
            items.append(model.model_validate(raw))
        except ValidationError as exc:
            raise from_validation(exc, partial(_in_item, i)) from None
    return items


def job_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation as the job's chat messages (see the module docstring)."""
    out: list[dict[str, Any]] = []
    if request.instructions:
        out.append({"role": "system", "content": request.instructions})
    call_ids: set[str] = set()
    for i, item in enumerate(input_items(request)):
        if isinstance(item, MessageItem):
            out.append({"role": "system" if item.role == "developer" else item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = ToolCallSpec.model_validate({"id": item.call_id, "function": {"name": item.name,
                                                                                 "arguments": item.arguments}})
            if out and out[-1]["role"] == "assistant":
                out[-1]["tool_calls"] = [*(out[-1].get("tool_calls") or []), call]
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            call_ids.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in call_ids:
                param = f"input[{i}].call_id"
                raise ApiError.invalid(f"{param}: {item.call_id!r} answers no function_call item before it "
                                       "(send the call with its output)", param)
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return out


def to_job_request(request: ResponsesRequest, *, idempotency_key: str | None = None, tenant: str | None = None,
                   lane: str | None = None) -> JobRequest:
    """The job a Responses request runs; its validation errors come back as a 400 under the
    request's names. ``idempotency_key`` (the header's) and ``lane`` apply when the body sets none."""
    sampling: dict[str, Any] = {"temperature": request.temperature, "top_p": request.top_p}
    output_format = request.text.format if request.text else None
    if output_format is not None and output_format.type != "text" and format_shapes_reply(request.tools,
                                                                                        request.tool_choice):
        sampling["json_schema"] = output_format.schema_ if output_format.type == "json_schema" else {"type": "object"}
    fields: dict[str, Any] = {
        "messages": job_messages(request), "max_tokens": request.max_output_tokens,
        "sampling": {k: v for k, v in sampling.items() if v is not None},
        "parallel_tool_calls": request.parallel_tool_calls,
        "lane": lane if request.lane is None else request.lane, "priority": request.priority,
        "deadline": request.deadline, "metadata": request.metadata,
        "idempotency_key": request.idempotency_key or idempotency_key, "tenant": tenant,
    }
    if request.tools:
        fields["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                             "parameters": t.parameters or {"type": "object"}}}
                           for t in request.tools]
    choice = request.tool_choice
    if choice is not None:
        fields["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                         "function": {"name": choice["name"]}}
    try:
        return JobRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise from_validation(exc, _rename) from None


def listed_items(request: ResponsesRequest, job_id: str) -> list[dict[str, Any]]:
    """The request's input as the items ``GET /v1/responses/{id}/input_items`` lists, in the shapes the
    openai SDK's item types require however the request spelled them: each with its ``type`` and an
    ``id`` (``item_<job id>_<index>`` where the request gave none), a message's content as parts (an
    ``output_text`` part with its ``annotations``), a reasoning item with its ``summary``."""
    raw_items = request.input if isinstance(request.input, list) else [{"role": "user", "content": request.input}]
    listed = []
    for i, raw in enumerate(raw_items):
        item = {"type": "message", **raw}
        item.setdefault("id", f"item_{job_id}_{i}")
        if item["type"] == "message":
            content = item.get("content")
            parts: list[dict[str, Any]] = content if isinstance(content, list) else [
                {"type": "output_text" if item.get("role") == "assistant" else "input_text", "text": content}]
            item["content"] = [{"annotations": [], **part} if part.get("type") == "output_text" else part
                               for part in parts]
        if item["type"] in ("message", "function_call", "function_call_output"):
            item.setdefault("status", "completed")
        if item["type"] == "reasoning":
            item.setdefault("summary", [])
        listed.append(item)
    return listed


def counting_request(request: ResponsesRequest) -> ResponsesRequest:
    """The request whose job counts a conversation's input tokens (``/v1/responses/input_tokens``):
    the same prompt, rendered and tokenized by a worker's engine (only workers hold the tokenizer
    and the chat template), one greedy token generated, not stored. A forced tool choice counts as
    ``auto`` (a forced call cut at one token would not finish; the prompts are the same where the
    template renders tools, and differ by one sentence in slotq's generic tool format)."""
    choice = request.tool_choice
    return request.model_copy(update={
        "max_output_tokens": 1, "temperature": 0.0, "top_p": None, "text": None, "stream": False, "store": False,
        "tool_choice": choice if choice in (None, "none", "auto") else "auto"})


def response_id(job_id: str) -> str:
    return f"resp_{job_id}"


def usage_out(usage: Usage) -> ResponseUsage:
    return ResponseUsage(input_tokens=usage.prompt_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=usage.cached_prompt_tokens),
                         output_tokens=usage.completion_tokens,
                         output_tokens_details=OutputTokensDetails(reasoning_tokens=usage.reasoning_tokens),
                         total_tokens=usage.prompt_tokens + usage.completion_tokens)


def is_complete_json(arguments: str) -> bool:
    """Whether a call's arguments are whole JSON (a call ``max_output_tokens`` cut is not)."""
    try:
        json.loads(arguments)
    except ValueError:
        return False
    return True


def output_items(job_id: str, reasoning: str, text: str, calls: list[ToolCallSpec], *,
                 incomplete: bool) -> list[OutputItem]:
    """A reply as output items: its reasoning, its message (when it wrote text), then its function
    calls (a call whose arguments the cut left unfinished is left out). Item ids derive from the job's, so a reply
    reads the same each time it is rendered."""
    status: ItemStatus = "incomplete" if incomplete else "completed"
    items: list[OutputItem] = []
    if reasoning:
        items.append(ReasoningOut(id=f"rs_{job_id}", content=[ReasoningText(text=reasoning)], status=status))
    whole = [(i, call) for i, call in enumerate(calls) if is_complete_json(call.function.arguments)]
    if text:
        items.append(OutputMessage(id=f"msg_{job_id}", status=status, content=[OutputText(text=text)]))
    items += [FunctionCallOut(id=f"fc_{job_id}_{i}", call_id=call.id, name=call.function.name,
                              arguments=call.function.arguments, status="completed") for i, call in whole]
    return items


def response_shell(request: ResponsesRequest, job_id: str, model: str, created: int) -> Response:
    """The Response of a job that has not finished: no output yet, the request's settings echoed
    (what a stream's ``response.created`` carries)."""
    return Response(id=response_id(job_id), created_at=created, model=model, status="in_progress", output=[],
                    usage=None, **echoed(request), slotq=SlotqInfo(job_id=job_id))


def finished(shell: Response, output: list[OutputItem], reason: FinishReason | None, usage: Usage,
             completed_at: int) -> Response:
    """``shell`` with a reply's output: ``incomplete`` (reason ``max_output_tokens``) when the
    limit cut it, ``completed`` otherwise."""
    incomplete = reason == FinishReason.LENGTH
    return shell.model_copy(update={
        "status": "incomplete" if incomplete else "completed", "output": output, "usage": usage_out(usage),
        "completed_at": None if incomplete else completed_at,
        "incomplete_details": IncompleteDetails(reason="max_output_tokens") if incomplete else None})


def output_items_of(result: JobResult) -> list[OutputItem]:
    """A finished job's reply as output items."""
    choice = result.choices[0] if result.choices else None
    reason = choice.finish_reason if choice else result.finish_reason
    return output_items(result.id, choice.reasoning if choice else "", choice.text if choice else result.text,
                        choice.tool_calls if choice else [], incomplete=reason == FinishReason.LENGTH)


def to_response(result: JobResult, request: ResponsesRequest, model: str, created: int) -> Response:
    """A finished job as OpenAI's Response, the request's settings echoed; ``model`` is the name asked
    for, and the Response names the model that served the job (:func:`answered_model`)."""
    reason = result.choices[0].finish_reason if result.choices else result.finish_reason
    shell = response_shell(request, result.id, answered_model(model, result.model), created)
    shell.slotq = SlotqInfo(job_id=result.id, worker=result.worker, attempts=result.attempts)
    total_s = int(result.timings.total_ms / 1000) if result.timings else 0
    return finished(shell, output_items_of(result), reason, result.usage, created + total_s)


def echoed(request: ResponsesRequest) -> dict[str, Any]:
    """The request's settings a Response repeats (OpenAI's Response echoes them)."""
    return {"instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "temperature": request.temperature, "top_p": request.top_p,
            "text": request.text.model_dump(by_alias=True, exclude_none=True) if request.text and request.text.format
            else {"format": {"type": "text"}},
            "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
            "tool_choice": request.tool_choice or "auto", "parallel_tool_calls": bool(request.parallel_tool_calls),
            "reasoning": request.reasoning.model_dump(exclude_none=True) if request.reasoning else None,
            "metadata": request.metadata or {}, "store": request.store, "background": request.background,
            "previous_response_id": request.previous_response_id}


def response_error(error: ApiError) -> ResponseError:
    """A job's failure as a Response's ``error``: ``code`` one the openai SDK's type declares (the
    request's fault, 400: ``invalid_prompt``; a quota, 429: ``rate_limit_exceeded``; any other:
    ``server_error``), slotq's own code in ``type``, the field at fault in ``param``."""
    code: Literal["invalid_prompt", "rate_limit_exceeded", "server_error"] = (
        "invalid_prompt" if error.status == 400 else "rate_limit_exceeded" if error.status == 429 else "server_error")
    return ResponseError(code=code, message=error.message, type=error.code or error.type, param=error.param)
