"""LoRA adapters at the gateway: ``model="base:adapter"``, and a request's ``lora`` checked against the workers.

Workers advertise the adapters they loaded (``SLOTQ_LORA``, in index order) in their heartbeats
(:class:`~slotq.jobs.protocol.schemas.WorkerInfo.adapters`). Any live worker of a model may claim
its job, so an adapter is offered only where every live worker of the model has loaded it at the
same index: that is what ``/v1/models`` lists (as ``base:adapter`` cards) and what a request may
name. A request that names another is a 400 naming the entry, before anything is enqueued.

A name that some worker serves as it is (``llama3:8b``) is that model, never a base and an adapter.
"""

from __future__ import annotations

from collections.abc import Mapping

from slotq.jobs.gateway.routing import ModelRoute
from slotq.jobs.openai.errors import ApiError
from slotq.jobs.protocol.schemas import JobKind, JobRequest, WorkerInfo
from slotq.jobs.protocol.wire import LoraRef

SEPARATOR = ":"


def common_adapters(workers: list[WorkerInfo]) -> list[str]:
    """The adapters every worker has loaded at the same index (a prefix of each list): the ones a
    job of the model may name, by index or name, whichever worker claims it."""
    if not workers:
        return []
    common: list[str] = []
    for names in zip(*(w.adapters for w in workers), strict=False):
        if len(set(names)) != 1:
            break
        common.append(names[0])
    return common


def split_model(model: str, routes: Mapping[str, ModelRoute]) -> tuple[str, str | None]:
    """``model`` as a served name and the adapter it names: ``("smollm2", "style")`` for
    ``smollm2:style`` when ``smollm2`` is served and ``smollm2:style`` is not; else the name as it is."""
    if model in routes or SEPARATOR not in model:
        return model, None
    base, _, adapter = model.rpartition(SEPARATOR)
    return (base, adapter) if base in routes else (model, None)


def with_adapter(job: JobRequest, adapter: str) -> JobRequest:
    """The job with the adapter its model name named added to its ``lora`` (at its configured
    scale), unless the ``lora`` field names it too (then that entry's scale holds)."""
    if any(ref.id == adapter for ref in job.lora):
        return job
    return job.model_copy(update={"lora": [*job.lora, LoraRef(id=adapter)]})


def check_lora(job: JobRequest, route: ModelRoute, adapter: str | None) -> None:
    """A 400 naming the ``lora`` entry (or ``model``, for ``base:adapter``) that the model's workers
    have not all loaded."""
    loaded = common_adapters(route.workers)
    offered = ", ".join(f"{name} (id {i})" for i, name in enumerate(loaded)) or "none"
    if adapter is not None and adapter not in loaded:
        raise ApiError(404, f"model {route.model!r} has no LoRA adapter {adapter!r} (loaded: {offered})",
                       param="model", code="model_not_found")
    named: set[int] = set()
    for i, ref in enumerate(job.lora):
        index = loaded.index(ref.id) if ref.id in loaded else None if isinstance(ref.id, str) else ref.id
        if index is None or index >= len(loaded):
            raise ApiError.invalid(f"lora[{i}].id: model {route.model!r} has no LoRA adapter {ref.id!r} "
                                   f"(loaded by every worker: {offered})", f"lora[{i}].id", code="unknown_adapter")
        if index in named:
            raise ApiError.invalid(f"lora[{i}].id: adapter {loaded[index]!r} is named twice (by the lora field "
                                   "or the model name)", f"lora[{i}].id")
        named.add(index)


def adapter_routes(routes: Mapping[str, ModelRoute]) -> dict[str, tuple[ModelRoute, str]]:
    """``base:adapter`` -> its base model's route and the adapter, for every adapter a generation
    model's workers all loaded (``/v1/models`` lists them beside the models)."""
    return {f"{model}{SEPARATOR}{name}": (route, name) for model, route in routes.items()
            if route.kind == JobKind.GENERATION for name in common_adapters(route.workers)}
