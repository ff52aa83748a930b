"""OpenAI's Responses API as pydantic models: the body of ``POST /v1/responses`` and the Response
object a reply is.

Requests are checked for shape here, with OpenAI's own bounds where they are tighter than slotq's
(``temperature`` at most 2); every other limit is the job layer's, reported under these names by
:mod:`slotq.jobs.responses.translate`. What slotq cannot honour is refused by name: the built-in
tools only OpenAI hosts (web search, file search, computer use, code interpreter, ...), image, file
and audio input, ``truncation: auto``, and the stateful fields this gateway does not serve
(``conversation``, ``prompt``). What changes nothing
here is accepted and ignored (``user``, ``service_tier``, ``prompt_cache_key``, ``include``,
``reasoning``'s effort: a slotq model thinks or not as its chat template makes it).

``input`` items are validated one by one in translation (:func:`~slotq.jobs.responses.translate.input_items`)
rather than as a tagged union here, so that an error names ``input[2].call_id`` as the request
spells it, not pydantic's union branch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from slotq.jobs.openai.wire import SlotqInfo, text_parts

# Fields of OpenAI's API that change nothing on slotq: accepted and dropped.
_IGNORED = ("user", "safety_identifier", "service_tier", "prompt_cache_key", "prompt_cache_retention", "include",
            "stream_options")
# Fields slotq does not serve: dropped when off (null, false, 0, empty), refused by name otherwise.
_REFUSED = {
    "conversation": "slotq keeps no conversations: send the whole conversation as input items",
    "prompt": "slotq keeps no prompt templates: send instructions and input",
    "top_logprobs": "the Responses API's logprobs are not served: use /v1/chat/completions with logprobs",
    "max_tool_calls": "slotq does not cap built-in tool calls (it runs none): leave it out",
}
# Built-in tools (and tool_choice types) that only OpenAI hosts: refused naming the type.
HOSTED_TOOLS = ("web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11",
                "file_search", "computer", "computer_use_preview", "computer_use", "code_interpreter",
                "image_generation", "mcp", "local_shell", "shell", "apply_patch", "programmatic_tool_calling")
# Content part types a message item may hold: text only (slotq serves text models).
TEXT_PARTS = ("input_text", "output_text", "refusal")


def _is_off(value: Any) -> bool:
    return value is None or value is False or value == 0 or value in ("", [], {})


def hosted_tool_error(kind: object) -> str:
    """Why a tool of ``kind`` (not ``function``) is refused: OpenAI's built-in tools run on OpenAI's
    servers; any other type (``custom`` free-form tools, ``allowed_tools``) slotq does not serve."""
    what = ("is a built-in tool that only OpenAI hosts" if kind in HOSTED_TOOLS or str(kind).startswith(
        ("web_search", "computer", "file_search")) else "is not served")
    return (f"type {kind!r} {what}; slotq runs function tools only (type 'function' with name and "
            "parameters): run the tool in your app and describe it as a function")


class ContentPart(BaseModel):
    """A message's text: ``input_text`` (user, system, developer), ``output_text`` (an assistant
    message sent back), ``refusal`` (read as its text). Annotations and logprobs are ignored."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["input_text", "output_text", "refusal"]
    text: str = ""
    refusal: str = ""

    @property
    def content(self) -> str:
        return self.refusal if self.type == "refusal" else self.text


class MessageItem(BaseModel):
    """A message (``{"role", "content"}`` without a ``type`` is one too, as the API allows)."""

    model_config = ConfigDict(extra="ignore")      # id, status of an output message sent back

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[ContentPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        return text_parts(value, TEXT_PARTS, text_type="input_text", where="a message", noun="part")

    @property
    def text(self) -> str:
        return "".join(part.content for part in self.content)


class FunctionCallItem(BaseModel):
    """A call an earlier response made, sent back with the conversation."""

    model_config = ConfigDict(extra="ignore")      # id, status

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=200)
    name: str = Field(min_length=1, max_length=64)
    arguments: str


class FunctionCallOutputItem(BaseModel):
    """What a function returned, for the call ``call_id`` names: text, or input_text parts."""

    model_config = ConfigDict(extra="ignore")      # id, status

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=200)
    output: str

    @field_validator("output", mode="before")
    @classmethod
    def _text_output(cls, value: Any) -> Any:
        if isinstance(value, list):
            kinds = [part.get("type") if isinstance(part, dict) else type(part).__name__ for part in value]
            if any(kind != "input_text" for kind in kinds):
                raise ValueError(f"parts {kinds}: a function's output may be text or input_text parts "
                                 "(slotq serves text models)")
            return "".join(str(part.get("text", "")) for part in value)
        return value


class ReasoningItem(BaseModel):
    """An earlier response's reasoning: accepted and left out of the prompt (as chat templates leave
    out earlier turns' reasoning)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["reasoning"]


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
ITEM_MODELS: dict[str, type[InputItem]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                           "function_call_output": FunctionCallOutputItem,
                                           "reasoning": ReasoningItem}


class FunctionTool(BaseModel):
    """A function the model may call. ``strict`` is accepted: slotq constrains a forced call's
    arguments to the schema by grammar either way."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind != "function" and kind is not None:
            raise ValueError(hosted_tool_error(kind))
        return data


