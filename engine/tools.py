"""Tool calls: how a request's tools reach the model, and how its calls are held to their schemas.

The model's chat template decides the way, as in llama-server (``--jinja``):

* **Native.** The template renders ``tools`` itself (Qwen 2.5/3 and Hermes, Llama 3.x, Mistral), so
  the model answers in its family's format (:class:`~slotq.engine.reply_parser.ToolCallFormat`),
  which the reply parser reads.
* **Generic.** The template knows no tools (the bundled SmolLM2's plain ChatML). A system message
  describes the tools, and the whole reply is JSON: ``{"tool_calls": [{"name": ..., "arguments":
  {...}}]}`` or ``{"response": "..."}``. Earlier calls and their results are written into the
  conversation in plain words (a tool's result as a user message, since such a template may refuse
  a ``tool`` role).

How a call is held to its function's ``parameters``:

* ``required`` and a named function are constrained by the grammar engine
  (:mod:`slotq.engine.constraints`): the reply can only be a call of the allowed functions with
  arguments that match their schemas, so even a 135M model's call validates. llama-server answered
  such requests on the same model with prose (``finish_reason: length``, no ``tool_calls``).
* ``auto`` in the generic format is constrained the same way (a call, or a ``response``).
* ``auto`` in a native format is free text until the model writes a call's marker
  (``<tool_call>``, ``[TOOL_CALLS]``, ``<|python_tag|>``, or a Llama 3 reply that opens as a call):
  there the same grammar a forced call gets is armed (:class:`CallTrigger`, :class:`LazyCall`; a
  lazy grammar, as llama-server's ``grammar_triggers``), fed what the model wrote from the marker
  on, so the rest of the call is valid by construction and the reply ends with it (calls only, as
  many as ``parallel_tool_calls`` allows). Text the model wrote past the marker before the grammar
  was armed (the rest of the marker's token) that the grammar refuses fails the request
  (``invalid_tool_call``): a call is never delivered half right.

Native grammars spell their markers (``<tool_call>``, ``[TOOL_CALLS]``) as text: where a model has
them as special tokens, a constrained call is written with the marker's ordinary tokens, which the
parser reads the same way.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llguidance

from slotq.engine.constraints import (
    COMPACT_JSON,
    Constraint,
    TokenMatcher,
    closed_objects,
    validate_constraint,
    with_subschemas,
)
from slotq.engine.errors import GrammarError
from slotq.engine.grammar_knobs import GrammarKnobs
from slotq.engine.reply_parser import (
    HERMES_OPEN,
    LLAMA3_CALL_OPENINGS,
    MISTRAL_CALLS,
    PYTHON_TAG,
    THINK_CLOSE,
    THINK_OPEN,
    ReplyParser,
    ToolCallError,
    ToolCallFormat,
)
from slotq.engine.request import ChatMessage, GenerationParams, NamedToolChoice, ToolSpec


@dataclass(frozen=True)
class ToolPlan:
    """What the engine does with one request's tools: the format its reply is parsed in, and the
    constraint that holds its calls, on the whole reply or (``lazy``) armed at a call's marker."""

    tool_format: ToolCallFormat
    constraint: Constraint
    lazy: bool = False


def plan_tools(request: GenerationParams, tool_format: ToolCallFormat) -> ToolPlan | None:
    """The plan for a request that may call tools (None when it has none, or tool_choice is 'none')
    on a model whose template answers in ``tool_format`` (:func:`detect_tool_format`). Raises
    :class:`GrammarError` naming ``tools`` when a function's parameters cannot be compiled."""
    if not request.calls_tools:
        return None
    allowed = _allowed(request)
    forced = request.tool_choice != "auto"
    if tool_format == ToolCallFormat.GENERIC:
        schema = generic_schema(allowed, forced=forced, parallel=request.parallel_tool_calls)
        return ToolPlan(tool_format, _compiled_schema(schema))
    return ToolPlan(tool_format, _compiled_lark(native_grammar(tool_format, allowed, request.parallel_tool_calls)),
                    lazy=not forced)


