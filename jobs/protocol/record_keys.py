"""Redis key names of streams, dead letters and workers (the queue's own keys, arq's records
included, are in ``jobs/protocol/keys.py``).

Per-job keys put the job id in braces so a future move to Redis Cluster keeps them in one slot.
"""

from __future__ import annotations


def stream_key(job_id: str) -> str:
    return f"slotq:stream:{{{job_id}}}"


def write_mark_key(writer_id: str) -> str:
    """The last flush a stream writer applied, and its answer (makes a re-sent flush idempotent)."""
    return f"slotq:stream-mark:{writer_id}"


def dead_letter_key(job_id: str) -> str:
    return f"slotq:dlq:{{{job_id}}}"


JOB_FUNCTION = "generate"                # the one arq function name
DEAD_LETTER_INDEX = "slotq:dlq"          # zset: job id -> time it was dead-lettered
WORKER_PREFIX = "slotq:worker:"          # hash per live worker, with a TTL
WORKER_INDEX = "slotq:workers"           # zset: worker id -> time of its last heartbeat (ms)


def worker_key(worker_id: str) -> str:
    return f"{WORKER_PREFIX}{worker_id}"
