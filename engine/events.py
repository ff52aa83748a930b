"""What the engine streams back for a request: text deltas, then one final event per choice."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar

from pydantic import BaseModel, Field

from slotq.engine.reply_parser import ToolCallDelta


class FinishReason(StrEnum):
    STOP = "stop"            # EOS or a stop string
    TOOL_CALLS = "tool_calls"  # ended after calling tools (the reply's calls are complete and checked)
    LENGTH = "length"        # max_tokens or the per-sequence context was reached
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    ERROR = "error"


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = Field(0, description="prompt tokens whose KV was reused, not recomputed")
    reasoning_tokens: int = Field(
        0, description="of completion_tokens, those of the reply's think block (its tags included)")


class Timings(BaseModel):
    queue_ms: float = Field(0.0, description="submit -> admitted into a slot")
    ttft_ms: float | None = Field(None, description="submit -> first generated token")
    total_ms: float = 0.0
    decode_tokens_per_s: float | None = Field(None, description="generated tokens / time after the first token")


class ErrorInfo(BaseModel):
    code: str
    message: str
    retryable: bool
    field: str | None = Field(None, description="the request field at fault, when one is (e.g. max_tokens)")


class TopLogprob(BaseModel):
    """One token and its log probability under the model's own distribution at that position: the
    raw logits' log-softmax, before temperature, penalties, logit bias and constraints (as OpenAI
    and llama-server report it)."""

    id: int
    token: str = Field(description="the token's text; a piece that is not whole UTF-8 reads 'bytes:\\xe2\\x80' "
                                   "as OpenAI writes it")
    token_bytes: list[int] = Field(description="the token's bytes as it appears in generated text")
    logprob: float


class TokenLogprob(TopLogprob):
    """A generated token's log probability and the ``top`` most likely tokens at its position,
    most likely first (as many as the request's ``logprobs``)."""

    top: list[TopLogprob] = Field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class TextDelta:
    """New output for one choice. ``token_ids`` are exactly the tokens it came from, so a
    consumer that stores them can resume generation after a crash (prompt + delivered tokens).
    A chat reply is split as it streams (:mod:`slotq.engine.reply_parser`): ``text`` is what the
    reply says, ``reasoning`` what it thought (think tags), ``tool_calls`` the next pieces of its calls.
    ``logprobs``: one per token id, in the same order, when the request asked for them.
    ``prompt_tokens`` / ``cached_prompt_tokens``: on a choice's first delta only (0 on the others),
    its prompt's tokens and those whose KV was reused, as its ``Finished`` usage will say: a consumer
    that reports the prompt up front (Anthropic's ``message_start``) has it with the first token.

    A slotted dataclass, not a pydantic model: the engine thread makes one per token of every
    sequence, and nothing it holds needs validating (about 0.3 us to build instead of 3.3)."""

    kind: ClassVar[str] = "delta"
    request_id: str
    choice: int = 0
    text: str
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    token_ids: list[int]
    n_tokens: int                       # tokens generated so far for this choice, including these
    logprobs: list[TokenLogprob] | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0


class Finished(BaseModel):
    """The last event of one choice."""

    kind: str = "finished"
    request_id: str
    choice: int = 0
    finish_reason: FinishReason
    stop_sequence: str | None = Field(None, description="finish_reason stop: the stop string that ended it "
                                                        "(None: the model's end of turn)")
    usage: Usage
    timings: Timings
    error: ErrorInfo | None = None


Event = TextDelta | Finished
