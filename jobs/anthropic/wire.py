"""Anthropic's Messages API as pydantic models: the bodies of ``/v1/messages`` and
``/v1/messages/count_tokens``, and the Message object a reply is.

Requests are checked for shape here, with Anthropic's own bounds where they are tighter than
slotq's (``temperature`` at most 1, ``max_tokens`` required); every other limit is the job layer's,
reported under these names by :mod:`slotq.jobs.anthropic.translate`. What slotq cannot honour is
refused by name (image and document blocks, server tools such as web search, MCP servers, a
container); what changes nothing here is accepted and ignored (``cache_control``: slotq reuses a
prompt's prefix by itself; ``service_tier``, ``inference_geo``, ``speed``, ``output_config.effort``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from slotq.jobs.openai.wire import SlotqInfo, text_parts

# Fields of Anthropic's API that change nothing on slotq: accepted and dropped.
_IGNORED = ("service_tier", "inference_geo", "speed", "cache_control", "diagnostics", "user_profile_id",
            "workspace_id")
# Fields slotq cannot honour: dropped when null, refused by name otherwise.
_REFUSED = {"container": "containers run Anthropic's code execution tool, which slotq does not host",
            "mcp_servers": "slotq does not connect to MCP servers: run the MCP client in your app and pass its "
                           "tools as function tools",
            "context_management": "slotq does not edit a conversation's context: send the messages to run"}
# Content blocks slotq reads, per role; any other type is refused by name.
USER_BLOCKS = ("text", "tool_result")
ASSISTANT_BLOCKS = ("text", "tool_use", "thinking", "redacted_thinking")


class _Block(BaseModel):
    """A content block: ``cache_control`` and ``citations`` (echoed back from a reply) are accepted
    and ignored, as in every block of a request."""

    model_config = ConfigDict(extra="ignore")


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    """A call an earlier assistant turn made (sent back with the conversation)."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=200)
    name: str = Field(min_length=1, max_length=64)
    input: dict[str, Any]


class ToolResultBlock(_Block):
    """What a tool returned, for the call ``tool_use_id`` names: text, or text blocks."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=200)
    content: list[TextBlock] = Field(default_factory=list)
    is_error: bool = False

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return as_blocks(value, ("text",), "a tool_result's content")

    @property
    def text(self) -> str:
        return "".join(block.text for block in self.content)


class ThinkingBlock(_Block):
    """An earlier turn's thinking: accepted and left out of the prompt (as chat templates leave out
    earlier turns' reasoning)."""

    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


def as_blocks(value: Any, allowed: tuple[str, ...], where: str) -> Any:
    """``value`` as content blocks (a string is one text block); a block of a type not ``allowed``
    is refused naming it: images, documents and the server tools' blocks are nothing slotq runs."""
    return text_parts(value, allowed, text_type="text", where=where, noun="block")


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _blocks_of_role(cls, value: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        return as_blocks(value, USER_BLOCKS if role == "user" else ASSISTANT_BLOCKS, f"a {role} message")


class Tool(BaseModel):
    """A function the model may call (Anthropic's custom tool)."""

    model_config = ConfigDict(extra="ignore")     # cache_control, and fields newer SDKs send (eager_input_streaming)

    type: Literal["custom"] | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any]

    @model_validator(mode="before")
    @classmethod
    def _custom_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"type {kind!r} is one of Anthropic's server tools, which slotq does not host; "
                             "describe a function with name, description and input_schema instead")
        return data


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named_when_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name: give it with type 'tool' (the tool the model must call), and only then")
        return self


class ThinkingConfig(BaseModel):
    """Whether the model may think. slotq's models think or not as their chat template makes them;
    what they think comes back as thinking blocks either way. ``budget_tokens`` is accepted
    (Anthropic's floor of 1024) and not enforced apart: ``max_tokens`` bounds the whole reply."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1024)
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> ThinkingConfig:
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise ValueError("budget_tokens: give it with type 'enabled', and only then")
        return self


class JsonOutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """Structured output: ``format`` constrains the reply to JSON of its schema, as the
    gateway's ``response_format`` does. ``effort`` is accepted and ignored."""

    model_config = ConfigDict(extra="forbid")

    format: JsonOutputFormat | None = None
    effort: str | None = None


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user_id: str | None = Field(None, max_length=256)


class CountTokensRequest(BaseModel):
    """``/v1/messages/count_tokens``: the conversation, as a Messages request would send it."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # slotq's own (the SDKs send them with extra_body)
    lane: str | None = Field(None, description="priority lane of the queue (SLOTQ_LANES), e.g. 'bulk'")

    @model_validator(mode="before")
    @classmethod
    def _drop_and_refuse(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, why in _REFUSED.items():
            if data.get(name) not in (None, [], {}):
                raise ValueError(f"{name}: not supported: {why}")
        return {k: v for k, v in data.items() if k not in _IGNORED and k not in _REFUSED}

    @model_validator(mode="after")
    def _forced_needs_tools(self) -> CountTokensRequest:
        if self.tool_choice is not None and self.tool_choice.type in ("any", "tool") and not self.tools:
            raise ValueError(f"tool_choice: type {self.tool_choice.type!r} needs tools")
        return self

    @field_validator("system", mode="before")
    @classmethod
    def _system_text(cls, value: Any) -> Any:
        return as_blocks(value, ("text",), "system")

    @property
    def system_text(self) -> str | None:
        return None if self.system is None else "\n\n".join(block.text for block in self.system)


class MessagesRequest(CountTokensRequest):
    """``/v1/messages``: Anthropic's body, plus slotq's job fields (lane, priority, deadline,
    idempotency_key, keep_on_disconnect) as the OpenAI routes take them."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    priority: int | None = None
    deadline: float | None = Field(None, description="unix time after which generation stops")
    idempotency_key: str | None = None
    keep_on_disconnect: bool | None = Field(
        None, description="keep the job running if a streaming client disconnects (default: the gateway setting)")

    @field_validator("stop_sequences")
    @classmethod
    def _no_empty_stop(cls, value: list[str] | None) -> list[str] | None:
        """Checked here, not only by the job (whose rule spans its fields), to name the field."""
        if value is not None and "" in value:
            raise ValueError(f"sequence {value.index('')} is empty; a stop sequence needs at least one character")
        return value


# ---------------------------------------------------------------------- responses
class Usage(BaseModel):
    """Anthropic counts a prompt's tokens read from cache apart: ``input_tokens`` are the ones
    computed, ``cache_read_input_tokens`` the ones whose KV slotq reused (its prefix cache)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = Field("", description="empty: slotq signs nothing (Anthropic's models sign their thinking)")


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Message(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ThinkingOut | TextOut | ToolUseOut]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: Usage
    slotq: SlotqInfo | None = Field(None, description="slotq's own fields, as on OpenAI's objects (the SDK keeps "
                                                      "them: message.model_extra)")


class TokenCount(BaseModel):
    input_tokens: int
