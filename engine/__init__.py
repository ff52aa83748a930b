"""slotq's continuous-batching engine on llama.cpp. Knows nothing about Redis or queues.

``Engine`` (and with it llama.cpp) is imported on first use, so code that only needs the
request and event types, such as a producer enqueueing jobs, does not load the native library.
"""

from typing import TYPE_CHECKING, Any

from slotq.engine.config import CpuRepack, EngineConfig, EngineKnobs, FlashAttention, KVCacheType, KVLayout
from slotq.engine.errors import (
    EngineDead,
    EngineError,
    EngineStopped,
    GrammarError,
    InvalidRequest,
    KVExhausted,
    PromptTooLong,
    RequestFailed,
)
from slotq.engine.events import (
    ErrorInfo,
    Event,
    Finished,
    FinishReason,
    TextDelta,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from slotq.engine.model_files import bundled_model_path, resolve_model_path
from slotq.engine.request import ChatMessage, GenerationParams, GenerationRequest, SamplingParams
from slotq.engine.scheduler import BatchingMode
from slotq.engine.state import EngineState
from slotq.engine.stats import EngineStats

if TYPE_CHECKING:
    from slotq.engine.engine import Engine, RequestHandle


def __getattr__(name: str) -> Any:
    if name in ("Engine", "RequestHandle"):
        from slotq.engine import engine as _engine_module

        return getattr(_engine_module, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


__all__ = [
    "BatchingMode", "ChatMessage", "CpuRepack", "Engine", "EngineConfig", "EngineDead", "EngineError", "EngineKnobs",
    "EngineState", "EngineStats",
    "EngineStopped", "ErrorInfo", "Event", "FinishReason", "Finished", "FlashAttention", "GenerationParams",
    "GenerationRequest", "GrammarError", "InvalidRequest", "KVCacheType", "KVExhausted", "KVLayout", "PromptTooLong",
    "RequestFailed", "RequestHandle", "SamplingParams", "TextDelta", "Timings", "TokenLogprob", "TopLogprob", "Usage",
    "bundled_model_path",
    "resolve_model_path",
]
