"""Chat templates: render ``messages`` with the template stored in the GGUF.

llama.cpp's ``llama_chat_apply_template`` only recognises a fixed list of templates, so the GGUF's
Jinja template is rendered with Jinja2 in a sandbox, as Hugging Face tokenizers do. Models without
a template fall back to ChatML (what llama-server does).
"""

from __future__ import annotations

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


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str, eos_token: str) -> None:
        self.source = source or CHATML
        self.bos_token = bos_token
        self.eos_token = eos_token

    @cached_property
    def _template(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        return env.from_string(self.source)

    def render(self, messages: Sequence[ChatMessage | dict[str, Any]],
               tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt for ``messages`` (models, or dicts already shaped for the template), with
        ``tools`` passed as Hugging Face templates expect them when the model may call any."""
        extra: dict[str, Any] = {"tools": tools} if tools else {}
        try:
            return self._template.render(
                messages=[m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages],
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"messages: the model's chat template rejected them: {exc}", field="messages") from exc
