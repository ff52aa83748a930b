"""``/v1/rerank`` (and ``/v1/reranking``, ``/rerank``, ``/reranking``, llama-server's paths): documents scored
against a query by a reranker, as one job on its queue.

The body and the answer are llama-server's: Jina's (``query``, ``documents``, ``top_n``; results most relevant
first, each ``{index, relevance_score}``) or, with ``texts``, Hugging Face TEI's (a bare list of ``{index,
score}``). ``return_documents`` (Jina, Cohere) and ``return_text`` (TEI) add each document's text. The job
holds the scores in document order; ordering and ``top_n`` happen here, where the documents are. A model
that cannot rank (no rank pooling: a generator or an embedding model) is a 400 ``model_cannot_rank``.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from pydantic import TypeAdapter

from slotq.jobs.gateway.auth import CallerDep, authenticate
from slotq.jobs.gateway.job_results import finished_result
from slotq.jobs.gateway.routes_openai import gateway_of
from slotq.jobs.gateway.service import Gateway
from slotq.jobs.gateway.sse import ClientGone
from slotq.jobs.openai.errors import ApiError, public_param
from slotq.jobs.openai.translate import to_rerank_job, to_rerank_response, to_tei_ranks
from slotq.jobs.openai.wire import RerankRequest, TeiRank
from slotq.jobs.protocol.schemas import JobKind

router = APIRouter(dependencies=[Depends(authenticate)])
PATHS = ("/v1/rerank", "/v1/reranking", "/rerank", "/reranking")
_TEI_ANSWER = TypeAdapter(list[TeiRank])


async def rerank(body: RerankRequest, request: Request, caller: CallerDep) -> Response:
    """One rerank job for all the request's documents: the worker batches its pairs (and other requests')
    into shared decodes. The job keeps running if the client leaves only when it did not create it."""
    gateway = gateway_of(request)
    model = body.model or await _sole_reranker(gateway)
    job = to_rerank_job(body, idempotency_key=request.headers.get("idempotency-key"), tenant=caller.tenant)
    handle, record = await gateway.submit(job, model, "rerank")
    try:
        result = await finished_result(
            request, gateway, handle, deadline=None, owner_cancels=handle.created,
            param=(lambda f: "texts" if f == "documents" else public_param(f)) if body.tei else public_param)
    except ClientGone:
        return Response(status_code=499)
    if body.tei:
        ranks = to_tei_ranks(result, body.items if body.return_text else None, body.top_n)
        content = _TEI_ANSWER.dump_json(ranks, exclude_none=True)
    else:
        answer = to_rerank_response(result, record.model, body.items if body.return_documents else None, body.top_n)
        content = answer.model_dump_json(exclude_none=True).encode()
    return Response(content, media_type="application/json", headers={"X-Slotq-Job-Id": handle.id})


for _path in PATHS:
    router.add_api_route(_path, rerank, methods=["POST"], name=f"rerank {_path}")


async def _sole_reranker(gateway: Gateway) -> str:
    """The model of a request that names none (llama-server serves one model, so its clients may leave it
    out): the one reranker live workers serve; else a 400 naming ``model``."""
    rerankers = await gateway.router.models_of(JobKind.RERANK)
    if len(rerankers) == 1:
        return rerankers[0]
    served = (f"several rerankers are served ({', '.join(rerankers)})" if rerankers
              else "no live worker serves a reranker")
    raise ApiError.invalid(f"model: required: {served}", "model", code="missing_required_parameter")
