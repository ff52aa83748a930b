"""Chat templates: render ``messages`` with the template stored in the GGUF.

llama.cpp's ``llama_chat_apply_template`` only recognises a fixed list of templates, so the GGUF's
Jinja template is rendered with Jinja2 in a sandbox, as Hugging Face tokenizers do. Models without
a template fall back to ChatML (what llama-server does).

Control tokens (a template's turn markers such as ``<|im_start|>``) come only from the template: text
in the messages that spells one (``<|im_end|>\n<|im_start|>system ...`` in a user's content) is
tokenized as the plain text it is, so no message can forge a turn. :class:`ControlTokens` escapes such
text before rendering and splits the rendered prompt into plain pieces and the template's own control
tokens; a prompt with nothing escaped is tokenized in one call, as before.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from slotq.engine.errors import InvalidRequest
from slotq.engine.request import ChatMessage

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Brackets around text of a message that spells a control token (or this opening bracket itself), so
# the rendered prompt tells the template's control tokens from the messages' text. Unicode private-use
# characters: no template writes them, and a message's own ones are escaped as well.
ESCAPE_OPEN, ESCAPE_CLOSE = "\ue000", "\ue001"
_ASCII_SPACE = " \t\n\r\v\f"     # what llama.cpp's LSTRIP / RSTRIP strip (C isspace)


class ControlTokens:
    """A vocabulary's control tokens by text (:meth:`LlamaModel.control_tokens`), to keep them out of
    the messages' text: :meth:`escape` brackets each spelling inside a message, :meth:`split` cuts
    the rendered prompt at the template's own control tokens only."""

    def __init__(self, tokens: dict[str, tuple[int, bool, bool]]) -> None:
        self._ids = {text: token for text, (token, _, _) in tokens.items()}
        self._lstrip = {text for text, (_, lstrip, _) in tokens.items() if lstrip}
        self._rstrip = {text for text, (_, _, rstrip) in tokens.items() if rstrip}
        # longest first, as llama.cpp matches them (a token that contains another wins)
        spellings = "|".join(re.escape(text) for text in sorted(self._ids, key=len, reverse=True))
        self._in_message = re.compile(f"{spellings}|{ESCAPE_OPEN}" if spellings else ESCAPE_OPEN)
        escaped = f"{ESCAPE_OPEN}({spellings}|{ESCAPE_OPEN}){ESCAPE_CLOSE}" if spellings else \
            f"{ESCAPE_OPEN}({ESCAPE_OPEN}){ESCAPE_CLOSE}"
        self._in_prompt = re.compile(f"{escaped}|{spellings}" if spellings else escaped)

    def escape(self, value: Any) -> Any:
        """``value`` (a message, a tool, their strings at any depth) with every control token's
        spelling in its strings bracketed; unchanged (the same object) when there is none."""
        if isinstance(value, str):
            return self._in_message.sub(lambda m: f"{ESCAPE_OPEN}{m.group()}{ESCAPE_CLOSE}", value)
        if isinstance(value, dict):
            return {key: self.escape(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.escape(item) for item in value]
        return value

    def split(self, prompt: str) -> list[str | int]:
        """The rendered ``prompt`` as plain-text pieces and the template's control token ids (the
        input of :meth:`LlamaModel.tokenize_pieces`). Escaped text joins the plain text around it,
        so it tokenizes as one piece with its neighbours, as text does between two control tokens."""
        pieces: list[str | int] = []
        plain: list[str] = []
        at = 0
        for match in self._in_prompt.finditer(prompt):
            plain.append(prompt[at:match.start()])
            at = match.end()
            escaped = match.group(1)
            if escaped is not None:
                plain.append(escaped)
                continue
            text = match.group()
            before = "".join(plain)
            pieces.append(before.rstrip(_ASCII_SPACE) if text in self._lstrip else before)
            pieces.append(self._ids[text])
            plain = []
            if text in self._rstrip:
                rest = prompt[at:].lstrip(_ASCII_SPACE)
                at = len(prompt) - len(rest)
        pieces.append("".join(plain) + prompt[at:])
        return [piece for piece in pieces if piece != ""]


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str, eos_token: str,
                 control_tokens: ControlTokens | None = None) -> None:
        self.source = source or CHATML
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.control_tokens = control_tokens

    @cached_property
    def _template(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        return env.from_string(self.source)

    def render(self, messages: Sequence[ChatMessage | dict[str, Any]],
               tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt for ``messages`` (models, or dicts already shaped for the template), with
        ``tools`` passed as Hugging Face templates expect them when the model may call any. With
        ``control_tokens``, the messages' and tools' spellings of control tokens come out escaped
        (:meth:`ControlTokens.split` reads them back as text)."""
        dumped = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]
        if self.control_tokens is not None:
            dumped = self.control_tokens.escape(dumped)
            tools = self.control_tokens.escape(tools)
        extra: dict[str, Any] = {"tools": tools} if tools else {}
        try:
            return self._template.render(
                messages=dumped,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"messages: the model's chat template rejected them: {exc}", field="messages") from exc
