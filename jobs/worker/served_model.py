"""What a worker serves: its model's name, the kind of job it runs, and a fingerprint of its GGUF.

Every job that names a model (the gateway names the one the request asked for) is checked against
it before it runs (:meth:`ServedModel.refusal`): a job for another model or kind is never run by
this worker. Results and the final stream entries carry the name and the fingerprint, so a reader
sees which model answered, not only which name it asked for.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from slotq.jobs.protocol.schemas import AnyJobRequest, JobKind
from slotq.jobs.protocol.wire import ErrorInfo

FINGERPRINT_SPAN = 1 << 20        # bytes read from each end of the file
_HOW_TO_SERVE = {JobKind.EMBEDDING: " (slotq worker --embeddings)",
                 JobKind.RERANK: " (slotq worker on a reranker GGUF, or --rerank)"}


def gguf_fingerprint(path: Path) -> str:
    """A fingerprint of a GGUF file: SHA-256 of its size, its first MiB and its last MiB, in 16 hex
    digits. llama.cpp keeps no hash of a model, and hashing gigabytes would delay every start by
    seconds; the first MiB holds the header (architecture, hyperparameters, quantization type and
    most of the vocabulary) and the last MiB the final tensors' weights, so two quantizations, two
    fine-tunes or two sizes of a model differ. Not a content hash: it identifies a file, it does
    not prove its integrity."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        size = os.fstat(file.fileno()).st_size
        digest.update(size.to_bytes(8, "little"))
        digest.update(file.read(FINGERPRINT_SPAN))
        if size > FINGERPRINT_SPAN:
            file.seek(max(FINGERPRINT_SPAN, size - FINGERPRINT_SPAN))
            digest.update(file.read(FINGERPRINT_SPAN))
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class ServedModel:
    """The model a worker serves: the ``name`` clients ask for (``SLOTQ_MODEL_NAME`` or the file's),
    the ``kind`` of job it runs and its file's :func:`gguf_fingerprint`."""

    name: str
    kind: JobKind
    fingerprint: str

    def refusal(self, job: AnyJobRequest, *, worker: str, queue: str) -> ErrorInfo | None:
        """Why this worker must not run ``job`` (None: it may). A job of the other kind, or one that
        names another model, is refused by name; a job that names no model (``slotq enqueue``, a
        producer that knows one model) is the queue's model's."""
        if job.kind != self.kind:
            return ErrorInfo(code="wrong_job_kind", retryable=False, field="model", message=(
                f"{'an' if job.kind == JobKind.EMBEDDING else 'a'} {job.kind.value} job reached a worker of "
                f"{self.kind.value} jobs ({worker}, model {self.name}, "
                f"queue {queue}); {job.kind.value} jobs go to the queue of a model that serves them"
                + _HOW_TO_SERVE.get(job.kind, "")))
        if job.model is not None and job.model != self.name:
            return ErrorInfo(code="wrong_model", retryable=False, field="model", message=(
                f"the job asks for model {job.model!r}, but queue {queue} is served by {self.name!r} (worker "
                f"{worker}); it was not run. Enqueue it on a queue of {job.model!r} (each model has its own "
                "SLOTQ_QUEUE_NAME), or requeue it once one serves this queue"))
        return None
