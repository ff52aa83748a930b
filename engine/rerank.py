"""Rerank: documents scored for their relevance to a query by a cross-encoder, many pairs per ``llama_decode``.

    engine = await RerankEngine.start(EngineConfig(model_path="bge-reranker-v2-m3.gguf"))
    ranking = await engine.rerank(RerankRequest(query="what is a queue?", documents=["a line", "a fruit"]))
    ranking.scores          # float32 array, one score per document, in document order

A reranker GGUF has rank pooling (``<arch>.pooling_type`` = 4, LLAMA_POOLING_TYPE_RANK): llama.cpp pools
the sequence (its first token for BERT kin, its last for a causal model), runs the classification head
and hands the result out of ``llama_get_embeddings_seq``; its first float is the score, as llama-server
reads it. A model without rank pooling is refused by name (:class:`ModelCannotRank`): its pooled vector
is no score.

Each (query, document) pair is one input of :class:`~slotq.engine.pooled.PooledEngine`, which batches
pairs as it batches embedding inputs. A pair is joined as llama-server's ``format_prompt_rerank`` joins it:
the model's ``rerank`` template (``tokenizer.chat_template.rerank``, ``{query}`` and ``{document}``
replaced, control tokens read out of it) when the GGUF has one, else ``BOS query EOS SEP document EOS``,
each marker only where the vocabulary asks to add it. A pair longer than the limit (``ctx``, ``batch``
and the model's training context, the least of them) is refused naming ``documents`` (or ``query``, when
the query alone is too long) and the limit.

Scores come back raw (llama-server's ``relevance_score``); ordering them and cutting to ``top_n`` is the
caller's, who also holds the documents.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np

from slotq.engine.config import EngineConfig
from slotq.engine.errors import InvalidRequest, ModelCannotRank
from slotq.engine.llama_devices import read_pooling_hint
from slotq.engine.pooled import PooledEngine
from slotq.engine.request import RerankParams, RerankRequest

log = logging.getLogger(__name__)

_POOLING_NAMES = {llama_cpp.LLAMA_POOLING_TYPE_NONE: "none", llama_cpp.LLAMA_POOLING_TYPE_MEAN: "mean",
                  llama_cpp.LLAMA_POOLING_TYPE_CLS: "cls", llama_cpp.LLAMA_POOLING_TYPE_LAST: "last"}


@dataclass(frozen=True)
class Ranking:
    """One request's answer: a score per document, in document order."""

    request_id: str
    scores: np.ndarray            # float32, shape (documents,)
    prompt_tokens: int            # the tokens of every (query, document) pair


def is_rank_model(path: Path) -> bool:
    """Whether the GGUF says it is a reranker: rank pooling in its header."""
    _architecture, pooling = read_pooling_hint(path)
    return pooling == llama_cpp.LLAMA_POOLING_TYPE_RANK


class RerankEngine(PooledEngine):
    """Asyncio API over the rerank thread (:class:`~slotq.engine.pooled.PooledEngine`): a row is a
    (query, document) pair's relevance score."""

    worker_name = "a rerank worker"
    thread_name = "slotq-rerank"

    def __init__(self, config: EngineConfig) -> None:
        # The GGUF's own pooling: a reranker declares rank, and asking for rank on a model without a
        # classification head would pool a vector and call its first float a score.
        super().__init__(config, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED)
        self.template = self.model.chat_template("rerank")
        log.info("rerank model %s: pairs joined %s, up to %d tokens, %d per decode of %d tokens",
                 self.info.model_name, "by its rerank template" if self.template else "as BOS query EOS SEP doc EOS",
                 self.ctx_per_seq, self.info.n_seq_max, self.info.n_batch)

    @classmethod
    async def start(cls, config: EngineConfig) -> RerankEngine:
        """Load the model off the event loop and start the engine thread."""
        return await asyncio.to_thread(cls, config)

    def _accept(self, pooling_type: int) -> int:
        if pooling_type != llama_cpp.LLAMA_POOLING_TYPE_RANK:
            raise ModelCannotRank(
                f"{self.config.model_path.name} cannot rank: its pooling is "
                f"{_POOLING_NAMES.get(pooling_type, pooling_type)}, not rank; a reranker GGUF (a cross-encoder "
                "with a classification head, such as bge-reranker) declares rank pooling", field="model")
        return 1

    def _describe(self) -> str:
        return f"model {self.info.model_name}, rank pooling"

    def _read_rows(self, n: int) -> np.ndarray:
        return np.array([[self.model.sequence_embedding(seq)[0]] for seq in range(n)], np.float32)

    # ------------------------------------------------------------------ requests (any thread)
    def tokenize(self, request: RerankParams) -> list[list[int]]:
        """Each (query, document) pair's tokens, joined as llama-server's ``format_prompt_rerank`` joins them,
        and checked against the limit. Raises InvalidRequest naming ``query`` or ``documents`` and the limit."""
        limit = self.ctx_per_seq
        if self.template is not None:
            pairs = [self.model.tokenize(self.template.replace("{query}", request.query).replace("{document}", d),
                                         add_special=False, parse_special=True) for d in request.documents]
        else:
            bos, eos, sep = self.model.added_specials()
            query = self.model.tokenize(request.query, add_special=False, parse_special=False)
            head = [t for t in (bos,) if t is not None] + query + [t for t in (eos, sep) if t is not None]
            tail = [eos] if eos is not None else []
            if len(head) + len(tail) >= limit:
                raise InvalidRequest(f"the query is {len(query)} tokens; a query and a document together may have "
                                     f"at most {limit} ({self.limit_reason})", field="query")
            pairs = [head + self.model.tokenize(d, add_special=False, parse_special=False) + tail
                     for d in request.documents]
        for i, tokens in enumerate(pairs):
            if not tokens:
                raise InvalidRequest(f"document {i} with the query makes no tokens (both empty, and the model adds "
                                     "no markers)", field="documents")
            if len(tokens) > limit:
                raise InvalidRequest(f"document {i} with the query is {len(tokens)} tokens; a query and a document "
                                     f"together may have at most {limit} ({self.limit_reason})", field="documents")
        return pairs

    async def rerank(self, request: RerankRequest) -> Ranking:
        """The score of every document. Raises InvalidRequest for a pair that cannot be scored,
        EngineDead / EngineStopped when the engine cannot run it; cancelling the caller cancels the
        request's pairs still waiting."""
        self._lifecycle.raise_unless_running()
        pairs = await asyncio.to_thread(self.tokenize, request)
        pooled = await self._pool(request.id, pairs)
        return Ranking(request.id, pooled.rows[:, 0], pooled.prompt_tokens)

    async def warm_up(self) -> float:
        """Score one short pair through the whole path; returns the seconds it took."""
        started = time.perf_counter()
        await self.rerank(RerankRequest(query="Hello", documents=["Hello"]))
        return time.perf_counter() - started
