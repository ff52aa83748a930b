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
    """The engine shut down before the request finished (e.g. the worker is draining)."""

    code = "engine_stopped"
