"""OpenAI's wire format as pydantic models: the request bodies slotq accepts (at the gateway and in
OpenAI Batch lines alike) and the objects it returns (completions, chunks, models, usage).

Requests are checked here for shape and type (a flag is JSON's ``true`` or ``false``: ``"yes"`` or
``1`` is refused by name, as OpenAI's API refuses it), and for the bounds OpenAI's API sets tighter than
slotq's own (``temperature`` at most 2, at most 4 ``stop`` strings), so a request the OpenAI API
would refuse is refused here too. Every other limit (max_tokens, top_k, ...) is the job layer's:
translation builds a ``JobRequest`` and reports its errors under these names.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_serializer,
    model_validator,
)

from slotq.jobs.protocol.schemas import JobKind, JobResult, JobStatus
from slotq.jobs.protocol.wire import MAX_TOP_LOGPROBS, ToolCallSpec, ToolChoice, ToolSpec

# Parameters of OpenAI's API that slotq cannot honour. Sent with an "off" value (null, false, "",
# [], best_of 1) they are dropped; any other value is a 400 naming them. ``tools`` is honoured, and
# dropped only when empty (some clients always send the list); ``functions``/``function_call`` are
# the API's deprecated spelling of tools, refused by name: send ``tools``.
_OFF_VALUES: tuple[Any, ...] = (None, False, "", [], {})
_OFF_SPECIAL: dict[str, tuple[Any, ...]] = {"best_of": (1,), "top_logprobs": (0,)}
_DROPPED_WHEN_OFF = ("logprobs", "top_logprobs", "tools", "tool_choice", "functions", "function_call", "echo",
                     "suffix", "best_of", "modalities", "audio", "prediction", "web_search_options", "reasoning_effort")
MAX_STOP_STRINGS = 4       # OpenAI's limit
MAX_COMPLETION_LOGPROBS = 5    # OpenAI's limit on /v1/completions' logprobs (chat's top_logprobs: MAX_TOP_LOGPROBS)
_IGNORED = ("user", "store", "service_tier", "safety_identifier", "prompt_cache_key")


def _is_off(key: str, value: Any) -> bool:
    return any(value is off or (type(value) is type(off) and value == off)
               for off in _OFF_VALUES + _OFF_SPECIAL.get(key, ()))


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False
    include_obfuscation: StrictBool | None = None      # sent by newer SDKs; nothing to obfuscate here


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object with a schema")
        return self


class _Generation(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logit_bias: dict[int, float] | None = Field(None, description="token id -> bias added to its logit")
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # llama-server's extras that the engine has
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    ignore_eos: StrictBool | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    lora: list[dict[str, Any]] | None = Field(
        None, description='LoRA adapters: [{"id": 0 or "name", "scale": 0.5}] (scale: the adapter\'s configured one '
                          "when left out); or name the model base:adapter")
    # slotq's own
    lane: str | None = Field(None, description="priority lane of the queue (SLOTQ_LANES), e.g. 'bulk'")
    priority: int | None = None
    deadline: float | None = Field(None, description="unix time after which generation stops")
    idempotency_key: str | None = None
    metadata: dict[str, Any] | None = None
    keep_on_disconnect: StrictBool | None = Field(
        None, description="keep the job running if a streaming client disconnects (default: the gateway setting)")

    @model_validator(mode="before")
    @classmethod
    def _drop_off_values(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = {k: v for k, v in data.items()
                    if k not in _IGNORED and not (k in _DROPPED_WHEN_OFF and _is_off(k, v))}
        return data

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings (got {len(value)})")
        return value

    @property
    def stop_list(self) -> list[str] | None:
        return [self.stop] if isinstance(self.stop, str) else self.stop

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class WireMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")     # refusal, annotations, reasoning_content, ... of echoed messages

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[ToolCallSpec] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        """Content parts are joined when they are all text; images and audio are not supported."""
        if isinstance(value, list):
            texts = []
            for i, part in enumerate(value):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"content part {i} is {kind!r}; slotq serves text models, "
                                     "only 'text' parts are supported")
                texts.append(part["text"])
            return "".join(texts)
        return value


class ChatCompletionRequest(_Generation):
    messages: list[WireMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    reasoning_format: Literal["deepseek", "none"] | None = Field(
        None, description="llama-server's: deepseek (default) moves a reply's think tags to reasoning_content")
    logprobs: StrictBool | None = Field(None, description="each generated token's log probability")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                     description="with logprobs: the most likely tokens at each position")

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true, as in OpenAI's API")
        return value

    @property
    def logprobs_k(self) -> int | None:
        """How many alternatives per token the job asks for (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Generation):
    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS,
                                 description="each generated token's log probability and this many alternatives")

    @property
    def logprobs_k(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError(f"give one prompt per request ({len(value)} given); send several requests instead")
        return value

    @property
    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class EmbeddingsRequest(BaseModel):
    """``/v1/embeddings``: OpenAI's body (``user`` is accepted and ignored) plus slotq's job fields and
    llama-server's ``truncate``. ``dimensions`` is refused by name: the models slotq serves give vectors
    of one fixed length, which a shorter request would silently change the meaning of."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: None = Field(None, description="not supported: the model's vectors have a fixed length")
    user: str | None = None
    truncate: StrictBool = Field(False,
                                 description="cut an input over the model's limit to its first tokens (llama-server)")
    lane: str | None = Field(None, description="priority lane of the queue (SLOTQ_LANES), e.g. 'bulk'")
    idempotency_key: str | None = None
    metadata: dict[str, Any] | None = None

    @field_validator("dimensions", mode="before")
    @classmethod
    def _no_dimensions(cls, value: Any) -> None:
        if value is not None:
            raise ValueError("not supported: this model's vectors have a fixed length (leave dimensions out)")
        return None

    @property
    def inputs(self) -> list[Any]:
        """The inputs as a job holds them: a text or one token array is a list of one."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and all(isinstance(item, int) for item in self.input):
            return [self.input]
        return list(self.input)


class RerankRequest(BaseModel):
    """``/v1/rerank`` (also ``/v1/reranking``, ``/rerank``, ``/reranking``): llama-server's body, which is Jina's
    (``query``, ``documents``, ``top_n``; Cohere's and Jina's ``return_documents`` too) or, with ``texts`` in place
    of ``documents``, Hugging Face TEI's (``return_text``; the answer is then TEI's bare list). slotq's job
    fields as on every route. ``model`` may be left out (llama-server serves one model): the gateway then
    takes the one reranker its workers serve."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, min_length=1)
    query: str
    documents: list[str] | None = Field(None, description="the texts to score (Jina's and Cohere's name)")
    texts: list[str] | None = Field(None, description="the texts to score (TEI's name: the answer is TEI's list)")
    top_n: int | None = Field(None, ge=1, description="answer only the most relevant n; unset = every document")
    return_documents: StrictBool = Field(False, description="each result carries its document ({'text': ...})")
    return_text: StrictBool = Field(False, description="TEI: each result carries its text")
    user: str | None = None
    lane: str | None = Field(None, description="priority lane of the queue (SLOTQ_LANES), e.g. 'bulk'")
    idempotency_key: str | None = None
    metadata: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_list(self) -> RerankRequest:
        if (self.documents is None) == (self.texts is None):
            raise ValueError("documents: give the texts to score as documents (or as texts, TEI's name), once")
        return self

    @property
    def tei(self) -> bool:
        """Whether the body is TEI's (``texts``): the answer is then TEI's bare list."""
        return self.texts is not None

    @property
    def items(self) -> list[str]:
        return self.documents if self.documents is not None else self.texts or []


# ---------------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = Field(0, description="of completion_tokens, those the reply thought in (its think block)")


class UsageOut(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)


class TopLogprobOut(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(TopLogprobOut):
    top_logprobs: list[TopLogprobOut]


class ChatLogprobs(BaseModel):
    """A chat choice's ``logprobs``: one entry per generated token."""

    content: list[TokenLogprobOut] | None
    refusal: list[TokenLogprobOut] | None = None


class TextLogprobs(BaseModel):
    """A completion choice's ``logprobs`` (OpenAI's legacy shape); ``top_logprobs`` maps each
    alternative's text, and the sampled token's, to its logprob; ``text_offset`` counts characters
    from the start of the generated text (the prompt is not echoed)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="null when the reply only called tools, as OpenAI's")
    refusal: str | None = None          # part of OpenAI's message object; slotq's models never refuse
    tool_calls: list[ToolCallSpec] | None = None
    reasoning_content: str | None = Field(None, description="what the reply thought (llama-server's field)")

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """OpenAI leaves out what a message does not have; content and refusal stay (null)."""
        data: dict[str, Any] = handler(self)
        return {k: v for k, v in data.items() if v is not None or k in ("content", "refusal")}


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class TextChoice(BaseModel):
    index: int
    text: str
    logprobs: TextLogprobs | None = None
    finish_reason: str | None


def text_parts(value: Any, allowed: tuple[str, ...], *, text_type: str, where: str, noun: str) -> Any:
    """``value`` as a list of content parts (a string is one ``text_type`` part); a part of a type not
    ``allowed`` is refused naming its index and type: images, files and server tools' parts are
    nothing slotq runs. Shared by the Responses API (``part``) and Anthropic's Messages (``block``)."""
    if isinstance(value, str):
        return [{"type": text_type, "text": value}]
    if isinstance(value, list):
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind not in allowed:
                raise ValueError(f"{noun} {i} is {kind!r}; {where} may hold {', '.join(map(repr, allowed))} "
                                 f"{noun}s (slotq serves text models)")
    return value


class SlotqInfo(BaseModel):
    """slotq's own fields on a response (the SDKs keep unknown fields: ``response.model_extra``)."""

    job_id: str
    worker: str | None = None
    attempts: int = 0


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageOut
    system_fingerprint: str | None = None
    slotq: SlotqInfo


class TextCompletion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: UsageOut
    system_fingerprint: str | None = None
    slotq: SlotqInfo


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDeltaOut(BaseModel):
    """One piece of a streamed call (OpenAI's ``delta.tool_calls[i]``): the first names it, the
    rest extend its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None

    @field_serializer("delta")
    def _only_present(self, delta: Delta) -> dict[str, Any]:
        return delta.model_dump(exclude_none=True)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: UsageOut | None = None


class TextCompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[TextChoice]
    usage: UsageOut | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "slotq"
    kind: JobKind = Field(description="generation (chat, completions), embedding (/v1/embeddings) or rerank "
                                      "(/v1/rerank)")
    queue: str
    workers: int = Field(description="live workers that have it loaded")
    slots_total: int
    slots_busy: int
    status: Literal["loaded", "loading", "unloaded"] = Field(
        "loaded", description="unloaded: no worker has it loaded; a request waits in its queue until one switches "
                              "to it (about load_s)")
    load_s: float | None = Field(None, description="what loading it cost a worker (seconds); None: not measured yet")
    adapters: list[str] = Field(default_factory=list,
                                description="LoRA adapters every worker loaded, in id order: ask for one as model "
                                            "base:adapter or in the lora field")
    parent: str | None = Field(None, description="a LoRA adapter's card (id base:adapter): its base model")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class JobObject(BaseModel):
    """slotq's background job (``/v1/jobs``): its status, and once finished its result, both as
    slotq reports it and as the OpenAI completion object a synchronous request would have got."""

    id: str
    object: Literal["slotq.job"] = "slotq.job"
    status: JobStatus
    model: str | None = None
    queue: str
    created: int | None = None
    result: JobResult | None = None
    response: ChatCompletion | TextCompletion | EmbeddingsResponse | RerankResponse | None = None
    cancelled: bool | None = Field(None, description="DELETE only: whether this call cancelled the job")


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int = Field(description="the document's place in the request")
    relevance_score: float = Field(description="the model's raw score: higher is more relevant")
    document: RerankDocument | None = Field(None, description="with return_documents")


class RerankResponse(BaseModel):
    """llama-server's (and Jina's) answer: results most relevant first, cut to ``top_n``."""

    model: str
    object: Literal["list"] = "list"
    usage: EmbeddingsUsage
    results: list[RerankResult]
    slotq: SlotqInfo


class TeiRank(BaseModel):
    """One entry of TEI's answer (a body with ``texts``): a bare list, most relevant first."""

    index: int
    score: float
    text: str | None = Field(None, description="with return_text")


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="floats, or little-endian float32 in base64 (encoding_format)")


class EmbeddingsUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingsUsage
    slotq: SlotqInfo
