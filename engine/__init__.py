"""slotq's continuous-batching engine on llama.cpp. Knows nothing about Redis or queues."""

from engine.config import EngineConfig, FlashAttention, KVCacheType
from engine.engine import Engine, RequestHandle
from engine.errors import EngineError, GrammarError, InvalidRequest, KVExhausted, PromptTooLong
from engine.events import ErrorInfo, Event, Finished, FinishReason, TextDelta, Timings, Usage
from engine.model_files import bundled_model_path, resolve_model_path
from engine.request import ChatMessage, GenerationRequest, SamplingParams
from engine.scheduler import BatchingMode
from engine.stats import EngineStats

__all__ = [
    "BatchingMode", "ChatMessage", "Engine", "EngineConfig", "EngineError", "EngineStats", "ErrorInfo", "Event",
    "FinishReason", "Finished", "FlashAttention", "GenerationRequest", "GrammarError", "InvalidRequest",
    "KVCacheType", "KVExhausted", "PromptTooLong", "RequestHandle", "SamplingParams", "TextDelta", "Timings",
    "Usage", "bundled_model_path", "resolve_model_path",
]
