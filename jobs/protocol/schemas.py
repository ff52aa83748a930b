"""The job layer's public types: what producers enqueue, what streams carry, what results hold."""

from __future__ import annotations

import base64
import re
import sys
from array import array
from collections.abc import Iterable
from enum import StrEnum
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, computed_field, field_validator, model_validator

from slotq.jobs.protocol.keys import DEFAULT_TENANT
from slotq.jobs.protocol.serialization import serialize
from slotq.jobs.protocol.wire import (
    EmbeddingParams,
    ErrorInfo,
    FinishReason,
    FunctionCall,
    GenerationParams,
    RerankParams,
    Timings,
    TokenLogprob,
    ToolCallDelta,
    ToolCallSpec,
    Usage,
)

_KEY_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,200}$")

TENANT_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
_TENANT_MARK = "@"       # never in an idempotency key or a tenant name, so a scoped id splits one way only
QUOTA_CHARS_PER_TOKEN = 4   # a prompt's tokens as the tokens quota counts them: its characters / 4


def tenant_job_id(tenant: str, key: str) -> str:
    """The queue's job id for a tenant's idempotency key (or a fresh id). Keys are scoped per
    tenant: the same key of two tenants names two jobs. The default tenant's ids are the bare keys,
    as they were before tenants, so single-tenant producers and the CLI see no change."""
    return key if tenant == DEFAULT_TENANT else f"{key}{_TENANT_MARK}{tenant}"


def split_job_id(job_id: str) -> tuple[str, str]:
    """(key, tenant) of a job id: the inverse of :func:`tenant_job_id`."""
    key, mark, tenant = job_id.rpartition(_TENANT_MARK)
    return (key, tenant) if mark else (job_id, DEFAULT_TENANT)


def tenant_of_job(job_id: str) -> str:
    """The tenant whose job this is, read from its id (see :func:`tenant_job_id`)."""
    return split_job_id(job_id)[1]


class JobKind(StrEnum):
    """What a job asks of its worker; a worker serves one kind (its model decides)."""

    GENERATION = "generation"
    EMBEDDING = "embedding"
    RERANK = "rerank"


class JobFields(BaseModel):
    """What every kind of job carries besides its work: lane, idempotency key, metadata, tenant."""

    lane: str = Field("interactive", pattern=r"^[a-z][a-z0-9_-]{0,31}$",
                      description="priority lane (SLOTQ_LANES); e.g. 'bulk' runs only on slots no higher lane needs")
    idempotency_key: str | None = Field(
        None, description="the same key always maps to the same job (1-200 chars of A-Z a-z 0-9 . _ : -)")
    metadata: dict[str, str | int | float | bool | None] = Field(
        default_factory=dict, max_length=64, description="opaque data returned with the result")
    tenant: str = Field(DEFAULT_TENANT, pattern=TENANT_PATTERN,
                        description="who the job belongs to (the gateway sets the caller's); scopes the idempotency "
                                    "key and the job id")
    model: str | None = Field(
        None, min_length=1, max_length=200,
        description="the model the job is for (the gateway sets the one asked for): a worker of another model refuses "
                    "it by name (wrong_model) and never runs it; unset = whichever model serves the queue")

    @model_validator(mode="after")
    def _serializable(self) -> JobFields:
        """What validates must also enqueue: msgpack rejects ints beyond 64 bits and strings with
        lone surrogates, which pydantic lets through (e.g. in metadata or json_schema)."""
        try:
            serialize(self.model_dump(mode="json", exclude_defaults=True))
        except Exception as exc:  # msgpack / unicode errors of several types
            raise ValueError(f"request cannot be serialized ({type(exc).__name__}: {exc}); "
                             "metadata ints must fit in 64 bits and text must be valid Unicode") from None
        return self

    @field_validator("idempotency_key")
    @classmethod
    def _key_chars(cls, value: str | None) -> str | None:
        if value is not None and not _KEY_RE.match(value):
            raise ValueError("idempotency_key must be 1-200 characters of A-Z a-z 0-9 . _ : -")
        return value

    def job_id(self) -> str | None:
        """The job id this request's idempotency key maps to (None without a key)."""
        return None if self.idempotency_key is None else tenant_job_id(self.tenant, self.idempotency_key)


