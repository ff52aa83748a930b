"""Job payloads across versions: what a producer writes and how a worker reads it.

Every payload carries ``schema_version`` (``MAJOR.MINOR``), so producers and workers can be
upgraded in either order during a rolling deploy:

* a payload of this worker's major version and an older or equal minor is validated strictly
  (an unknown field is a bug in the producer: ``invalid_payload``);
* a newer minor only *adds* optional fields: the worker ignores the ones it does not know, logs
  their names once, and runs the job;
* a newer major may change meanings: the worker refuses it with the dead-letter reason
  ``unsupported_payload_version`` (requeue it once the workers are upgraded), and never crashes.

A payload without a version comes from a producer older than versioning: it is 1.0.

Beside the version, a payload names its ``kind`` (:class:`~slotq.jobs.protocol.schemas.JobKind`) when it is
not a generation job: an embedding job's ``inputs`` validate as an :class:`EmbeddingJobRequest`. A worker
older than 1.3 reads an embedding payload as a generation job with unknown fields and refuses it as
``invalid_payload`` (it has no prompt), never runs it.

A rerank job (1.5) names the kind ``rerank`` and carries ``query`` and ``documents``
(:class:`RerankJobRequest`). A worker older than 1.5 refuses its kind as ``invalid_payload`` by name,
never runs it.

A payload may name the ``model`` it is for (1.4; the gateway always does): a worker of another model
refuses it as ``wrong_model`` (:mod:`slotq.jobs.worker.served_model`). A worker older than 1.4 ignores
the field, so upgrade the workers before the producers that name models.

A generation payload may name LoRA adapters (``lora``, 1.6). A worker older than 1.6 would ignore
them and answer with the base model, so upgrade the workers before the producers that send them.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from slotq.jobs.protocol.schemas import AnyJobRequest, EmbeddingJobRequest, JobKind, JobRequest, RerankJobRequest
from slotq.jobs.protocol.wire import ErrorInfo

log = logging.getLogger(__name__)

SCHEMA_VERSION = (1, 6)       # 1.1 added `lane`, 1.2 `tenant`, 1.3 `tools` and the like, `reasoning_format`,
                              # `logprobs`, and `kind` (embedding jobs: `inputs`, `truncate`), 1.4 `model`,
                              # 1.5 the kind `rerank` (`query`, `documents`), 1.6 `lora`
VERSION_FIELD = "schema_version"
KIND_FIELD = "kind"
_REQUEST_MODELS: dict[JobKind, type[AnyJobRequest]] = {JobKind.GENERATION: JobRequest,
                                                       JobKind.EMBEDDING: EmbeddingJobRequest,
                                                       JobKind.RERANK: RerankJobRequest}
_VERSION_RE = re.compile(r"^(\d+)\.(\d+)$")
_logged_ignored: set[tuple[str, ...]] = set()


def encode_payload(request: AnyJobRequest) -> dict[str, Any]:
    """The payload a producer enqueues: the request's non-default fields plus the schema version
    (and the kind, unless it is a generation job, so older payloads read as they always did)."""
    kind = {} if request.kind == JobKind.GENERATION else {KIND_FIELD: request.kind.value}
    return {VERSION_FIELD: "{}.{}".format(*SCHEMA_VERSION), **kind,
            **request.model_dump(mode="json", exclude_defaults=True)}


@dataclass
class Decoded:
    """A payload read by a worker: the request, or the error that dead-letters it."""

    request: AnyJobRequest | None = None
    error: ErrorInfo | None = None
    ignored: list[str] = field(default_factory=list)      # unknown fields of a newer minor version


def decode_payload(payload: Any) -> Decoded:
    if not isinstance(payload, dict):
        return Decoded(error=_invalid(f"payload must be a mapping, not {type(payload).__name__}"))
    body = dict(payload)
    raw_version = body.pop(VERSION_FIELD, "1.0")
    match = _VERSION_RE.match(raw_version) if isinstance(raw_version, str) else None
    if match is None:
        return Decoded(error=_invalid(f"{VERSION_FIELD} must look like '1.0', not {raw_version!r}"))
    version = (int(match[1]), int(match[2]))
    raw_kind = body.pop(KIND_FIELD, JobKind.GENERATION.value)
    if raw_kind not in JobKind.__members__.values():
        return Decoded(error=_invalid(f"{KIND_FIELD} must be one of {', '.join(k.value for k in JobKind)}, "
                                      f"not {raw_kind!r}"))
    model = _REQUEST_MODELS[JobKind(raw_kind)]
    if version[0] != SCHEMA_VERSION[0]:
        return Decoded(error=ErrorInfo(code="unsupported_payload_version", retryable=False, message=(
            f"payload schema {raw_version} is not understood by this worker (it reads "
            f"{SCHEMA_VERSION[0]}.x); upgrade the workers, then requeue with `slotq dlq requeue`")))
    ignored: list[str] = []
    if version > SCHEMA_VERSION:
        ignored = _strip_unknown(body, model)
        if ignored and tuple(ignored) not in _logged_ignored:
            _logged_ignored.add(tuple(ignored))
            log.warning("payload schema %s is newer than this worker's %d.%d: ignoring %s",
                        raw_version, *SCHEMA_VERSION, ", ".join(ignored))
    try:
        return Decoded(request=model.model_validate(body), ignored=ignored)
    except ValidationError as exc:
        return Decoded(error=_invalid(f"job payload failed validation: {_first_error(exc)}"))


def _strip_unknown(body: dict[str, Any], model: type[AnyJobRequest]) -> list[str]:
    """Remove the fields (at any depth) that this version's request model forbids; return their
    dotted names. Driven by the model's own errors, so nested models need no special casing."""
    removed: list[str] = []
    for _ in range(32):      # each pass removes every extra field pydantic reports
        try:
            model.model_validate(body)
            return removed
        except ValidationError as exc:
            extras = [err["loc"] for err in exc.errors() if err["type"] == "extra_forbidden"]
        if not extras:
            return removed
        for loc in extras:
            parent: Any = body
            for part in loc[:-1]:
                parent = parent[part]
            parent.pop(loc[-1], None)
            removed.append(".".join(str(p) for p in loc))
    return removed


def _invalid(message: str) -> ErrorInfo:
    return ErrorInfo(code="invalid_payload", retryable=False, message=message)


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "payload"
    return f"{where}: {err['msg']}"