def check_tools(request: GenerationParams, knobs: GrammarKnobs) -> None:
    """What a producer checks before enqueue, without knowing the model: the generic format's
    constraint, which holds every allowed function's schema, so parameters any worker would refuse
    are refused here, under the same limits. Raises :class:`GrammarError` naming ``tools``."""
    if request.calls_tools:
        validate_constraint(_compiled_schema(generic_schema(_allowed(request), forced=request.tool_choice != "auto",
                                                            parallel=request.parallel_tool_calls)), knobs)


def _allowed(request: GenerationParams) -> list[ToolSpec]:
    tools = request.tools or []
    choice = request.tool_choice
    if isinstance(choice, NamedToolChoice):
        return [tool for tool in tools if tool.function.name == choice.function.name]
    return list(tools)


# ---------------------------------------------------------------------------- grammars
def _call_schema(name: str, arguments: dict[str, Any], arguments_key: str, typed: bool) -> dict[str, Any]:
    """One call's object; ``typed``: an optional ``"type": "function"`` may come first (Llama 3, as
    llama.cpp's grammar for it allows, and the reply parser reads)."""
    properties = {"name": {"const": name}, arguments_key: arguments}
    if typed:
        properties = {"type": {"const": "function"}, **properties}
    return {"type": "object", "additionalProperties": False, "required": ["name", arguments_key],
            "properties": properties}


