"""How a bulk run names its jobs, so that running the same command again finds them.

A run's *identity* is a hash of the queue it feeds and the text of its input (after gunzip):
the same lines sent to the same queue are the same run, however the file is named, compressed or
piped in, and another file, or the same file for another model's queue, is another run. Each
line's job id is ``bulk:<identity>:<line number>``, and it is the job's idempotency key: enqueueing
it again while the job is queued, running, or has a result waiting returns that job instead of
starting a second one. A run of another tenant than the default scopes the key to its tenant
(``bulk:<identity>:<line>@<tenant>``, :func:`slotq.jobs.protocol.schemas.tenant_job_id`). The output file records
the same ids, so a rerun knows which lines are done.
"""

from __future__ import annotations

import hashlib
import re

from slotq.jobs.protocol.schemas import split_job_id

IDENTITY_CHARS = 16                        # 64 bits of SHA-256
_JOB_ID_RE = re.compile(r"^bulk:([0-9a-f]{16}):([1-9][0-9]*)$")


def new_hasher(queue_name: str) -> hashlib._Hash:
    """Feed it the input's text; :func:`identity_of` gives the run's identity."""
    return hashlib.sha256(b"slotq-bulk/1\0" + queue_name.encode() + b"\0")


def identity_of(hasher: hashlib._Hash) -> str:
    return hasher.hexdigest()[:IDENTITY_CHARS]


def job_id(identity: str, line: int) -> str:
    return f"bulk:{identity}:{line}"


def parse_job_id(value: object) -> tuple[str, int] | None:
    """(identity, line number) of a bulk job id, of any tenant; None for anything else."""
    match = _JOB_ID_RE.match(split_job_id(value)[0]) if isinstance(value, str) else None
    return (match[1], int(match[2])) if match else None