class JobRequest(GenerationParams, JobFields):
    """A generation job. Validated when enqueued: a bad request raises pydantic's
    ValidationError naming the field, and nothing is written to Redis."""

    kind: ClassVar[JobKind] = JobKind.GENERATION

    def prompt_chars(self) -> int:
        """The characters of the prompt, or of every message (its content and the calls it made),
        and of the tools the template will describe."""
        messages = sum(len(m.content) + sum(len(c.function.name) + len(c.function.arguments)
                                            for c in m.tool_calls or ())
                       for m in self.messages or ())
        tools = sum(len(t.function.model_dump_json()) for t in self.tools or ())
        return len(self.prompt or "") + messages + tools

    def quota_tokens(self) -> int:
        """What the job reserves of its tenant's tokens per minute when it is admitted: its prompt
        (characters / QUOTA_CHARS_PER_TOKEN: only a worker has the tokenizer, and the quota must be
        decided before the job is queued) plus every token it may generate (max_tokens x n). It is
        not refunded when the job stops early, so a tenant can never exceed the quota."""
        return -(-self.prompt_chars() // QUOTA_CHARS_PER_TOKEN) + self.max_tokens * self.n


class EmbeddingJobRequest(EmbeddingParams, JobFields):
    """An embedding job: one vector per input (texts or token arrays), on an embedding model's queue."""

    kind: ClassVar[JobKind] = JobKind.EMBEDDING

    def quota_tokens(self) -> int:
        """What the job reserves of its tenant's tokens per minute: its texts' characters / QUOTA_CHARS_PER_TOKEN
        (a token array counts its tokens), as a generation job's prompt is counted."""
        return sum(-(-len(item) // QUOTA_CHARS_PER_TOKEN) if isinstance(item, str) else len(item)
                   for item in self.inputs)


class RerankJobRequest(RerankParams, JobFields):
    """A rerank job: one relevance score per document for its query, on a reranker's queue."""

    kind: ClassVar[JobKind] = JobKind.RERANK

    def quota_tokens(self) -> int:
        """What the job reserves of its tenant's tokens per minute: the characters the model reads (the query
        once per document) / QUOTA_CHARS_PER_TOKEN, as a generation job's prompt is counted."""
        return -(-self.input_chars() // QUOTA_CHARS_PER_TOKEN)


AnyJobRequest = JobRequest | EmbeddingJobRequest | RerankJobRequest


def ranked(scores: list[float], top_n: int | None = None) -> list[int]:
    """Indices of ``scores``, highest first (ties keep their order), the first ``top_n`` of them (all when None):
    a rerank job's documents, most relevant first."""
    return sorted(range(len(scores)), key=lambda i: -scores[i])[:top_n]


def decode_vector(encoded: str) -> list[float]:
    """The floats of one vector of :attr:`JobResult.embeddings` (little-endian float32 in base64)."""
    packed = array("f", base64.b64decode(encoded))
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()


class JobStatus(StrEnum):
    QUEUED = "queued"          # waiting for a worker (or for its retry time)
    RUNNING = "running"
    SUCCEEDED = "succeeded"    # every choice finished (stop, length, deadline)
    FAILED = "failed"          # a non-retryable error, or tries exhausted (then also dead-lettered)
    CANCELLED = "cancelled"
    NOT_FOUND = "not_found"


class ChoiceResult(BaseModel):
    index: int
    text: str
    reasoning: str = Field("", description="what the reply thought (its think tags), apart from its text")
    tool_calls: list[ToolCallSpec] = Field(
        default_factory=list, description="the calls the reply made (finish_reason tool_calls), in OpenAI's shape: "
                                          "send them back in the next turn's assistant message")
    finish_reason: FinishReason
    stop_sequence: str | None = Field(
        None, description="finish_reason stop: the stop string that ended the reply (None: the model ended its turn)")
    usage: Usage
    timings: Timings
    logprobs: list[TokenLogprob] | None = Field(
        None, description="one per generated token, every attempt's, each once (when the job asked for logprobs)")


class MaxTokensCap(BaseModel):
    """A degraded worker ran the job with fewer tokens than asked (see SLOTQ_DEGRADED_MAX_TOKENS)."""

    requested: int
    applied: int
    reason: str


class JobResult(BaseModel):
    id: str
    status: JobStatus
    text: str = Field("", description="text of choice 0")
    finish_reason: FinishReason | None = None
    stop_sequence: str | None = Field(None, description="choice 0's: the stop string that ended its reply")
    usage: Usage = Field(default_factory=Usage, description="prompt counted once; completion summed over choices")
    timings: Timings | None = None
    choices: list[ChoiceResult] = Field(default_factory=list)
    error: ErrorInfo | None = None
    worker: str | None = Field(None, description="the worker whose attempt wrote the job's final stream entry")
    model: str | None = Field(None, description="the model that worker serves (its SLOTQ_MODEL_NAME or file name)")
    model_fingerprint: str | None = Field(
        None, description="a fingerprint of that model's GGUF file (16 hex digits: its size and first and last MiB)")
    attempts: int = Field(
        0, description="the attempt that ended the job (attempts handed back on shutdown do not count)")
    interruptions: int = Field(
        0, description="earlier attempts lost (worker killed or stalled) after delivering new tokens: they spent no "
                       "try, so the tries spent are attempts - interruptions")
    metadata: dict[str, Any] = Field(default_factory=dict)
    max_tokens_cap: MaxTokensCap | None = Field(
        None, description="set when a degraded worker capped max_tokens; finish_reason is then 'length' at the cap")
    embeddings: list[str] = Field(
        default_factory=list, description="embedding jobs: one vector per input, in input order, each little-endian "
                                          "float32 in base64 (OpenAI's encoding_format=base64); vectors() decodes them")
    dimensions: int | None = Field(None, description="embedding jobs: the length of each vector")
    scores: list[float] = Field(
        default_factory=list, description="rerank jobs: one relevance score per document, in document order (the "
                                          "model's raw output: higher is more relevant); ranked() orders them")

    def ranked(self, top_n: int | None = None) -> list[int]:
        """A rerank job's document indices, most relevant first (see :func:`ranked`)."""
        return ranked(self.scores, top_n)

    def vectors(self) -> list[list[float]]:
        """An embedding job's vectors as floats, one per input."""
        return [decode_vector(encoded) for encoded in self.embeddings]


class EntryKind(StrEnum):
    CHUNK = "chunk"     # text and the token ids it came from
    DONE = "done"       # one choice finished
    ERROR = "error"     # an attempt failed; final unless retryable
    RESTART = "restart" # a retried attempt could not resume (n > 1, a trimmed stream): discard earlier chunks


def assemble_tool_calls(deltas: Iterable[ToolCallDelta]) -> list[ToolCallSpec]:
    """The calls a reply's streamed pieces add up to: the first piece of a call names it, the
    rest extend its arguments."""
    calls: dict[int, ToolCallSpec] = {}
    for delta in deltas:
        call = calls.get(delta.index)
        if call is None:
            calls[delta.index] = ToolCallSpec(id=delta.id or "", function=FunctionCall(name=delta.name or "",
                                                                                      arguments=delta.arguments))
        else:
            call.function.arguments += delta.arguments
    return [calls[i] for i in sorted(calls)]


class StreamEntry(BaseModel):
    """One entry of ``slotq:stream:{job_id}``, as readers see it. ``id`` is the Redis stream id:
    resume reading after it and nothing is missed or repeated."""

    id: str
    kind: EntryKind
    attempt: int
    choice: int = 0
    text: str = ""
    reasoning: str = Field("", description="chunk: the next piece of the reply's reasoning (think tags)")
    tool_calls: list[ToolCallDelta] = Field(
        default_factory=list, description="chunk: the next pieces of the reply's tool calls (OpenAI's delta shape)")
    token_ids: list[int] = Field(default_factory=list)
    n_tokens: int = 0
    logprobs: list[TokenLogprob] | None = Field(None, description="one per token id (when the job asked for them)")
    prompt_tokens: int | None = Field(
        None, description="chunk: a choice's first of an attempt: the prompt's tokens (as the done entry's usage)")
    cached_prompt_tokens: int = Field(0, description="with prompt_tokens: those of them whose KV was reused")
    finish_reason: FinishReason | None = None
    stop_sequence: str | None = Field(None, description="done: the stop string that ended the choice, if one did")
    usage: Usage | None = None
    timings: Timings | None = None
    error: ErrorInfo | None = None
    worker: str | None = Field(None, description="the worker that wrote it (done and error entries)")
    model: str | None = Field(None, description="the model of that worker (done and error entries)")
    model_fingerprint: str | None = Field(None, description="a fingerprint of that model's GGUF file (as model)")
    final: bool = Field(False, description="the last entry of the job: nothing follows")


class WorkerInfo(BaseModel):
    """A live worker, as its heartbeat advertises it."""

    id: str
    queue: str = Field("", description="the queue it serves")
    model: str = Field(description="the model name it serves (what the gateway's `model` matches)")
    kind: JobKind = Field(JobKind.GENERATION, description="the kind of job its model serves")
    ctx: int = Field(0, description="per-sequence context: prompt + max_tokens must fit")
    partitions: int = Field(1, description="the partitions it splits its queue into (SLOTQ_QUEUE_PARTITIONS)")
    slots_total: int
    slots_busy: int
    waiting: int
    generated_tokens: int
    tokens_per_s: float = 0.0
    kv_cells_used: int = 0
    kv_cells_cached: int = Field(0, description="of kv_cells_used, cells only idle prefix caches hold (reclaimable)")
    kv_cells_total: int = 0
    started_at: float
    updated_at: float
    draining: bool = False
    ready: bool = Field(True, description="warmed up and claiming jobs (false while warming up or draining)")
    slots_active: int | None = Field(None, description="active slots now (elastic); None from older workers")
    degradation: str = Field("none", description="none, small_batch, cap_tokens or refuse")
    memory_ratio: float | None = Field(None, description="resident memory / the worker's memory limit")
    stream_tokens_per_s: float | None = Field(None, description="decode speed of each generating stream")
    spec: str = Field("off", description="speculative decoding's draft source: off, ngram or draft")
    spec_draft_tokens: int = Field(0, description="draft tokens decoded for verification since the worker started")
    spec_accepted_tokens: int = Field(0, description="of those, the tokens verification kept")
    load_s: float | None = Field(None, description="what loading its model cost (engine start + warm-up, seconds); "
                                                   "None while it loads the first")
    models: int = Field(1, description="models it can load (SLOTQ_MODELS / SLOTQ_MODELS_DIR); one loaded at a time")
    adapters: list[str] = Field(default_factory=list,
                                description="the LoRA adapters it loaded (SLOTQ_LORA), in index order")

    @field_validator("adapters", mode="before")
    @classmethod
    def _names_from_hash(cls, value: Any) -> Any:
        """The registry's hash holds the names comma-separated (a name has no comma: LORA_NAME_PATTERN)."""
        return [name for name in value.split(",") if name] if isinstance(value, str) else value

    @computed_field  # type: ignore[prop-decorator]   # pydantic's documented use on a property
    @property
    def spec_acceptance(self) -> float | None:
        """Accepted / drafted tokens since the worker started; None before its first draft. Derived,
        so the heartbeat does not carry it (:func:`~slotq.jobs.protocol.registry.beat`)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else None


class LaneInfo(BaseModel):
    lane: str
    queued: int = Field(description="jobs waiting to be claimed")
    deferred: int = Field(description="jobs waiting out a retry backoff")
    running: int
    oldest_queued_age_s: float | None
    preempted: int = Field(0, description="jobs of this lane that yielded their slot to a higher lane (handed back, "
                                          "no try spent), since the queue began")


class QueueInfo(BaseModel):
    """One queue: its lanes (counts are O(1) reads), live workers and dead letters; the totals
    over lanes and workers are derived (and included in JSON)."""

    queue: str
    lanes: list[LaneInfo]
    workers: list[WorkerInfo]
    dead_letters: int
    dead_letters_by_reason: dict[str, int] = Field(
        default_factory=dict, description="dead letters kept per reason (their error code, e.g. killed_its_worker)")
    interrupted_attempts: int = Field(
        0, description="attempts lost after delivering new tokens, since the queue began: resumed, no try spent")
    failed_attempts: int = Field(
        0, description="attempts that spent a try, since the queue began: a retryable error, or lost before "
                       "delivering new tokens")

    @computed_field
    def queued(self) -> int:
        return sum(lane.queued for lane in self.lanes)

    @computed_field
    def deferred(self) -> int:
        return sum(lane.deferred for lane in self.lanes)

    @computed_field
    def running(self) -> int:
        return sum(lane.running for lane in self.lanes)

    @computed_field
    def oldest_queued_age_s(self) -> float | None:
        ages = [lane.oldest_queued_age_s for lane in self.lanes if lane.oldest_queued_age_s is not None]
        return max(ages) if ages else None

    @computed_field
    def slots_total(self) -> int:
        return sum(w.slots_total for w in self.workers)

    @computed_field
    def slots_busy(self) -> int:
        return sum(w.slots_busy for w in self.workers)


class ModelInfo(BaseModel):
    """A model the fleet can serve, loaded or not (the catalog: :mod:`slotq.jobs.protocol.catalog`), and
    the jobs waiting for it in its queue: what ``slotq status`` lists under "models". An ``unloaded``
    model's jobs wait there, durably, until a worker that can load it switches to it."""

    model: str
    queue: str = Field(description="the queue its jobs wait in")
    kind: JobKind
    fingerprint: str = Field(description="its GGUF's fingerprint")
    status: Literal["loaded", "loading", "unloaded"] = Field(
        description="loaded: a ready worker claims its jobs; loading: a worker has it but is not ready (warming up "
                    "or draining); unloaded: no worker has it loaded")
    loaded_on: list[str] = Field(description="live workers that have it loaded")
    can_load: list[str] = Field(description="live workers that can load it (their catalog entries)")
    queued: int = Field(description="jobs waiting in its queue, every lane")
    deferred: int = Field(description="jobs waiting out a retry backoff")
    running: int
    oldest_queued_age_s: float | None
    load_s: float | None = Field(description="what loading it cost a worker, the shortest measured (None: never "
                                             "loaded yet)")
