"""Errors the engine raises or reports, each with a stable code and a retryable flag.

The job layer turns these into stream error events and decides whether to retry, so the
classification lives here, next to where the failures happen, rather than in string matching.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class. ``code`` is stable and machine-readable; ``retryable`` says whether another
    attempt (possibly on another worker) could succeed."""

    code = "engine_error"
    retryable = True

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class InvalidRequest(EngineError):
    """The request can never succeed as written: a bad parameter, a prompt that cannot fit."""

    code = "invalid_request"
    retryable = False


class ModelCannotRank(InvalidRequest):
    """A rerank request (or a rerank engine) for a model that gives no relevance score: its GGUF has no
    rank pooling (``<arch>.pooling_type`` = rank, a cross-encoder's classification head)."""

    code = "model_cannot_rank"


class PromptTooLong(InvalidRequest):
    code = "prompt_too_long"


class GrammarError(InvalidRequest):
    code = "invalid_grammar"


class KVExhausted(EngineError):
    """The KV cache could not hold this sequence even after preempting others."""

    code = "kv_exhausted"


class DecodeFailed(EngineError):
    """llama_decode failed for a reason other than KV space; the sequences involved are failed."""

    code = "decode_failed"


class EngineStopped(EngineError):
    """The engine shut down before the request finished (e.g. the worker is draining), or a
    request arrived after :meth:`Engine.close`."""

    code = "engine_stopped"


class EngineDead(EngineError):
    """The engine thread crashed. Nothing more will run on this engine: every request it held
    ends with this error and new ones are refused at once. Retryable: another worker (or this
    one, restarted) can run the request."""

    code = "engine_dead"

    @classmethod
    def from_crash(cls, exc: BaseException) -> EngineDead:
        return cls(f"the engine thread crashed ({type(exc).__name__}: {exc}); this engine runs no more requests")


class RequestFailed(EngineError):
    """An unexpected error while setting up or sampling one request (not a bad request: those
    are :class:`InvalidRequest`). Only that request fails; the engine keeps running. Retryable,
    because the cause may be transient (e.g. an allocation); ``max_tries`` bounds the retries
    of one that is not."""

    code = "request_failed"

    @classmethod
    def from_exception(cls, exc: BaseException, stage: str) -> RequestFailed:
        return cls(f"the engine failed while {stage} this request ({type(exc).__name__}: {exc})")
