"""arq's key names and record formats, written out here so that producers import no arq.

Importing any arq module runs ``arq/__init__``, which imports ``arq.worker`` (and its cron and
signal handling): a producer that only enqueues and reads results would load the worker's runtime
with it. What a producer shares with arq's ``run_job`` is data, not code -- the keys it reads and
writes, the job record an enqueue writes, the result record a producer reads -- so it is spelled
out here, as arq 0.28 has it (``arq.constants``, ``arq.jobs.serialize_job``, ``serialize_result``,
``deserialize_result``). tests/protocol/test_arq_formats.py checks each against arq's own, byte for
byte, so an arq upgrade that changes one fails there. The worker side, which runs arq, is
:mod:`slotq.jobs.protocol.arq_adapter`, still the only module that imports arq.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# arq's key names (arq.constants): run_job reads and writes these keys, so the queue's scripts use them too (keys.py)
JOB_KEY_PREFIX = "arq:job:"
RETRY_KEY_PREFIX = "arq:retry:"
RESULT_KEY_PREFIX = "arq:result:"
ABORT_JOBS_SET = "arq:abort"

Serializer = Callable[[dict[str, Any]], bytes]       # arq.jobs.Serializer
Deserializer = Callable[[bytes], dict[str, Any]]     # arq.jobs.Deserializer

_EXCEPTION = "__exception__"


def exception_data(exc: BaseException) -> dict[str, str]:
    """How an exception is serialized: arq stores one as the result of a job it failed (expired,
    aborted, out of tries, timed out), and msgpack cannot carry it."""
    return {_EXCEPTION: type(exc).__name__, "message": str(exc)}


def job_record(function: str, payload: Any, enqueued_ms: int, serializer: Serializer) -> bytes:
    """The job record an enqueue writes (``JOB_KEY_PREFIX + id``): ``function(payload)``, no try
    counted yet (arq's ``serialize_job``)."""
    return serializer({"t": None, "f": function, "a": (payload,), "k": {}, "et": enqueued_ms})


def result_record(job_id: str, function: str, value: Any, queue_name: str, now_ms: int,
                  serializer: Serializer) -> bytes:
    """The result record of a job that no worker ran (e.g. cancelled while queued), stored as a
    success with ``value`` and attempt 0 (arq's ``serialize_result``: a value that cannot be
    serialized is stored as a failure with a message instead)."""
    record = {"t": 0, "f": function, "a": (), "k": {}, "et": now_ms, "s": True, "r": value, "st": now_ms,
              "ft": now_ms, "q": queue_name, "id": job_id}
    try:
        return serializer(record)
    except Exception:
        return serializer({**record, "r": "unable to serialize result", "s": False})


@dataclass(frozen=True)
class ResultRecord:
    """A finished job's result record (:func:`read_result_record`)."""

    attempts: int                       # the attempt that ended the job (0: no worker ran it)
    output: dict[str, Any] | None       # what the job function returned, when it returned a mapping
    cancelled: bool                     # aborted: arq stored a CancelledError
    error: str                          # a failure's exception class ("" when the record names none)
    message: str                        # a failure's message (the stored value's text when it has none)


def read_result_record(raw: bytes, deserializer: Deserializer) -> ResultRecord:
    """Decode a result record, whether the job function returned or arq failed the job and stored
    an exception (:func:`exception_data`)."""
    record = deserializer(raw)
    value, success = record["r"], record["s"]
    if isinstance(value, dict):
        error, message = value.get(_EXCEPTION, ""), value.get("message", str(value))
    else:
        error, message = "", str(value)
    return ResultRecord(attempts=record["t"], output=value if success and isinstance(value, dict) else None,
                        cancelled=error == "CancelledError", error=error, message=message)
