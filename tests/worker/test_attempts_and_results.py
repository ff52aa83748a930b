"""An attempt's accounting (jobs/worker/attempts.py: what an error costs, when a job is dead-lettered
before running) and its result (jobs/worker/results.py: choices summed up). Pure: no Redis, no engine."""

from __future__ import annotations

import pytest

from slotq.jobs.protocol.redis_queue import AttemptStart, AttemptVerdict
from slotq.jobs.protocol.schemas import EntryKind, JobStatus, StreamEntry
from slotq.jobs.protocol.wire import ErrorInfo, FinishReason, Timings, Usage
from slotq.jobs.worker import results
from slotq.jobs.worker.attempts import ENGINE_DEAD, AttemptAccount, Failure
from slotq.jobs.worker.results import Attribution
from slotq.jobs.worker.resume import Delivered, Replies
from slotq.jobs.worker.settings import WorkerSettings
from slotq.jobs.worker.wire_edge import Done

SETTINGS = WorkerSettings(max_tries=3, max_interruptions=2, max_worker_deaths=2, retry_backoff_s=0.5)


def account(attempt: int, interruptions: int = 0) -> AttemptAccount:
    a = AttemptAccount(job_id="j", attempt=attempt, settings=SETTINGS, ledger=None, gate=None)
    a.interruptions = interruptions
    return a


def test_an_error_is_handed_back_failed_retried_with_doubling_backoff_or_dead_lettered() -> None:
    retryable = ErrorInfo(code="boom", message="", retryable=True)
    assert account(1).classify(ErrorInfo(code=ENGINE_DEAD, message="", retryable=True)) is Failure.HAND_BACK
    assert account(1).classify(ErrorInfo(code="bad", message="", retryable=False)) is Failure.FAIL
    assert account(1).classify(retryable) is Failure.RETRY
    assert [account(n).retry_delay_s() for n in (1, 2)] == [0.5, 1.0]
    assert account(3).classify(retryable) is Failure.DEAD_LETTER          # the last try
    assert account(4, interruptions=2).classify(retryable) is Failure.RETRY   # interruptions spent no try


@pytest.mark.parametrize(("attempt", "interruptions", "start", "code"), [
    (1, 0, None, None),
    (4, 0, None, "tries_exhausted"),
    (4, 1, None, None),
    (6, 3, None, "interruptions_exhausted"),
    (2, 0, AttemptStart(AttemptVerdict.REFUSED, 0, 0, 1, worker_deaths=2), "killed_its_worker"),
])
def test_a_job_is_dead_lettered_before_running_once_its_tries_interruptions_or_worker_deaths_are_spent(
        attempt: int, interruptions: int, start: AttemptStart | None, code: str | None) -> None:
    dead_letter = account(attempt, interruptions).dead_letter(start, delivered_tokens=7)
    assert (dead_letter.error.code if dead_letter else None) == code
    if start is not None and dead_letter is not None:
        assert dead_letter.worker_deaths == 2


ABOUT = Attribution(job_id="j", worker="w", attempts=2, interruptions=1, metadata={"k": "v"})


def test_a_result_reads_choice_zero_counts_the_prompt_once_and_adds_up_completions() -> None:
    replies = Replies()
    replies.add(0, "zero", "", [])
    replies.add(1, "one", "", [])
    finished = {c: Done(choice=c, finish_reason=FinishReason.LENGTH, timings=Timings(),
                        usage=Usage(prompt_tokens=5, completion_tokens=3 + c)) for c in (1, 0)}
    result = results.succeeded(replies, finished, ABOUT)
    assert (result.status, result.text, result.finish_reason) == (JobStatus.SUCCEEDED, "zero", FinishReason.LENGTH)
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (5, 7)
    assert [c.text for c in result.choices] == ["zero", "one"]
    assert (result.worker, result.attempts, result.interruptions, result.metadata) == ("w", 2, 1, {"k": "v"})


def test_a_replys_pieces_join_in_order_per_choice_text_and_reasoning_apart() -> None:
    replies = Replies()
    for i in range(1000):
        replies.add(0, f"{i} ", "hm " if i % 2 else "", [])
    replies.add(1, "other", "", [])
    assert replies.text(0) == "".join(f"{i} " for i in range(1000))
    assert replies.reasoning(0) == "hm " * 500 and replies.reasoning(1) == "" and replies.text(2) == ""
    choice = replies.choice(0, FinishReason.STOP, Usage(), Timings())
    assert (choice.text, choice.reasoning) == (replies.text(0), replies.reasoning(0))


def test_a_result_from_a_complete_stream_names_the_attempt_that_completed_it() -> None:
    delivered = Delivered()
    delivered.final = StreamEntry(id="1-0", kind=EntryKind.ERROR, attempt=1, worker="other", final=True,
                                  error=ErrorInfo(code="bad", message="", retryable=False))
    result = results.from_stream(delivered, ABOUT)
    assert (result.status, result.worker, result.attempts) == (JobStatus.FAILED, "other", 1)
    assert result.error is not None and result.error.code == "bad"