def _one_of_calls(tools: list[ToolSpec], arguments_key: str = "arguments",
                  typed: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """The schema of one call of any of ``tools``, and the ``$defs`` the root of the schema that embeds
    it must carry (:func:`_embedded_parameters`)."""
    root_defs: dict[str, Any] = {}
    calls = [_call_schema(tool.function.name, _embedded_parameters(tool, index, root_defs), arguments_key, typed)
             for index, tool in enumerate(tools)]
    return (calls[0] if len(calls) == 1 else {"anyOf": calls}), root_defs


def _embedded_parameters(tool: ToolSpec, index: int, root_defs: dict[str, Any]) -> dict[str, Any]:
    """A function's ``parameters`` as a wrapper schema embeds them. They are a schema document of their
    own, so their local references (``#/$defs/City``, how pydantic writes a nested model) mean their
    own root, not the wrapper's: parameters that hold one move under the wrapper root's ``$defs``
    (added to ``root_defs``) with each reference rebased there, and are embedded as a ``$ref``.
    Their objects are closed as a response_format's are (:func:`~slotq.engine.constraints.closed_objects`)."""
    parameters: dict[str, Any] = closed_objects(tool.function.parameters)
    key = f"slotq_parameters_{index}"
    rebased = _rebased_refs(parameters, f"#/$defs/{key}")
    if rebased == parameters:       # no local reference: embedded as they are
        return parameters
    root_defs[key] = rebased
    return {"$ref": f"#/$defs/{key}"}


def _rebased_refs(schema: Any, base: str) -> Any:
    """``schema`` with each local reference (``#...``) moved under ``base``."""
    rebased = with_subschemas(schema, lambda sub: _rebased_refs(sub, base))
    ref = rebased.get("$ref") if isinstance(rebased, dict) else None
    if isinstance(ref, str) and ref.startswith("#"):
        rebased["$ref"] = base + ref[1:]
    return rebased


def generic_schema(tools: list[ToolSpec], *, forced: bool, parallel: bool) -> dict[str, Any]:
    """The generic format's reply: calls of ``tools``, or (unless ``forced``) a plain response, never
    an empty one (``{"response": ""}`` answers nothing: the bundled model wrote it in 2 of 8 tries)."""
    call, root_defs = _one_of_calls(tools)
    calls: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        calls["maxItems"] = 1
    tool_calls = {"type": "object", "additionalProperties": False, "required": ["tool_calls"],
                  "properties": {"tool_calls": calls}}
    if forced:
        schema = tool_calls
    else:
        response = {"type": "object", "additionalProperties": False, "required": ["response"],
                    "properties": {"response": {"type": "string", "minLength": 1}}}
        schema = {"anyOf": [tool_calls, response]}
    return {**schema, "$defs": root_defs} if root_defs else schema


def native_grammar(tool_format: ToolCallFormat, tools: list[ToolSpec], parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect, JSON schemas inline with ``%json``) whose only
    sentences are calls of ``tools`` in ``tool_format``."""
    repeat = "+" if parallel else ""
    if tool_format == ToolCallFormat.HERMES:
        call = _call_document(tools)
        return f'start: block{repeat}\nblock: "<tool_call>\\n" call "\\n</tool_call>" "\\n"?\ncall: %json {call}\n'
    if tool_format == ToolCallFormat.LLAMA3:
        call = _call_document(tools, "parameters", typed=True)
        more = '("; " call)*' if parallel else ""
        return f'start: "<|python_tag|>"? call {more}\ncall: %json {call}\n'
    if tool_format == ToolCallFormat.MISTRAL:
        call = _call_document(tools)
        more = '(", " call)*' if parallel else ""
        return f'start: "[TOOL_CALLS]" "[" call {more} "]"\ncall: %json {call}\n'
    raise ValueError(f"no native grammar for {tool_format}")


def _call_document(tools: list[ToolSpec], arguments_key: str = "arguments", typed: bool = False) -> str:
    """One call's schema as a ``%json`` document of its own (its root carries the ``$defs``)."""
    call, root_defs = _one_of_calls(tools, arguments_key, typed)
    return json.dumps({**call, "$defs": root_defs} if root_defs else call)


def _compiled_schema(schema: dict[str, Any]) -> Constraint:
    try:
        return Constraint("tools", llguidance.LLMatcher.grammar_from_json_schema(schema, COMPACT_JSON))
    except Exception as exc:  # llguidance raises ValueError, and its converter assorted errors
        raise GrammarError(f"tools: a function's parameters cannot be compiled: {exc}", field="tools") from None


def _compiled_lark(lark: str) -> Constraint:
    try:
        return Constraint("tools", llguidance.LLMatcher.grammar_from_lark(lark))
    except Exception as exc:
        raise GrammarError(f"tools: a function's parameters cannot be compiled: {exc}", field="tools") from None


# ---------------------------------------------------------------------------- the conversation
def template_messages(request: GenerationParams, tool_format: ToolCallFormat) -> list[dict[str, Any]]:
    """The messages as the chat template receives them. Natively, a call's arguments are an object
    (Hugging Face's convention, which tool-aware templates serialise themselves). In the generic
    format, the tools are described in a system message, and calls and their results are written in
    plain words, the results as user messages (also when this reply may call none)."""
    messages = request.messages or []
    tool_turns = any(m.tool_calls or m.role == "tool" for m in messages)
    if tool_format != ToolCallFormat.GENERIC or not (request.tools or tool_turns):
        return [_native_message(m) for m in messages]
    names = {call.id: call.function.name for m in messages for call in m.tool_calls or ()}
    converted = [_generic_message(m, names) for m in messages]
    if not request.calls_tools:         # tool_choice none: earlier calls stay in the conversation, no new ones
        return converted
    instructions = _generic_instructions(request)
    if converted and converted[0]["role"] == "system":
        converted[0] = {**converted[0], "content": f"{converted[0]['content']}\n\n{instructions}"}
    else:
        converted.insert(0, {"role": "system", "content": instructions})
    return converted


def _native_message(message: ChatMessage) -> dict[str, Any]:
    out = message.model_dump(exclude_none=True)
    if message.tool_calls:
        out["tool_calls"] = [{"id": call.id, "type": "function",
                              "function": {"name": call.function.name,
                                           "arguments": json.loads(call.function.arguments)}}
                             for call in message.tool_calls]
    return out


def _generic_message(message: ChatMessage, names: dict[str, str]) -> dict[str, Any]:
    """Earlier calls and their results in plain words, not in the reply's JSON: a small model
    copies the shape of its previous turn, and with its call written as JSON the bundled 135M
    model called the same function again after every result, never answering. The reply itself
    stays grammar-constrained, so the history's wording cannot break its format. ``names``: each
    call's function by call id (OpenAI's tool messages carry only the id)."""
    if message.role == "tool":
        name = message.name or names.get(message.tool_call_id or "") or "the function"
        return {"role": "user", "content": f"Result of {name}: {message.content}"}
    if message.tool_calls:
        calls = ", ".join(f"{call.function.name}({call.function.arguments})" for call in message.tool_calls)
        return {"role": "assistant", "content": f"{message.content}\nCalling {calls}".strip()}
    return {"role": message.role, "content": message.content}


def _generic_instructions(request: GenerationParams) -> str:
    functions = [tool.function.model_dump(exclude_none=True, exclude={"strict"}) for tool in _allowed(request)]
    described = json.dumps(functions, ensure_ascii=False)
    if request.tool_choice == "auto":
        how = ("Respond in JSON, either with `tool_calls` (a list of calls of these functions, each with its "
               "`name` and `arguments`) or with `response` (your reply to the user).")
    else:
        how = ("Respond in JSON with `tool_calls`: a list of calls of these functions, each with its `name` and "
               "`arguments`.")
    return f"You can call these functions (`parameters` is the JSON schema of a call's arguments):\n{described}\n{how}"


# ---------------------------------------------------------------------------- reading the reply
# What starts a native call: its marker anywhere in the reply's content (after any thoughts), or (Llama
# 3) a reply that opens as a call object, as the reply parser reads one (LLAMA3_CALL_OPENINGS).
_MARKERS = {ToolCallFormat.HERMES: HERMES_OPEN.encode(), ToolCallFormat.MISTRAL: MISTRAL_CALLS.encode(),
            ToolCallFormat.LLAMA3: PYTHON_TAG.encode()}
_AFTER_BRACE = b"|".join(rb"\s*".join(re.escape(literal.encode()) for literal in opening[1:])
                         for opening in LLAMA3_CALL_OPENINGS)      # each opening is "{", then its literals
_LLAMA3_OPENING = re.compile(rb"\s*(\{)\s*(?:" + _AFTER_BRACE + rb")")
_OPENING_WINDOW = 64        # bytes of a reply's start (after whitespace) within which a Llama 3 call has opened
_THINK_OPEN, _THINK_CLOSE = THINK_OPEN.encode(), THINK_CLOSE.encode()


class CallTrigger:
    """Watches one choice's reply, token piece by token piece (bytes, as the model wrote them,
    before stop strings), for the start of a native call; :meth:`push` returns the reply from there
    on, once. Thoughts are skipped as the reply parser skips them (a ``<think>`` at the reply's
    start, or one the prompt opened, up to ``</think>``): a marker inside them is not a call. Holds
    only what a marker or the opening could still span, so it costs O(piece) per token."""

    def __init__(self, tool_format: ToolCallFormat, *, reasoning: bool, starts_in_reasoning: bool) -> None:
        self._marker = _MARKERS[tool_format]
        self._opening = _LLAMA3_OPENING if tool_format == ToolCallFormat.LLAMA3 else None
        self._buf = b""
        self._thinking: bool | None = True if starts_in_reasoning else (None if reasoning else False)
        self._opening_open = self._opening is not None     # the content's start may still open a call

    def push(self, piece: bytes) -> bytes | None:
        self._buf += piece
        if self._thinking is None:          # does the reply open with <think>?
            lead = self._buf.lstrip()
            if len(lead) < len(_THINK_OPEN) and _THINK_OPEN.startswith(lead):
                return None
            self._thinking = lead.startswith(_THINK_OPEN)
        if self._thinking:
            at = self._buf.find(_THINK_CLOSE)
            if at < 0:
                self._buf = self._buf[-(len(_THINK_CLOSE) - 1):]
                return None
            self._thinking = False
            self._buf = self._buf[at + len(_THINK_CLOSE):]
        if self._opening_open and self._opening is not None:
            opened = self._opening.match(self._buf)
            if opened is not None:
                return self._buf[opened.start(1):]
            self._buf = self._buf.lstrip()      # the opening's leading whitespace is no part of the call
            self._opening_open = not self._buf or (self._buf.startswith(b"{") and len(self._buf) < _OPENING_WINDOW)
        at = self._buf.find(self._marker)
        if at >= 0:
            return self._buf[at:]
        if not self._opening_open:
            self._buf = self._buf[-(len(self._marker) - 1):]
        return None


@dataclass(frozen=True)
class LazyCall:
    """A native ``auto`` call's grammar, armed when its :class:`CallTrigger` fires: ``matcher`` is
    its start state (compiled and checked at submit), ``tokenize`` spells bytes as the matcher's
    tokens (a marker that is a control token is fed as its text, as the grammar spells it)."""

    matcher: TokenMatcher
    tokenize: Callable[[bytes], list[int]]

    def arm(self, call: bytes) -> TokenMatcher:
        """A matcher past ``call`` (the reply from the call's start on). Raises :class:`ToolCallError`
        when what the model wrote there already breaks the grammar."""
        matcher = self.matcher.fork()
        if not matcher.follows(self.tokenize(call)):
            raise ToolCallError(f"the model's tool call does not match its format or the allowed functions: "
                                f"{call[:80].decode('utf-8', 'replace')!r}")
        return matcher


@dataclass(frozen=True)
class ReplySetup:
    """How one request's reply is read, token text by token text: what :class:`ReplyParser` each
    choice gets, and (native ``auto`` calls) the grammar armed at a call's start."""

    request_id: str
    tool_format: ToolCallFormat | None
    reasoning: bool
    starts_in_reasoning: bool
    lazy_call: LazyCall | None = None

    @property
    def special_tokens_as_text(self) -> bool:
        """Whether the reply's text must show control tokens: Mistral's ``[TOOL_CALLS]`` and Llama
        3's ``<|python_tag|>`` are control tokens, which plain text renders empty."""
        return self.tool_format in (ToolCallFormat.MISTRAL, ToolCallFormat.LLAMA3)

    def parser(self, choice: int) -> ReplyParser:
        return ReplyParser(tool_format=self.tool_format, call_id_prefix=call_id_prefix(self.request_id, choice),
                           reasoning=self.reasoning, starts_in_reasoning=self.starts_in_reasoning)

    def trigger(self) -> CallTrigger | None:
        """A new choice's watch for its first call (None: calls are constrained from the start, or none)."""
        if self.lazy_call is None or self.tool_format is None:
            return None
        return CallTrigger(self.tool_format, reasoning=self.reasoning, starts_in_reasoning=self.starts_in_reasoning)


def reply_setup(request: GenerationParams, request_id: str, prompt: str, plan: ToolPlan | None,
                lazy_call: LazyCall | None) -> ReplySetup | None:
    """None when the reply is plain text: a raw prompt, or a chat without tools whose think tags
    stay in the text (``reasoning_format`` none)."""
    reasoning = request.reasoning_format == "deepseek"
    if request.messages is None or (plan is None and not reasoning):
        return None
    return ReplySetup(request_id, plan.tool_format if plan else None, reasoning,
                      starts_in_reasoning=reasoning and prompt.rstrip().endswith("<think>"), lazy_call=lazy_call)


def call_id_prefix(request_id: str, choice: int) -> str:
    """Tool call ids derive from the request and the choice, so an attempt that resumes the reply
    gives the calls the ids the interrupted one streamed."""
    return "call_" + hashlib.sha256(f"{request_id}/{choice}".encode()).hexdigest()[:20]


__all__ = ["CallTrigger", "LazyCall", "ReplySetup", "ToolPlan", "call_id_prefix", "check_tools", "generic_schema",
           "native_grammar", "plan_tools", "reply_setup", "template_messages"]
