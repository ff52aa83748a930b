"""A job's result, as its attempt's outcomes sum up: pure functions, no Redis.

Every result names whose attempt ended the job (:class:`Attribution`: the worker and its model, the
attempt number, the interruptions before it, the job's metadata and any ``max_tokens`` cap). A job of
several choices gets one :class:`~slotq.jobs.protocol.schemas.ChoiceResult` each, and the result
reads choice 0 for its text, finish reason (and stop sequence) and timings, counts the prompt once and adds up the
completions. A result rebuilt from a complete stream (an earlier attempt ended the job and only its
finish was lost) is that attempt's, naming its worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from slotq.jobs.protocol.schemas import ChoiceResult, EntryKind, JobResult, JobStatus, MaxTokensCap
from slotq.jobs.protocol.wire import ErrorInfo, FinishReason, Timings, Usage
from slotq.jobs.worker.resume import Delivered, Replies
from slotq.jobs.worker.wire_edge import Done


@dataclass(frozen=True)
class Attribution:
    """What every result of an attempt says besides its outcome."""

    job_id: str
    worker: str | None
    attempts: int                   # the attempt's number
    interruptions: int
    metadata: dict[str, Any] = field(default_factory=dict)
    max_tokens_cap: MaxTokensCap | None = None
    model: str | None = None                # the model the worker serves, and its GGUF's fingerprint
    model_fingerprint: str | None = None

    def fields(self) -> dict[str, Any]:
        """The result fields every outcome shares."""
        return {"id": self.job_id, "worker": self.worker, "model": self.model,
                "model_fingerprint": self.model_fingerprint, "attempts": self.attempts,
                "interruptions": self.interruptions, "metadata": self.metadata}


def summarize(choices: list[ChoiceResult], about: Attribution, *, status: JobStatus, text: str,
              fallback_reason: FinishReason | None = None) -> JobResult:
    """One result from the per-choice outcomes: choice 0 gives text, reason and timings; the
    prompt counts once and completions add up."""
    first = choices[0] if choices and choices[0].index == 0 else None
    return JobResult(
        status=status, text=text,
        finish_reason=first.finish_reason if first else fallback_reason,
        stop_sequence=first.stop_sequence if first else None,
        usage=Usage(prompt_tokens=first.usage.prompt_tokens if first else 0,
                    completion_tokens=sum(c.usage.completion_tokens for c in choices),
                    cached_prompt_tokens=sum(c.usage.cached_prompt_tokens for c in choices),
                    reasoning_tokens=sum(c.usage.reasoning_tokens for c in choices)),
        timings=first.timings if first else None,
        choices=choices, max_tokens_cap=about.max_tokens_cap, **about.fields(),
    )


def succeeded(replies: Replies, finished: dict[int, Done], about: Attribution) -> JobResult:
    """The result of a generation whose choices all ended (``finished``, by choice)."""
    return summarize([replies.choice(c, f.finish_reason, f.usage, f.timings, f.stop_sequence)
                      for c, f in sorted(finished.items())],
                     about, status=JobStatus.SUCCEEDED, text=replies.text(0))


def failed(error: ErrorInfo | None, about: Attribution, usage: Usage | None = None) -> JobResult:
    """A failed job's result; ``usage``: what it generated before it failed (its prompt and the tokens
    its choices delivered), as a cancelled job reports its own."""
    return JobResult(status=JobStatus.FAILED, error=error, finish_reason=FinishReason.ERROR,
                     usage=usage or Usage(), **about.fields())


def pooled(about: Attribution, *, status: JobStatus, finish_reason: FinishReason, usage: Usage) -> JobResult:
    """The result of an embedding or rerank job, before its vectors or scores are added."""
    return JobResult(status=status, finish_reason=finish_reason, usage=usage, **about.fields())


def from_stream(delivered: Delivered, about: Attribution) -> JobResult:
    """The result a complete stream holds (``delivered.final`` is set): an earlier attempt wrote its
    final entry, and only its finish was lost (e.g. its lease expired during a cut, after the final
    entry reached Redis). It names that attempt, its worker and its worker's model."""
    final = delivered.final
    assert final is not None
    about = replace(about, worker=final.worker, attempts=final.attempt, model=final.model,
                    model_fingerprint=final.model_fingerprint)
    if final.kind == EntryKind.ERROR:
        return failed(final.error, about, final.usage)
    choices = [delivered.replies.choice(c, d.finish_reason, d.usage or Usage(), d.timings or Timings(), d.stop_sequence)
               for c, d in sorted(delivered.done.items()) if d.finish_reason is not None]
    status = JobStatus.CANCELLED if final.finish_reason == FinishReason.CANCELLED else JobStatus.SUCCEEDED
    return summarize(choices, about, status=status, text=delivered.replies.text(0),
                     fallback_reason=final.finish_reason)
