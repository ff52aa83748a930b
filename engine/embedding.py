"""Embeddings: many inputs pooled per ``llama_decode``, on one thread that owns the context.

    engine = await EmbeddingEngine.start(EngineConfig(model_path=..., pooling="mean"))
    result = await engine.embed(EmbeddingRequest(inputs=["a text", "another"]))
    result.vectors          # float32 array, one normalised row per input

The batching (whole inputs per decode, round-robin over requests, one micro-batch, KV cleared between
decodes) is :class:`~slotq.engine.pooled.PooledEngine`'s, shared with rerank (:mod:`slotq.engine.rerank`).

An input longer than the limit (``ctx``, ``batch`` and the model's training context, the least of
them) is refused naming ``input`` and the limit, unless the request asks to ``truncate`` it, as
llama-server's ``truncate`` does (the first tokens are kept). Vectors are normalised as
llama-server's ``--embd-normalize`` does (``embd_normalize``, default 2 = L2).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np

from slotq.engine.config import EngineConfig, Pooling
from slotq.engine.errors import InvalidRequest
from slotq.engine.llama_devices import read_pooling_hint
from slotq.engine.pooled import PooledEngine
from slotq.engine.request import EmbeddingParams, EmbeddingRequest

log = logging.getLogger(__name__)

_POOLING_TYPES = {Pooling.MEAN: llama_cpp.LLAMA_POOLING_TYPE_MEAN, Pooling.CLS: llama_cpp.LLAMA_POOLING_TYPE_CLS,
                  Pooling.LAST: llama_cpp.LLAMA_POOLING_TYPE_LAST}
_POOLING_NAMES = {value: name.value for name, value in _POOLING_TYPES.items()}
# Architectures that only encode (no text generation): llama.cpp's BERT family and T5's encoder.
ENCODER_ARCHITECTURES = frozenset({"bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "jina-bert-v3",
                                   "neo-bert", "modern-bert", "eurobert", "t5encoder"})


@dataclass(frozen=True)
class Embeddings:
    """One request's answer: a row per input, in input order."""

    request_id: str
    vectors: np.ndarray           # float32, shape (inputs, dimensions)
    prompt_tokens: int
    truncated_inputs: int         # inputs cut to the limit (``truncate``)


def normalize(vectors: np.ndarray, mode: int) -> np.ndarray:
    """Each row scaled as llama.cpp's ``common_embd_normalize``: -1 as is, 0 by its largest absolute
    value into the int16 range, 1 by its sum of absolute values, 2 by its Euclidean length, p > 2 by
    its p-norm. A zero row stays zero."""
    if mode < 0:
        return vectors
    magnitudes = np.abs(vectors.astype(np.float64))
    if mode == 0:
        norms = magnitudes.max(axis=1) / 32760.0
    elif mode == 2:
        norms = np.sqrt((magnitudes ** 2).sum(axis=1))
    else:
        norms = (magnitudes ** mode).sum(axis=1) ** (1.0 / mode)
    scale = np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0)
    scaled: np.ndarray = (vectors * scale[:, None]).astype(np.float32)
    return scaled


def is_embedding_model(path: Path) -> bool:
    """Whether the GGUF says it is an embedding model: an encoder architecture (BERT and kin), or a
    pooling type in its header (embedding fine-tunes of decoder models carry one). A reranker (rank
    pooling: :func:`slotq.engine.rerank.is_rank_model`) is not one: it gives a score, not a vector."""
    architecture, pooling = read_pooling_hint(path)
    if pooling == llama_cpp.LLAMA_POOLING_TYPE_RANK:
        return False
    return architecture in ENCODER_ARCHITECTURES or (pooling is not None
                                                     and pooling != llama_cpp.LLAMA_POOLING_TYPE_NONE)


