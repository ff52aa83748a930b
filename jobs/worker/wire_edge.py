"""Where a worker crosses between the wire and the engine: a job into an engine request, and the
engine's events into the wire's types (:mod:`slotq.jobs.protocol.wire`): a finished choice as a
:class:`Done`, a text delta's tool-call pieces and logprobs as the wire's (its text and token ids
need nothing).

The wire is a contract with running producers and workers; the engine's types may change. Only
this module speaks both, so an engine change shows up here (and in ``tests/worker/test_wire_edge.py``,
which checks the two statements of every shape agree), never silently in Redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from slotq.engine import Finished, GenerationRequest
from slotq.engine import TokenLogprob as EngineTokenLogprob
from slotq.engine.reply_parser import ToolCallDelta as EngineToolCallDelta
from slotq.engine.request import EmbeddingRequest, RerankRequest
from slotq.jobs.protocol.schemas import EmbeddingJobRequest, JobRequest, RerankJobRequest
from slotq.jobs.protocol.wire import (
    EmbeddingParams,
    ErrorInfo,
    FinishReason,
    GenerationParams,
    RerankParams,
    Timings,
    TokenLogprob,
    ToolCallDelta,
    Usage,
)


@dataclass(frozen=True, slots=True)
class Done:
    """How one choice ended (the engine's ``Finished``), in the wire's types: what a done or error
    entry carries. The worker also writes its own (a choice cancelled, or completed by earlier attempts)."""

    choice: int
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    error: ErrorInfo | None = None
    stop_sequence: str | None = None


def to_engine_request(job: JobRequest, *, request_id: str, max_tokens: int, priority_class: int,
                      lent_reserve: bool, resume_tokens: list[int]) -> GenerationRequest:
    """The engine request that runs a generation job: its generation fields (the job layer's own,
    lane, tenant, metadata, stay here), with what only the worker decides: the lane's priority
    class, whether the reserve is lent, ``max_tokens`` (a degraded worker caps it) and the tokens
    earlier attempts delivered. The engine validates it again, by its own rules."""
    params = job.model_dump(include=set(GenerationParams.model_fields))
    params["max_tokens"] = max_tokens
    return GenerationRequest(id=request_id, priority_class=priority_class, lent_reserve=lent_reserve,
                             resume_tokens=resume_tokens, **params)


def to_engine_embedding_request(job: EmbeddingJobRequest, *, request_id: str) -> EmbeddingRequest:
    """The engine request that runs an embedding job (its embedding fields only)."""
    return EmbeddingRequest(id=request_id, **job.model_dump(include=set(EmbeddingParams.model_fields)))


def to_engine_rerank_request(job: RerankJobRequest, *, request_id: str) -> RerankRequest:
    """The engine request that runs a rerank job (its query and documents only)."""
    return RerankRequest(id=request_id, **job.model_dump(include=set(RerankParams.model_fields)))


def from_engine_finished(event: Finished) -> Done:
    """How a choice ended, in the wire's types (once per choice)."""
    return Done(choice=event.choice, finish_reason=FinishReason(event.finish_reason.value),
                usage=Usage.model_validate(event.usage, from_attributes=True),
                timings=Timings.model_validate(event.timings, from_attributes=True),
                error=None if event.error is None else ErrorInfo.model_validate(event.error, from_attributes=True),
                stop_sequence=event.stop_sequence)


def wire_tool_calls(pieces: Sequence[EngineToolCallDelta]) -> list[ToolCallDelta]:
    """A delta's tool-call pieces in the wire's types. A delta's text, reasoning and token ids are
    ``str`` and ``int`` on both sides and cross as they are: only these and :func:`wire_logprobs`
    are converted, and only when a delta has them (the per-token path of plain text converts nothing)."""
    return [ToolCallDelta(index=d.index, id=d.id, name=d.name, arguments=d.arguments) for d in pieces]


def wire_logprobs(logprobs: Sequence[EngineTokenLogprob]) -> list[TokenLogprob]:
    """A delta's logprobs (one per token id) in the wire's types."""
    return [TokenLogprob.model_validate(lp, from_attributes=True) for lp in logprobs]
