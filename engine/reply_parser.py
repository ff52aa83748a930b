"""Splits a model's reply into content, reasoning and tool calls, incrementally, one sequence at a time.

The runner feeds each choice's text here after UTF-8 assembly and stop strings. Text arrives in
arbitrary pieces (a marker such as ``<tool_call>`` or a ``\\u`` escape can be split across tokens), so
nothing is decided from one piece: the parser holds back only what could still change meaning and
streams the rest at once. Pure Python, no llama.cpp, no Redis.

The parser is a recursive-descent parser written as generators: each rule reads the unread buffer
and, when it needs more text than has arrived, yields until the next :meth:`ReplyParser.push`. The
state machine's state is therefore the generators' own position, and every format shares the same
rules: a JSON object, a call object, a string, an opaque value. At the end (:meth:`ReplyParser.finish`)
a rule that still needs text learns that no more is coming; ending is an error only inside a tool
call, because only there would the text be half-parsed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TypeVar

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from slotq.engine.errors import EngineError

_T = TypeVar("_T")
_Parse = Generator[None, None, _T]   # a parsing rule: yields while waiting for text, returns what it parsed

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
MISTRAL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
MISTRAL_CALL_ID = "[CALL_ID]"
PYTHON_TAG = "<|python_tag|>"
# How a Llama 3 call's JSON begins: its name (or llama.cpp's optional "type": "function") first, or
# its parameters, which a model may write before the name. A reply that begins with another object
# is a JSON answer, not a call.
LLAMA3_CALL_OPENINGS = (("{", '"name"', ":"), ("{", '"type"', ":", '"function"', ","), ("{", '"parameters"', ":"))
ARGUMENT_KEYS = ("arguments", "parameters")   # Llama 3.x writes "parameters"; the other formats "arguments"

_NON_SPACE = re.compile(r"\S")
_STRING_SPECIAL = re.compile(r'["\\]')          # what ends a run of plain characters inside a JSON string
_STRUCTURE = re.compile(r'["{}\[\]]')           # what changes nesting outside JSON strings
_SCALAR_END = re.compile(r"[\s,\]}]")           # what ends a number, true, false or null
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.\-]*")   # a function name in Mistral's [TOOL_CALLS]name[ARGS] form
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class ToolCallFormat(StrEnum):
    """How a model family writes tool calls in its reply."""

    GENERIC = "generic"      # llama-server's format for templates without tools: the whole reply is JSON,
                             # {"tool_calls": [{"name": ..., "arguments": {...}}, ...]} or {"response": "text"}
    HERMES = "hermes"        # Qwen 2.5/3, Hermes 2/3: text, then one or more
                             # <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
    LLAMA3 = "llama3_json"   # Llama 3.1-3.3: {"name": ..., "parameters": {...}} (maybe after <|python_tag|>;
                             # several separated by ';')
    MISTRAL = "mistral"      # [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]; also [TOOL_CALLS]name[ARGS]{...}


_TEMPLATE_PARSER = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])


def template_renders_tools(template_source: str | None) -> bool:
    """Whether a GGUF's Jinja chat template reads a ``tools`` variable, i.e. can show the model its tools.

    Decided from the template's syntax tree (the variables it reads from its context), not by looking
    for the word, so a comment or a ``set tools = none`` alone does not count; a template Jinja cannot
    parse falls back to the word, since rendering it will fail anyway and say why.
    """
    if template_source is None:
        return False
    try:
        syntax_tree = _TEMPLATE_PARSER.parse(template_source)
    except jinja2.TemplateSyntaxError:
        return re.search(r"\btools\b", template_source) is not None
    return "tools" in jinja2.meta.find_undeclared_variables(syntax_tree)


def detect_tool_format(template_source: str | None) -> ToolCallFormat:
    """The call format a model writes, from its chat template (as llama.cpp's common_chat picks one).

    HERMES if the template mentions ``<tool_call>``, MISTRAL for ``[TOOL_CALLS]``, LLAMA3 for
    ``<|python_tag|>`` / ``ipython``. GENERIC when the template does not render ``tools`` at all (or is
    None), and also when it does in a format none of these parse: the generic format's instructions
    and grammar then work on any model, as llama-server's fallback does.
    """
    if template_source is None or not template_renders_tools(template_source):
        return ToolCallFormat.GENERIC
    if HERMES_OPEN in template_source:
        return ToolCallFormat.HERMES
    if MISTRAL_CALLS in template_source:
        return ToolCallFormat.MISTRAL
    if PYTHON_TAG in template_source or "ipython" in template_source:
        return ToolCallFormat.LLAMA3
    return ToolCallFormat.GENERIC


@dataclass(frozen=True)
class ToolCallDelta:
    """One piece of a streamed tool call, as OpenAI's ``delta.tool_calls[i]``."""

    index: int
    id: str | None = None      # on the first delta of a call only
    name: str | None = None    # on the first delta of a call only (emitted once the name is complete)
    arguments: str = ""        # the next fragment of the arguments' JSON text


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str             # the arguments' complete JSON text (an object), exactly the concatenated fragments


@dataclass
class ReplyDelta:
    """What one push (or the finish) adds to the reply."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallError(EngineError):
    """The model wrote a tool call that cannot be used: unfinished, not JSON, or arguments that are
    not a JSON object. Not retryable: the same request replays the same tokens."""

    code = "invalid_tool_call"
    retryable = False


class _ReplyEnded(Exception):
    """A rule needed more text after :meth:`ReplyParser.finish`; an error only inside a tool call."""


@dataclass
class _OpenCall:
    """A call being parsed: its arguments are kept until its name is known, since a model may write
    "arguments" before "name" and the first delta must carry the name."""

    index: int
    id: str
    name: str | None = None
    arguments: list[str] = field(default_factory=list)
    has_arguments: bool = False


class ReplyParser:
    """Incremental parser of one sequence's reply.

    ``tool_format`` None: the request has no tools; only think tags are split (when ``reasoning``).
    Call ids are ``f"{call_id_prefix}_{index}"``: deterministic, so a resumed attempt that replays the
    same text produces the same ids. ``starts_in_reasoning``: the rendered prompt already opened
    ``<think>``. Reasoning follows llama-server's ``--reasoning-format deepseek``: only at the very start
    of the reply (after whitespace) does ``<think>`` open it; the reasoning is stripped of surrounding
    whitespace, and whitespace after ``</think>`` is not content. With a tool format, content is
    stripped around each call (whitespace between calls is dropped); without one it is verbatim.
    """

    def __init__(
        self,
        *,
        tool_format: ToolCallFormat | None,
        call_id_prefix: str,
        reasoning: bool = True,
        starts_in_reasoning: bool = False,
    ) -> None:
        self._tool_format = tool_format
        self._call_id_prefix = call_id_prefix
        self._reasoning = reasoning
        self._starts_in_reasoning = starts_in_reasoning
        self._buf = ""             # text received and not yet consumed starts at _pos
        self._pos = 0
        self._dropped = 0          # characters of the reply consumed and dropped before _buf: errors name positions
        self._ended = False
        self._out = ReplyDelta()   # what the current push has produced
        self._calls: list[ToolCall] = []
        self._inside: str | None = None   # where the reply must not end, phrased for the error ("inside tool call 0")
        self._error: ToolCallError | None = None
        self._unfinished = False   # the error is only that the reply ended inside a call
        self._running = True
        self._thinking = False     # inside the reply's think block (opened, not yet closed)
        self._steps = self._reply()

    def push(self, text: str) -> ReplyDelta:
        """Parse the next piece of the reply; returns what can be delivered now. Never raises: a
        broken call is reported by :attr:`error` at once and raised by :meth:`finish`."""
        self._dropped += self._pos
        self._buf = self._buf[self._pos:] + text
        self._pos = 0
        return self._step()

    def finish(self, *, cut: bool = False) -> ReplyDelta:
        """Flush what was held back. Raises ToolCallError naming what is wrong when a call began but is
        unfinished or its arguments are not a JSON object ('the model's tool call is not valid JSON: ...').
        A reply ``cut`` by its length limit may end inside a call: it keeps what the call got, as
        OpenAI answers ``finish_reason: length`` with the call's arguments as far as they came."""
        self._ended = True
        delta = self._step()
        if self._error is not None and not (cut and self._unfinished):
            raise self._error
        return delta

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The complete calls so far."""
        return list(self._calls)

    @property
    def thinking(self) -> bool:
        """Whether the text pushed so far leaves the reply inside its think block: a runner counts
        the tokens that are (and the one that closes it) as the reply's reasoning tokens."""
        return self._thinking

    @property
    def error(self) -> ToolCallError | None:
        """Set as soon as the reply can no longer be valid (before :meth:`finish` raises it), so a runner
        can stop generating early; later pushes deliver nothing."""
        return self._error

    def _step(self) -> ReplyDelta:
        if self._running:
            try:
                next(self._steps)
            except StopIteration:
                self._running = False
            except _ReplyEnded:
                self._running = False
                if self._inside is not None:
                    self._unfinished = True
                    self._error = ToolCallError(f"the model's tool call is unfinished: the reply ended {self._inside}")
            except ToolCallError as exc:
                self._running = False
                self._error = exc
        delta, self._out = self._out, ReplyDelta()
        return delta

    # -- the reply's shape, per format ------------------------------------------------------------------

    def _reply(self) -> _Parse[None]:
        if self._reasoning:
            yield from self._thoughts()
        match self._tool_format:
            case None:
                yield from self._text((), self._emit_content, trim=False)
            case ToolCallFormat.HERMES:
                yield from self._calls_after_markers(HERMES_OPEN, self._hermes_call)
            case ToolCallFormat.MISTRAL:
                yield from self._calls_after_markers(MISTRAL_CALLS, self._mistral_calls)
            case ToolCallFormat.LLAMA3:
                lead = yield from self._lead(("{", PYTHON_TAG))
                if lead == PYTHON_TAG or (lead == "{" and (yield from self._opens(LLAMA3_CALL_OPENINGS))):
                    yield from self._llama3_calls()
                yield from self._calls_after_markers(PYTHON_TAG, self._llama3_calls)
            case ToolCallFormat.GENERIC:
                yield from self._generic()

    def _thoughts(self) -> _Parse[None]:
        if not self._starts_in_reasoning:
            if (yield from self._lead((THINK_OPEN,))) is None:
                return
            self._pos += len(THINK_OPEN)
        self._thinking = True
        yield from self._text((THINK_CLOSE,), self._emit_reasoning, trim=True)
        self._thinking = False
        yield from self._drop_whitespace()

    def _calls_after_markers(self, marker: str, calls: Callable[[], _Parse[None]]) -> _Parse[None]:
        """Content, and after each ``marker`` the calls it introduces, until the reply ends."""
        while (yield from self._text((marker,), self._emit_content, trim=True)) is not None:
            self._inside = f"after {marker}"
            yield from calls()
            self._inside = None

    def _hermes_call(self) -> _Parse[None]:
        yield from self._call_object()
        self._inside = f"before {HERMES_CLOSE}"
        yield from self._skip_whitespace()
        yield from self._expect((HERMES_CLOSE,), "malformed")

    def _mistral_calls(self) -> _Parse[None]:
        if (yield from self._skip_whitespace()) == "[":
            yield from self._call_list()
        else:
            yield from self._mistral_named_call()

    def _mistral_named_call(self) -> _Parse[None]:
        """The newer form, ``name[ARGS]{...}`` (``[CALL_ID]id`` may sit between: our ids replace it)."""
        call = self._begin_call()
        name = yield from self._take(_NAME_CHARS)
        if (yield from self._expect((MISTRAL_ARGS, MISTRAL_CALL_ID), "malformed")) == MISTRAL_CALL_ID:
            yield from self._take(_NAME_CHARS)
            yield from self._expect((MISTRAL_ARGS,), "malformed")
        self._name_call(call, name)
        yield from self._skip_whitespace()
        yield from self._arguments(call)
        self._complete_call(call)

    def _llama3_calls(self) -> _Parse[None]:
        """One or more JSON calls, each maybe after ``<|python_tag|>``, separated by ';' or whitespace."""
        while True:
            if (yield from self._lead((PYTHON_TAG,))) is not None:
                self._pos += len(PYTHON_TAG)
            yield from self._call_object()
            if (yield from self._lead((";",))) is not None:
                self._pos += 1
            if (yield from self._lead(("{", PYTHON_TAG))) is None:
                return

    def _generic(self) -> _Parse[None]:
        """A JSON object with "tool_calls", "tool_call" or "response"; a reply that is not JSON at all
        (a model that ignored the format) is plain content."""
        if (yield from self._lead(("{",))) is None:
            yield from self._text((), self._emit_content, trim=False)
            return
        known: list[str] = []

        def member(key: str) -> _Parse[None]:
            if key == "tool_calls":
                known.append(key)
                yield from self._call_list()
            elif key == "tool_call":
                known.append(key)
                yield from self._call_object()
            elif key == "response":
                known.append(key)
                if (yield from self._peek()) == '"':
                    yield from self._string(self._emit_content)
                else:   # a response_format's object: its JSON text is the content
                    yield from self._raw_value(self._emit_content)
            else:
                yield from self._skip_value()

        yield from self._object(member)
        if not known:
            raise ToolCallError('the model\'s reply has neither "tool_calls" nor "response" (generic tool-call format)')
        yield from self._skip_whitespace()
        raise self._syntax_error("the end of the reply after its JSON object", "not valid JSON")

    # -- tool calls ---------------------------------------------------------------------------------------

    def _call_list(self) -> _Parse[None]:
        outer, self._inside = self._inside, "inside the list of tool calls"
        yield from self._expect(("[",), "not valid JSON")
        if (yield from self._skip_whitespace()) == "]":
            self._pos += 1
        else:
            while True:
                yield from self._call_object()
                yield from self._skip_whitespace()
                if (yield from self._expect((",", "]"), "not valid JSON")) == "]":
                    break
        self._inside = outer

    def _call_object(self) -> _Parse[None]:
        """``{"name": ..., "arguments": {...}}`` (other members are checked and ignored)."""
        outer = self._inside
        yield from self._skip_whitespace()
        call = self._begin_call()

        def member(key: str) -> _Parse[None]:
            if key == "name":
                if (yield from self._peek()) != '"':
                    raise self._syntax_error("the function name as a string", "not valid JSON")
                self._name_call(call, (yield from self._string_value()))
            elif key in ARGUMENT_KEYS:
                yield from self._arguments(call)
            else:
                yield from self._skip_value()

        yield from self._object(member)
        self._complete_call(call)
        self._inside = outer

    def _arguments(self, call: _OpenCall) -> _Parse[None]:
        """Streams the arguments' JSON text. A string is taken as the arguments' JSON encoded in a string,
        as OpenAI's API itself sends them, and is decoded."""
        if call.has_arguments:
            raise ToolCallError(f"the model's tool call {call.index} has its arguments twice")
        call.has_arguments = True
        first = yield from self._peek()
        if first == "{":
            yield from self._raw_value(lambda text: self._add_arguments(call, text))
        elif first == '"':
            yield from self._string(lambda text: self._add_arguments(call, text))
        else:
            raise self._syntax_error(f"tool call {call.index}'s arguments as a JSON object", "not valid")

    def _begin_call(self) -> _OpenCall:
        index = len(self._calls)
        self._inside = f"inside tool call {index}"
        return _OpenCall(index=index, id=f"{self._call_id_prefix}_{index}")

    def _name_call(self, call: _OpenCall, name: str) -> None:
        if call.name is not None:
            raise ToolCallError(f"the model's tool call {call.index} has two names")
        if not name:
            raise ToolCallError(f"the model's tool call {call.index} has an empty name")
        call.name = name
        self._emit_call(ToolCallDelta(index=call.index, id=call.id, name=name, arguments="".join(call.arguments)))

    def _add_arguments(self, call: _OpenCall, text: str) -> None:
        if not text:
            return
        call.arguments.append(text)
        if call.name is not None:
            self._emit_call(ToolCallDelta(index=call.index, arguments=text))

    def _complete_call(self, call: _OpenCall) -> None:
        if call.name is None:
            raise ToolCallError(f"the model's tool call {call.index} has no name")
        if not call.has_arguments:   # a function without parameters, written without "arguments"
            self._add_arguments(call, "{}")
        arguments = "".join(call.arguments)
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ToolCallError(f"the model's tool call is not valid JSON: {call.name}'s arguments: {exc}") from exc
        if not isinstance(value, dict):
            start = arguments[:40]
            raise ToolCallError(f"the model's tool call {call.name}'s arguments are not a JSON object: {start!r}")
        self._calls.append(ToolCall(id=call.id, name=call.name, arguments=arguments))

    # -- output ---------------------------------------------------------------------------------------------

    def _emit_content(self, text: str) -> None:
        self._out.content += text

    def _emit_reasoning(self, text: str) -> None:
        self._out.reasoning += text

    def _emit_call(self, delta: ToolCallDelta) -> None:
        """One delta per call per push: a fragment joins the previous one of the same call."""
        deltas = self._out.tool_calls
        if deltas and deltas[-1].index == delta.index and delta.name is None:
            deltas[-1] = replace(deltas[-1], arguments=deltas[-1].arguments + delta.arguments)
        else:
            deltas.append(delta)

    # -- text -----------------------------------------------------------------------------------------------

    def _text(self, markers: tuple[str, ...], emit: Callable[[str], None], *, trim: bool) -> _Parse[str | None]:
        """Emits text up to the first of ``markers`` and consumes it; returns it, or None at the end.

        Only a suffix that could be the start of a marker is held back (and, with ``trim``, the
        whitespace before it, which is dropped when a marker follows): everything else is emitted
        as soon as it arrives.
        """
        if trim:
            yield from self._drop_whitespace()
        while True:
            buf, pos = self._buf, self._pos
            found = [(at, marker) for marker in markers if (at := buf.find(marker, pos)) >= 0]
            if found:
                at, marker = min(found)
                text = buf[pos:at]
                emit(text.rstrip() if trim else text)
                self._pos = at + len(marker)
                return marker
            end = len(buf) if self._ended else len(buf) - _partial_marker_len(buf, pos, markers)
            text = buf[pos:end].rstrip() if trim else buf[pos:end]
            emit(text)
            self._pos = pos + len(text)
            if self._ended:
                return None
            yield

    def _drop_whitespace(self) -> _Parse[None]:
        """Consumes whitespace, waiting while only whitespace arrives; ending here is fine."""
        while (match := _NON_SPACE.search(self._buf, self._pos)) is None:
            self._pos = len(self._buf)
            if self._ended:
                return
            yield
        self._pos = match.start()

    def _lead(self, literals: tuple[str, ...]) -> _Parse[str | None]:
        """Which of ``literals`` the unread text starts with after whitespace: on a match the whitespace
        is consumed (not the literal), otherwise nothing is. Waits while the text could still match."""
        while True:
            match = _NON_SPACE.search(self._buf, self._pos)
            if match is not None:
                ahead = self._buf[match.start():]
                for literal in literals:
                    if ahead.startswith(literal):
                        self._pos = match.start()
                        return literal
                if self._ended or not any(literal.startswith(ahead) for literal in literals):
                    return None
            elif self._ended:
                return None
            yield

    def _opens(self, openings: tuple[tuple[str, ...], ...]) -> _Parse[bool]:
        """Whether the unread text starts with one of ``openings`` (each a sequence of literals, with
        any whitespace between them); consumes nothing. Waits while the text could still match."""
        while True:
            undecided = False
            for opening in openings:
                at = self._pos
                for literal in opening:
                    match = _NON_SPACE.search(self._buf, at)
                    ahead = self._buf[match.start():match.start() + len(literal)] if match else ""
                    if ahead != literal:
                        undecided |= literal.startswith(ahead) and not self._ended
                        break
                    at = match.start() + len(literal) if match else at
                else:
                    return True
            if not undecided:
                return False
            yield

    # -- reading primitives: each waits for text, and raises _ReplyEnded when none will come ---------------

    def _wait(self, count: int = 1) -> _Parse[None]:
        while len(self._buf) - self._pos < count:
            if self._ended:
                raise _ReplyEnded
            yield

    def _peek(self) -> _Parse[str]:
        yield from self._wait()
        return self._buf[self._pos]

    def _skip_whitespace(self) -> _Parse[str]:
        """Consumes whitespace; returns the next character, unconsumed."""
        yield from self._drop_whitespace()
        return (yield from self._peek())

    def _expect(self, literals: tuple[str, ...], problem: str) -> _Parse[str]:
        """Consumes one of ``literals``, which must come next."""
        while True:
            ahead = self._buf[self._pos:self._pos + max(map(len, literals))]
            for literal in literals:
                if ahead.startswith(literal):
                    self._pos += len(literal)
                    return literal
            if not any(literal.startswith(ahead) for literal in literals):
                raise self._syntax_error(" or ".join(map(repr, literals)), problem)
            yield from self._wait(len(ahead) + 1)

    def _take(self, pattern: re.Pattern[str]) -> _Parse[str]:
        """Consumes the longest run matching ``pattern`` (a repeated character class) that has ended."""
        parts: list[str] = []
        while True:
            yield from self._wait()
            run = pattern.match(self._buf, self._pos)
            end = run.end() if run else self._pos
            parts.append(self._buf[self._pos:end])
            self._pos = end
            if end < len(self._buf):
                return "".join(parts)

    def _syntax_error(self, expected: str, problem: str) -> ToolCallError:
        """Names the position in the whole reply and the character found there, which do not depend on
        how the reply was split into pieces (a resumed attempt reports the same error)."""
        found = self._buf[self._pos:self._pos + 1]
        return ToolCallError(
            f"the model's tool call is {problem}: expected {expected} at character {self._dropped + self._pos} "
            f"of the reply, found {found!r}"
        )

    # -- JSON: the one scanner every format shares ---------------------------------------------------------

    def _object(self, member: Callable[[str], _Parse[None]]) -> _Parse[None]:
        """A JSON object; ``member(key)`` parses each value. Duplicate keys are refused: which one
        would count is ambiguous."""
        yield from self._skip_whitespace()
        yield from self._expect(("{",), "not valid JSON")
        if (yield from self._skip_whitespace()) == "}":
            self._pos += 1
            return
        keys: set[str] = set()
        while True:
            if (yield from self._skip_whitespace()) != '"':
                raise self._syntax_error("a member name in quotes", "not valid JSON")
            key = yield from self._string_value()
            if key in keys:
                raise ToolCallError(f"the model's tool call is not valid JSON: the key {key!r} appears twice")
            keys.add(key)
            yield from self._skip_whitespace()
            yield from self._expect((":",), "not valid JSON")
            yield from self._skip_whitespace()
            yield from member(key)
            yield from self._skip_whitespace()
            if (yield from self._expect((",", "}"), "not valid JSON")) == "}":
                return

    def _string_value(self) -> _Parse[str]:
        parts: list[str] = []
        yield from self._string(parts.append)
        return "".join(parts)

    def _string(self, emit: Callable[[str], None]) -> _Parse[None]:
        """A JSON string, decoded and emitted piece by piece as its characters become certain."""
        yield from self._expect(('"',), "not valid JSON")
        while True:
            yield from self._wait()
            special = _STRING_SPECIAL.search(self._buf, self._pos)
            end = special.start() if special else len(self._buf)
            emit(self._buf[self._pos:end])
            self._pos = end
            if special is None:
                continue
            self._pos += 1
            if special.group() == '"':
                return
            emit((yield from self._escape()))

    def _escape(self) -> _Parse[str]:
        """The character after a backslash; a surrogate pair's two halves may arrive in two pushes."""
        yield from self._wait()
        letter = self._buf[self._pos]
        self._pos += 1
        if letter in _ESCAPES:
            return _ESCAPES[letter]
        if letter != "u":
            self._pos -= 2
            raise self._syntax_error("a valid escape", "not valid JSON")
        code = yield from self._hex4()
        if 0xD800 <= code < 0xDC00:
            low = yield from self._low_surrogate()
            return "\ufffd" if low is None else chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00))
        return "\ufffd" if 0xDC00 <= code < 0xE000 else chr(code)   # a lone half cannot be encoded as UTF-8

    def _hex4(self) -> _Parse[int]:
        yield from self._wait(4)
        digits = self._buf[self._pos:self._pos + 4]
        if not re.fullmatch(r"[0-9A-Fa-f]{4}", digits):
            raise self._syntax_error("four hex digits after \\u", "not valid JSON")
        self._pos += 4
        return int(digits, 16)

    def _low_surrogate(self) -> _Parse[int | None]:
        """The ``\\uDC00``-``\\uDFFF`` escape completing a pair, consumed; None (nothing consumed) when the
        text goes on otherwise."""
        while True:
            ahead = self._buf[self._pos:self._pos + 6]
            if not "\\u".startswith(ahead[:2]):
                return None
            if len(ahead) == 6:
                if not re.fullmatch(r"[0-9A-Fa-f]{4}", ahead[2:]) or not 0xDC00 <= int(ahead[2:], 16) < 0xE000:
                    return None   # not a low half: the next _escape reads (or refuses) it
                self._pos += 6
                return int(ahead[2:], 16)
            yield from self._wait(len(ahead) + 1)

    def _raw_value(self, emit: Callable[[str], None] | None) -> _Parse[str]:
        """One JSON value as its raw text, emitted as soon as each character is known to be inside it
        (strings, escapes and nesting tracked; not validated: callers json.loads what they keep)."""
        parts: list[str] = []

        def take(end: int) -> None:
            text = self._buf[self._pos:end]
            self._pos = end
            if text:
                parts.append(text)
                if emit is not None:
                    emit(text)

        scalar = (yield from self._peek()) not in '{["'
        depth, in_string, escaped = 0, False, False
        while True:
            yield from self._wait()
            if escaped:
                take(self._pos + 1)
                escaped = False
                continue
            pattern = _SCALAR_END if scalar else _STRING_SPECIAL if in_string else _STRUCTURE
            found = pattern.search(self._buf, self._pos)
            if found is None:
                take(len(self._buf))
                continue
            if scalar:
                take(found.start())
                return "".join(parts)
            take(found.end())
            mark = found.group()
            if mark == "\\":
                escaped = True
            elif mark == '"':
                in_string = not in_string
            else:
                depth += 1 if mark in "{[" else -1
            if depth == 0 and not in_string:
                return "".join(parts)

    def _skip_value(self) -> _Parse[None]:
        text = yield from self._raw_value(None)
        try:
            json.loads(text)
        except json.JSONDecodeError as exc:
            raise ToolCallError(f"the model's tool call is not valid JSON: {exc}: {text[:80]!r}") from exc


def _partial_marker_len(text: str, start: int, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text[start:]`` that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text) - start), best, -1):
            if text.endswith(marker[:length]):
                best = length
                break
    return best
