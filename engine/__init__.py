"""slotq's continuous-batching engine on llama.cpp. Knows nothing about Redis or queues.

Every name here is imported on first use (PEP 562): ``Engine`` loads llama.cpp, and code that
needs one part, such as a producer checking a JSON schema (``slotq.engine.constraints``) or building
a request, loads that part alone, not the scheduler, the runner or the native library.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slotq.engine.config import CpuRepack, EngineConfig, EngineKnobs, FlashAttention, KVCacheType, KVLayout
    from slotq.engine.engine import Engine, RequestHandle
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
    from slotq.engine.request import ChatMessage, GenerationParams, GenerationRequest, LoraRef, SamplingParams
    from slotq.engine.scheduler import BatchingMode
    from slotq.engine.state import EngineState
    from slotq.engine.stats import EngineStats

# module -> the names it gives this package (each module is imported when one of its names is first read)
_MODULES: dict[str, tuple[str, ...]] = {
    "config": ("CpuRepack", "EngineConfig", "EngineKnobs", "FlashAttention", "KVCacheType", "KVLayout"),
    "errors": ("EngineDead", "EngineError", "EngineStopped", "GrammarError", "InvalidRequest", "KVExhausted",
               "PromptTooLong", "RequestFailed"),
    "events": ("ErrorInfo", "Event", "Finished", "FinishReason", "TextDelta", "Timings", "TokenLogprob", "TopLogprob",
               "Usage"),
    "model_files": ("bundled_model_path", "resolve_model_path"),
    "request": ("ChatMessage", "GenerationParams", "GenerationRequest", "LoraRef", "SamplingParams"),
    "scheduler": ("BatchingMode",),
    "state": ("EngineState",),
    "stats": ("EngineStats",),
    "engine": ("Engine", "RequestHandle"),
}
_EXPORTS = {name: f"slotq.engine.{module}" for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'slotq.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value            # later reads skip this function
    return value


__all__ = [
    "BatchingMode", "ChatMessage", "CpuRepack", "Engine", "EngineConfig", "EngineDead", "EngineError", "EngineKnobs",
    "EngineState", "EngineStats",
    "EngineStopped", "ErrorInfo", "Event", "FinishReason", "Finished", "FlashAttention", "GenerationParams",
    "GenerationRequest", "GrammarError", "InvalidRequest", "KVCacheType", "KVExhausted", "KVLayout", "LoraRef",
    "PromptTooLong", "RequestFailed", "RequestHandle", "SamplingParams", "TextDelta", "Timings", "TokenLogprob",
    "TopLogprob", "Usage",
    "bundled_model_path",
    "resolve_model_path",
]
