"""Waiting for a job's result on behalf of a route: the chat, Messages and Responses routes each
answer a non-streaming request (and a token count) with the job's result or the error that stands for
it, and share these rather than each waiting its own way.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from fastapi import Request, Response
from pydantic import BaseModel

from slotq.jobs.gateway.service import Gateway
from slotq.jobs.gateway.sse import DEADLINE_GRACE_S, ClientGone, until_disconnected
from slotq.jobs.openai.errors import ApiError
from slotq.jobs.openai.translate import unfinished_error
from slotq.jobs.producer.client import JobHandle, JobNotFound, JobTimeout
from slotq.jobs.protocol.schemas import JobRequest, JobResult


async def finished_result(request: Request, gateway: Gateway, handle: JobHandle, *, deadline: float | None,
                          owner_cancels: bool, param: Callable[[str | None], str | None]) -> JobResult:
    """The result of a job that finished its reply, waited for until its deadline; an ApiError for
    one that did not (failed, cancelled, past its deadline: ``param`` names a field as the request
    did). ClientGone when the client leaves first, the job then cancelled if ``owner_cancels``."""
    timeout = None if deadline is None else max(0.0, deadline - time.time()) + DEADLINE_GRACE_S
    try:
        result = await until_disconnected(request, handle.result(timeout=timeout))
    except ClientGone:
        if owner_cancels:
            gateway.client_left(handle.client, handle.id)
        raise
    except JobTimeout:
        gateway.cancel_soon(handle.client, handle.id)
        raise ApiError.deadline(f"job {handle.id}: the deadline passed before it finished") from None
    except JobNotFound:
        raise ApiError.job_not_found(handle.id) from None
    error = unfinished_error(result, param)
    if error is not None:
        error.headers |= {"X-Slotq-Job-Id": handle.id}
        raise error
    return result


async def count_prompt(request: Request, gateway: Gateway, job: JobRequest, model: str,
                       param: Callable[[str | None], str | None], answer: Callable[[int], BaseModel]) -> Response:
    """The token-counting routes' one answer (``/v1/messages/count_tokens``,
    ``/v1/responses/input_tokens``): ``job`` generates one token, so the count is the prompt as a
    worker serving ``model`` renders and tokenizes it, charged to the tenant's quotas as the work it
    is; ``answer`` wraps the count in the route's shape. 499 (the job cancelled) if the client leaves."""
    handle, _record = await gateway.submit(job, model, "chat", param)
    try:
        result = await finished_result(request, gateway, handle, deadline=None, owner_cancels=True, param=param)
    except ClientGone:
        return Response(status_code=499)
    return Response(answer(result.usage.prompt_tokens).model_dump_json(), media_type="application/json",
                    headers={"X-Slotq-Job-Id": handle.id})