class TextFormat(BaseModel):
    """``text.format``: plain text, any JSON object, or JSON of a schema (``name`` and ``schema``)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("type 'json_schema' needs a schema (and a name)")
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None     # accepted; a slotq model has no such knob


class ReasoningConfig(BaseModel):
    """Accepted and echoed: a slotq model thinks or not as its chat template makes it, and what it
    thinks comes back as a reasoning item either way."""

    model_config = ConfigDict(extra="forbid")

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


ToolChoiceOption = Literal["none", "auto", "required"]


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: OpenAI's body, plus slotq's job fields (lane, priority, deadline,
    idempotency_key, keep_on_disconnect) as the chat route takes them."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]] = Field(
        default_factory=list, description="a user message's text, or input items (none: previous_response_id's)")
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoiceOption | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["disabled"] | None = Field(
        None, description="'auto' is refused: slotq never drops input items (a prompt too long is a 400)")
    metadata: dict[str, str] | None = Field(None, max_length=16)
    stream: bool = False
    store: bool = Field(True, description="keep the response (GET /v1/responses/{id}, previous_response_id)")
    previous_response_id: str | None = Field(None, description="continue the conversation this stored response ended")
    background: bool = Field(False, description="answer at once and run the response as a durable job: poll it, "
                                                "stream it from any event (starting_after), cancel it")
    # slotq's own (the SDK sends them with extra_body)
    lane: str | None = Field(None, description="priority lane of the queue (SLOTQ_LANES), e.g. 'bulk'")
    priority: int | None = None
    deadline: float | None = Field(None, description="unix time after which generation stops")
    idempotency_key: str | None = None
    keep_on_disconnect: bool | None = Field(
        None, description="keep the job running if a streaming client disconnects (default: the gateway setting)")

    @model_validator(mode="before")
    @classmethod
    def _drop_and_refuse(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, why in _REFUSED.items():
            if not _is_off(data.get(name)):
                raise ValueError(f"{name}: not supported: {why}")
        if data.get("truncation") == "auto":
            raise ValueError("truncation: 'auto' is not supported: slotq never drops input items; leave it out "
                             "or send 'disabled'")
        return {k: v for k, v in data.items() if k not in _IGNORED and k not in _REFUSED}

    @field_validator("tool_choice")
    @classmethod
    def _function_or_option(cls, value: ToolChoiceOption | dict[str, Any] | None) -> Any:
        if not isinstance(value, dict):
            return value
        kind = value.get("type")
        if kind != "function":
            raise ValueError(hosted_tool_error(kind))
        if not isinstance(value.get("name"), str) or set(value) != {"type", "name"}:
            raise ValueError("give 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": <a tool's name>}")
        return value

    @model_validator(mode="after")
    def _background_is_stored(self) -> ResponsesRequest:
        if self.background and not self.store:
            raise ValueError("background: a background response is stored (it is polled and resumed by id): "
                             "leave store true")
        return self

    @model_validator(mode="after")
    def _choice_names_a_tool(self) -> ResponsesRequest:
        names = {tool.name for tool in self.tools or []}
        choice = self.tool_choice
        if choice == "required" and not names:
            raise ValueError("tool_choice: 'required' needs tools")
        if isinstance(choice, dict) and choice["name"] not in names:
            raise ValueError(f"tool_choice: {choice['name']!r} is none of the tools' names ({sorted(names)})")
        return self


# ---------------------------------------------------------------------- the Response object
class InputTokensDetails(BaseModel):
    cache_write_tokens: int = Field(0, description="0, as Anthropic's cache_creation_input_tokens: slotq bills no "
                                                   "cache writes (its prefix cache keeps a prompt's KV by itself); "
                                                   "the openai SDK's usage type requires the field")
    cached_tokens: int = Field(description="prompt tokens whose KV slotq reused (its prefix cache)")


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = Field(0, description="of output_tokens, those the reply thought in (its think block)")


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallOut(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOut(BaseModel):
    """What the model thought: its text in ``content`` (as open-weight models' servers write it);
    no summary (slotq writes none)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = ReasoningOut | OutputMessage | FunctionCallOut
ResponseStatus = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    """Why a response failed, in the openai SDK's shape: ``code`` is one of the codes its type declares
    (a client may match on them), slotq's own code goes in ``type`` (``prompt_too_long``,
    ``deadline_exceeded``, ``tries_exhausted``, ...) and the field at fault in ``param``."""

    code: Literal["invalid_prompt", "rate_limit_exceeded", "server_error"]
    message: str
    type: str | None = None
    param: str | None = None


class Response(BaseModel):
    """OpenAI's Response object; the request's settings are echoed as OpenAI echoes them."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    completed_at: int | None = None
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = False
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled"] = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    slotq: SlotqInfo | None = Field(None, description="slotq's own fields, as on the chat objects (the SDK keeps "
                                                      "them: response.model_extra)")


class InputTokens(BaseModel):
    """``POST /v1/responses/input_tokens``' answer."""

    object: Literal["response.input_tokens"] = "response.input_tokens"
    input_tokens: int


class ItemList(BaseModel):
    """``GET /v1/responses/{id}/input_items``' answer: a page of the response's input items."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