def _pooling_type(config: EngineConfig) -> int:
    """llama.cpp's pooling type for ``config.pooling``; ``auto``: the GGUF's own, or mean for a
    model that declares none (a text generator), as ``llama-server --pooling mean`` serves one."""
    if config.pooling != Pooling.AUTO:
        return _POOLING_TYPES[config.pooling]
    _architecture, declared = read_pooling_hint(config.model_path)
    if declared is None or declared == llama_cpp.LLAMA_POOLING_TYPE_NONE:
        return llama_cpp.LLAMA_POOLING_TYPE_MEAN
    return llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED


class EmbeddingEngine(PooledEngine):
    """Asyncio API over the embedding thread (:class:`~slotq.engine.pooled.PooledEngine`): a row is an
    input's pooled vector, normalised."""

    worker_name = "an embedding worker"
    thread_name = "slotq-embeddings"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config, pooling_type=_pooling_type(config))
        self.dimensions = self.width
        log.info("embedding model %s: %d dimensions, %s pooling, inputs up to %d tokens, %d per decode of %d tokens",
                 self.info.model_name, self.dimensions, self.pooling, self.ctx_per_seq, self.info.n_seq_max,
                 self.info.n_batch)

    @classmethod
    async def start(cls, config: EngineConfig) -> EmbeddingEngine:
        """Load the model off the event loop and start the engine thread."""
        return await asyncio.to_thread(cls, config)

    def _accept(self, pooling_type: int) -> int:
        if pooling_type not in _POOLING_NAMES:
            raise RuntimeError(f"{self.config.model_path.name}: pooling type {pooling_type} gives no vector per "
                               "input (none or rank); set SLOTQ_POOLING to mean, cls or last")
        self.pooling = _POOLING_NAMES[pooling_type]
        return self.model.n_embd_out

    def _describe(self) -> str:
        return f"model {self.info.model_name}, {self.pooling} pooling"

    def _read_rows(self, n: int) -> np.ndarray:
        return normalize(np.stack([self.model.sequence_embedding(seq) for seq in range(n)]),
                         self.config.embd_normalize)

    # ------------------------------------------------------------------ requests (any thread)
    def tokenize(self, request: EmbeddingParams) -> tuple[list[list[int]], int]:
        """Each input's tokens, checked against the vocabulary and the limit (cut to it when the
        request asks to ``truncate``); also how many were cut. Raises InvalidRequest naming the input."""
        limit, cut = self.ctx_per_seq, 0
        inputs: list[list[int]] = []
        items: list[str | list[int]] = list(request.inputs)
        for i, item in enumerate(items):
            tokens = self.model.tokenize(item) if isinstance(item, str) else item
            if not isinstance(item, str) and max(tokens) >= self.info.n_vocab:
                raise InvalidRequest(f"input {i}: token id {max(tokens)} is outside the vocabulary "
                                     f"(0..{self.info.n_vocab - 1})", field="input")
            if len(tokens) > limit:
                if not request.truncate:
                    raise InvalidRequest(
                        f"input {i} is {len(tokens)} tokens; an input may have at most {limit} ({self.limit_reason}); "
                        "ask to truncate it to cut it there", field="input")
                tokens, cut = tokens[:limit], cut + 1
            inputs.append(tokens)
        return inputs, cut

    async def embed(self, request: EmbeddingRequest) -> Embeddings:
        """The vectors of every input. Raises InvalidRequest for an input that cannot be embedded,
        EngineDead / EngineStopped when the engine cannot run it; cancelling the caller cancels
        the request's inputs still waiting."""
        self._lifecycle.raise_unless_running()
        inputs, cut = await asyncio.to_thread(self.tokenize, request)
        pooled = await self._pool(request.id, inputs, cut)
        return Embeddings(request.id, pooled.rows, pooled.prompt_tokens, pooled.truncated_inputs)

    async def warm_up(self) -> float:
        """Embed one short text through the whole path; returns the seconds it took."""
        started = time.perf_counter()
        await self.embed(EmbeddingRequest(inputs=["Hello"]))
        return time.perf_counter() - started
