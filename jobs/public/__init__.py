"""slotq: llama.cpp models behind a durable Redis queue. The producer's API in one short import::

    from slotq import SlotqClient, JobRequest

    client = await SlotqClient.connect("redis://localhost:6399/0")   # the embedded server `slotq worker` starts
    job = await client.enqueue(JobRequest(messages=[{"role": "user", "content": "Hi"}], max_tokens=64))

Every name here is loaded on first use (PEP 562), so ``import slotq`` costs nothing and a web app
that only enqueues never loads the worker, the gateway or llama.cpp. The rest of the code stays
where its process kind keeps it: ``slotq.jobs.worker``, ``slotq.jobs.gateway``, ``slotq.engine``
(see docs/architecture.md, "The code's map").

Layout: this package is the repository's ``jobs/public/`` folder, installed as the top-level
``slotq`` (pyproject's package-dir). The design fixes the repository's top level (``jobs/``,
``engine/``), so the short import needs a home inside one of them; it is ``jobs/`` because every
name it offers is the job layer's.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slotq.jobs.errors import (
        JobFailed,
        JobNotFound,
        JobRejected,
        JobTimeout,
        QueueFull,
        QuotaExceeded,
        RedisUnavailable,
        SlotqError,
        StreamGone,
    )
    from slotq.jobs.producer.client import EmbeddingResult, JobHandle, RerankResult, SlotqClient
    from slotq.jobs.producer.sync_client import SyncSlotqClient
    from slotq.jobs.protocol.schemas import (
        EmbeddingJobRequest,
        JobRequest,
        JobResult,
        JobStatus,
        RerankJobRequest,
        StreamEntry,
    )
    from slotq.jobs.protocol.wire import ChatMessage, SamplingParams
    from slotq.jobs.settings import ClientSettings

# name -> the module that defines it (imported when the name is first read)
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("SlotqClient", "JobHandle", "EmbeddingResult", "RerankResult"), "slotq.jobs.producer.client"),
    "SyncSlotqClient": "slotq.jobs.producer.sync_client",
    **dict.fromkeys(("JobRequest", "EmbeddingJobRequest", "RerankJobRequest", "JobResult", "JobStatus", "StreamEntry"),
                    "slotq.jobs.protocol.schemas"),
    **dict.fromkeys(("ChatMessage", "SamplingParams"), "slotq.jobs.protocol.wire"),
    "ClientSettings": "slotq.jobs.settings",
    **dict.fromkeys(("SlotqError", "RedisUnavailable", "QueueFull", "QuotaExceeded", "JobRejected", "JobNotFound",
                     "JobTimeout", "StreamGone", "JobFailed"), "slotq.jobs.errors"),
}

__all__ = [  # what `from slotq import ...` offers; each is defined in _EXPORTS' module
    "ChatMessage", "ClientSettings", "EmbeddingJobRequest", "EmbeddingResult", "JobFailed", "JobHandle", "JobNotFound",
    "JobRejected", "JobRequest", "JobResult", "JobStatus", "JobTimeout", "QueueFull", "QuotaExceeded",
    "RedisUnavailable", "RerankJobRequest", "RerankResult", "SamplingParams", "SlotqClient", "SlotqError",
    "StreamEntry", "StreamGone", "SyncSlotqClient",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'slotq' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value            # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
