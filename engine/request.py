"""The request schema the engine accepts.

Everything that can be checked without the model is checked here by pydantic, so a bad request
fails before it takes a slot, with the field named. Checks that need the model (prompt length in
tokens, grammar syntax, token ids) happen in ``Engine.submit`` before the request is queued.
"""

from __future__ import annotations

import json
import math
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"     # OpenAI's rule for a function's name
MAX_TOOLS = 128                                  # OpenAI's limit


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=64)
    arguments: str = Field(max_length=1_000_000, description="the arguments as JSON text, as the model wrote them")


class ToolCallSpec(BaseModel):
    """A tool call an assistant message made (a previous turn sent back with the conversation)."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(max_length=200)
    type: Literal["function"] = "function"
    function: FunctionCall

MAX_TOP_LOGPROBS = 20        # OpenAI's limit on top_logprobs
LORA_NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"   # an adapter's name (SLOTQ_LORA); a model may be named base:name
MAX_LORA_SCALE = 100.0       # llama.cpp has no bound; a typo of 1e6 is no adapter any more
MAX_LORA_ADAPTERS = 16       # per request


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: list[ToolCallSpec] | None = Field(None, max_length=MAX_TOOLS, description="assistant messages only")
    tool_call_id: str | None = Field(None, max_length=200, description="tool messages: the call this result answers")
    name: str | None = Field(None, max_length=64)

    @field_validator("content", mode="before")
    @classmethod
    def _none_is_empty(cls, value: Any) -> Any:
        """An assistant message that only called tools has ``content: null`` in OpenAI's shape."""
        return "" if value is None else value

    @model_validator(mode="after")
    def _calls_from_assistant(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls: only assistant messages carry them (this one is {self.role!r})")
        for index, call in enumerate(self.tool_calls or ()):
            # the call goes back into the prompt as the object it was: text that is none would be
            # written in as it is, a turn the model never took
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError as exc:
                raise ValueError(f"tool_calls[{index}].function.arguments: not JSON ({exc})") from None
            if not isinstance(arguments, dict):
                raise ValueError(f"tool_calls[{index}].function.arguments: not a JSON object")
        return self


class FunctionDef(BaseModel):
    """A function the model may call: its name, what it does, and its arguments' JSON schema."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = Field(None, max_length=100_000)
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}},
                                       description="JSON schema of the arguments (an object)")
    strict: bool | None = Field(None, description="accepted; slotq always constrains a forced call to the schema")


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming one function: the model must call it."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class SamplingParams(BaseModel):
    """Sampling knobs, named and bounded as in llama-server / OpenAI."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(0.8, ge=0.0, le=5.0, description="0 = greedy")
    top_k: int = Field(40, ge=0, le=100_000, description="0 = disabled")
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    min_p: float = Field(0.05, ge=0.0, le=1.0)
    repeat_penalty: float = Field(1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    penalty_last_n: int = Field(64, ge=-1, le=1_000_000, description="-1 = whole context")
    seed: int | None = Field(None, ge=0, le=2**32 - 2, description="None = random")
    logit_bias: dict[int, float] = Field(default_factory=dict, description="token id -> bias; -inf bans a token")
    grammar: str | None = Field(None, max_length=200_000, description="GBNF grammar, root rule 'root'")
    json_schema: dict[str, Any] | None = Field(None, description="constrain output to JSON matching this schema")

    @field_validator("json_schema")
    @classmethod
    def _strict_json(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is not None:
            try:
                json.dumps(schema, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"must be plain JSON (no NaN/Infinity, no non-JSON types): {exc}") from None
        return schema

    @model_validator(mode="after")
    def _one_constraint(self) -> SamplingParams:
        bad = [t for t, v in self.logit_bias.items() if math.isnan(v) or v == math.inf]
        if bad:
            raise ValueError(f"logit_bias[{bad[0]}] must be a number or -inf (bans the token), not NaN or +inf")
        if self.grammar is not None and self.json_schema is not None:
            raise ValueError("give either grammar or json_schema, not both")
        return self


class LoraRef(BaseModel):
    """One adapter a request runs under, as llama-server's ``lora`` entries name it (``id``: the
    adapter's index in the worker's list), or by its name."""

    model_config = ConfigDict(extra="forbid")

    id: Annotated[int, Field(ge=0, le=1_000)] | Annotated[str, Field(pattern=LORA_NAME_PATTERN)] = Field(
        description="the adapter's index in SLOTQ_LORA (llama-server's id) or its name")
    scale: float | None = Field(None, ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE, allow_inf_nan=False,
                                description="None: the scale SLOTQ_LORA gives the adapter (1.0 unless set); 0 = off")


class GenerationParams(BaseModel):
    """What to generate: a prompt (raw text) or chat messages, and how. Shared by the engine's
    request and the job layer's request so both validate identically."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = Field(None, max_length=4_000_000)
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=10_000)
    max_tokens: int = Field(256, ge=1, le=1_000_000)
    n: int = Field(1, ge=1, le=64, description="completions of the same prompt; the prompt is processed once")
    stop: list[str] = Field(default_factory=list, max_length=16)
    ignore_eos: bool = False
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    priority: int = Field(0, ge=-100, le=100, description="higher runs first among waiting requests")
    deadline: float | None = Field(None, description="unix time after which generation stops (finish_reason deadline)")
    tools: list[ToolSpec] | None = Field(None, min_length=1, max_length=MAX_TOOLS,
                                         description="functions the model may call (chat messages only)")
    tool_choice: ToolChoice = Field(
        "auto", description="none: never call; auto: the model decides; required: at least one call; "
                            "a named function: exactly that one (required and named are grammar-constrained)")
    parallel_tool_calls: bool = Field(
        False, description="whether one reply may hold several calls; off unless asked, as in llama-server (OpenAI's "
                           "default is on): a small model allowed several tends to repeat one call until max_tokens")
    reasoning_format: Literal["deepseek", "none"] = Field(
        "deepseek", description="deepseek: a reply's leading <think>...</think> goes to `reasoning`, not the text; "
                                "none: think tags stay in the text")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS,
        description="None: off; k: each generated token's log probability and the k most likely tokens at its "
                    "position, from the model's raw distribution (before temperature, penalties, bias, constraints)")
    lora: list[LoraRef] = Field(
        default_factory=list, max_length=MAX_LORA_ADAPTERS,
        description="LoRA adapters to run under, each by id or name with a scale; adapters not named are off "
                    "(llama-server's lora field)")

    @model_validator(mode="after")
    def _prompt_xor_messages(self) -> GenerationParams:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > 256 for s in self.stop):
            raise ValueError("each stop string must be at most 256 characters")
        return self

    @model_validator(mode="after")
    def _results_answer_calls(self) -> GenerationParams:
        """A tool message answers a call an earlier assistant message made (OpenAI refuses the rest)."""
        called: set[str] = set()
        for index, message in enumerate(self.messages or ()):
            called.update(call.id for call in message.tool_calls or ())
            if message.role == "tool" and message.tool_call_id is not None and message.tool_call_id not in called:
                raise ValueError(f"messages[{index}].tool_call_id: {message.tool_call_id!r} answers no tool call of "
                                 "an earlier assistant message")
        return self

    @model_validator(mode="after")
    def _tools_fit(self) -> GenerationParams:
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        if self.tools and self.prompt is not None:
            raise ValueError("tools: need messages (a chat); a raw prompt has no template to render them")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: names {choice.function.name!r}, which is not in tools ({names})")
        if choice == "required" and not names:
            raise ValueError("tool_choice: 'required' needs tools")
        if self.calls_tools and (self.sampling.json_schema is not None or self.sampling.grammar is not None):
            raise ValueError("tools: cannot be combined with json_schema or grammar (a call's arguments are "
                             "already constrained by its parameters)")
        if self.calls_tools and self.ignore_eos:
            raise ValueError("ignore_eos: cannot be combined with tools (unless tool_choice is 'none'): a call is "
                             "grammar-constrained and ends with end-of-generation, which ignore_eos bans")
        return self

    @property
    def calls_tools(self) -> bool:
        """Whether the model may call tools in this reply: it has tools and tool_choice is not 'none'."""
        return bool(self.tools) and self.tool_choice != "none"


class GenerationRequest(GenerationParams):
    """One generation as the engine runs it."""

    id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    priority_class: int = Field(
        0, ge=0, le=64,
        description="coarse precedence set by the engine's owner, compared before priority: the job layer "
                    "gives each lane its rank, so a higher lane's prompt is admitted and prefilled first")
    lent_reserve: bool = Field(
        False,
        description="the owner lends this request the reserve (engine.scheduler rule 6) though no lower class "
                    "runs: the job layer does for the job of a tenant with nothing running while other tenants' "
                    "jobs hold every slot, so one tenant's backlog never makes another's first job wait for a slot")
    resume_tokens: list[int] = Field(
        default_factory=list,
        description="tokens already delivered by an earlier attempt: prefilled after the prompt, "
                    "then generation continues",
    )

    @model_validator(mode="after")
    def _resume(self) -> GenerationRequest:
        if self.resume_tokens and self.n != 1:
            raise ValueError("resume_tokens requires n = 1")
        if len(self.resume_tokens) >= self.max_tokens:
            raise ValueError(f"resume_tokens has {len(self.resume_tokens)} tokens; "
                             f"it must be < max_tokens ({self.max_tokens})")
        return self


MAX_EMBEDDING_INPUTS = 2048     # per request, as OpenAI's embeddings API allows


class EmbeddingParams(BaseModel):
    """What to embed. Shared by the engine's request and the job layer's, so both validate alike."""

    model_config = ConfigDict(extra="forbid")

    inputs: list[str] | list[list[int]] = Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS,
                                                description="texts, or token id arrays; one vector each, in order")
    truncate: bool = Field(False, description="cut an input over the limit to its first tokens instead of refusing it")

    @field_validator("inputs")
    @classmethod
    def _none_empty(cls, inputs: list[str] | list[list[int]]) -> list[str] | list[list[int]]:
        for i, item in enumerate(inputs):
            if len(item) == 0:
                raise ValueError(f"input {i} is empty")
            if isinstance(item, list) and min(item) < 0:
                raise ValueError(f"input {i}: token id {min(item)} is negative")
        return inputs

    def input_chars(self) -> int:
        """Characters of the texts (a token array counts its tokens): what producers can check without a tokenizer."""
        return sum(len(item) for item in self.inputs)


class EmbeddingRequest(EmbeddingParams):
    id: str = Field(default_factory=lambda: uuid.uuid4().hex)


MAX_RERANK_DOCUMENTS = 1000     # per request, as Cohere's rerank API allows


class RerankParams(BaseModel):
    """What to rank: documents scored for their relevance to one query, as llama-server's ``/v1/rerank``
    takes them. Shared by the engine's request and the job layer's, so both validate alike."""

    model_config = ConfigDict(extra="forbid")

    query: str = Field(description="the text every document is scored against")
    documents: list[str] = Field(min_length=1, max_length=MAX_RERANK_DOCUMENTS,
                                 description="texts to score; one relevance score each, in order")


class RerankRequest(RerankParams):
    id: str = Field(default_factory=lambda: uuid.uuid4().hex)
