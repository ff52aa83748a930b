"""What a degraded worker does with a job it is about to start: run it as asked, run it with a
smaller ``max_tokens`` (and say so in the result), or refuse it so that it goes back to the queue.
Pure: the job run applies the verdict."""

from __future__ import annotations

from dataclasses import dataclass

from slotq.jobs.protocol.schemas import MaxTokensCap
from slotq.jobs.protocol.wire import ErrorInfo
from slotq.jobs.worker.elastic.controller import Degradation

WORKER_OVERLOADED = "worker_overloaded"


@dataclass(frozen=True)
class Verdict:
    refuse: ErrorInfo | None = None          # retryable: hand the job back without using a try
    cap: MaxTokensCap | None = None          # run with cap.applied tokens at most


RUN_AS_ASKED = Verdict()


def verdict(level: Degradation, *, max_tokens: int, resuming: bool, cap_tokens: int, worker_id: str,
            why: str) -> Verdict:
    """``resuming``: an earlier attempt already streamed tokens; such a job is finished as it was
    started (no cap, no refusal: handing it back would only move the same load elsewhere)."""
    if resuming or level == Degradation.NONE:
        return RUN_AS_ASKED
    if level >= Degradation.REFUSE:
        return Verdict(refuse=ErrorInfo(
            code=WORKER_OVERLOADED, retryable=True,
            message=f"worker {worker_id} is refusing new jobs ({why}); the job went back to the queue, unstarted and "
                    "without using a try, for another worker"))
    if level >= Degradation.CAP_TOKENS and max_tokens > cap_tokens:
        return Verdict(cap=MaxTokensCap(requested=max_tokens, applied=cap_tokens, reason=(
            f"worker {worker_id} is degraded ({why}): max_tokens capped at {cap_tokens} (SLOTQ_DEGRADED_MAX_TOKENS)")))
    return RUN_AS_ASKED
