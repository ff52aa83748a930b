"""Everything that calls llama.cpp for the model and context (through llama-cpp-python's ctypes API).

One :class:`LlamaModel` owns the model, one context with ``n_seq_max = slots`` and one reusable
batch. Only the engine thread may call the context methods (decode, memory, logits, sampling);
tokenization, detokenization and chat templates use only the vocabulary, which llama.h documents
as thread-safe, so request validation can run on the caller's thread.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llama_cpp
import numpy as np

from slotq.engine.config import CpuRepack, EngineConfig, FlashAttention, KVCacheType, KVLayout
from slotq.engine.cpu_features import RepackDecision, decide_repack, this_cpu_flags
from slotq.engine.llama_devices import resolve_gpu_layers
from slotq.engine.lora import BASE, AdapterSet, LoraAdapterSpec

if TYPE_CHECKING:
    from slotq.engine.sampling import SamplerChain

log = logging.getLogger(__name__)

_GGML_TYPES = {
    KVCacheType.F32: 0,     # GGML_TYPE_F32
    KVCacheType.F16: 1,     # GGML_TYPE_F16
    KVCacheType.Q4_0: 2,    # GGML_TYPE_Q4_0
    KVCacheType.Q8_0: 8,    # GGML_TYPE_Q8_0
}
_FLASH_ATTN = {FlashAttention.AUTO: -1, FlashAttention.OFF: 0, FlashAttention.ON: 1}

_backend_lock = threading.Lock()
_backend_ready = False
_repack_logged: set[RepackDecision] = set()


def _init_backend() -> None:
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            llama_cpp.llama_backend_init()
            _quiet_llama_logs()
            _backend_ready = True


def _quiet_llama_logs() -> None:
    """Route llama.cpp's chatter to the 'llama.cpp' logger at DEBUG instead of stderr."""
    try:
        from llama_cpp import _logger

        _logger.set_verbose(bool(os.environ.get("SLOTQ_LLAMA_VERBOSE")))
    except (ImportError, AttributeError):  # pragma: no cover - older bindings
        pass


def _repack_decision(mode: CpuRepack) -> RepackDecision:
    """Decide from this CPU's flags; log each distinct decision once per process (at start-up,
    since every model load asks), so a crash report shows whether repacking was on."""
    decision = decide_repack(mode, this_cpu_flags())
    with _backend_lock:
        if decision not in _repack_logged:
            _repack_logged.add(decision)
            log.info("%s", decision.describe())
    return decision


def _set_fields(params: ctypes.Structure, **values: object) -> None:
    """Assign struct fields, refusing names the struct does not have: ctypes silently accepts any
    attribute, and field names move between llama-cpp-python versions."""
    names = {f[0] for f in type(params)._fields_}
    for name, value in values.items():
        if name not in names:
            raise RuntimeError(f"llama-cpp-python {llama_cpp.__version__}: "
                               f"{type(params).__name__} has no field {name!r}")
        setattr(params, name, value)


@dataclass(frozen=True)
class ContextInfo:
    """The sizes llama.cpp actually chose (it pads and clamps what was asked for)."""

    n_ctx: int
    n_ctx_seq: int              # cells one sequence may use: its own stream (split) or the whole pool (unified)
    n_batch: int
    n_ubatch: int
    n_seq_max: int
    n_threads: int
    n_vocab: int
    n_ctx_train: int
    model_name: str
    model_size_bytes: int
    kv_layout: KVLayout         # never AUTO: what the context was created with


@dataclass(frozen=True)
class ContextShape:
    """The llama.cpp context a model is served with: sizes, KV layout, and whether it computes pooled
    embeddings instead of logits. Generation and embedding engines load models the same way (threads,
    GPU layers, weight repacking) and differ only here."""

    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_seq_max: int
    kv_layout: KVLayout           # never AUTO
    pooling_type: int | None = None     # llama.cpp's enum llama_pooling_type; None = logits (generation)

    @classmethod
    def for_generation(cls, config: EngineConfig) -> ContextShape:
        return cls(n_ctx=config.total_kv_cells, n_batch=config.batch, n_ubatch=min(config.ubatch, config.batch),
                   n_seq_max=config.kv_sequences, kv_layout=config.resolved_kv_layout)


class LlamaModel:
    def __init__(self, config: EngineConfig, shape: ContextShape | None = None) -> None:
        _init_backend()
        self.config = config
        shape = shape or ContextShape.for_generation(config)
        mp = llama_cpp.llama_model_default_params()
        self.gpu_layers = resolve_gpu_layers(config)
        _set_fields(mp, n_gpu_layers=self.gpu_layers,
                    use_extra_bufts=_repack_decision(config.cpu_repack).repack)
        self._model = llama_cpp.llama_model_load_from_file(str(config.model_path).encode(), mp)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {config.model_path} "
                               "(not a GGUF, or an unsupported architecture)")
        self.vocab = llama_cpp.llama_model_get_vocab(self._model)
        self._pieces: dict[int, bytes] = {}
        self._special_pieces: dict[int, bytes] = {}
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        n_ctx_train = llama_cpp.llama_model_n_ctx_train(self._model)

        threads = config.threads or len(os.sched_getaffinity(0)) or 1   # cores this process may use
        cp = llama_cpp.llama_context_default_params()
        _set_fields(
            cp,
            n_ctx=shape.n_ctx,
            n_batch=shape.n_batch,
            n_ubatch=shape.n_ubatch,
            n_seq_max=shape.n_seq_max,
            n_threads=threads,
            n_threads_batch=threads,
            kv_unified=shape.kv_layout == KVLayout.UNIFIED,
            swa_full=True,
            flash_attn_type=_FLASH_ATTN[config.flash_attention],
            type_k=_GGML_TYPES[config.kv_type],
            type_v=_GGML_TYPES[config.kv_type],
            no_perf=True,
        )
        if shape.pooling_type is not None:
            _set_fields(cp, embeddings=True, pooling_type=shape.pooling_type)
        self._ctx = llama_cpp.llama_init_from_model(self._model, cp)
        if not self._ctx:
            llama_cpp.llama_model_free(self._model)
            raise RuntimeError(
                f"llama.cpp could not create a context of {shape.n_ctx} KV cells with {shape.n_seq_max} sequences "
                "(out of memory? lower SLOTQ_CTX / SLOTQ_SLOTS)"
            )
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self.info = ContextInfo(
            n_ctx=llama_cpp.llama_n_ctx(self._ctx),
            n_ctx_seq=llama_cpp.llama_n_ctx_seq(self._ctx),
            n_batch=llama_cpp.llama_n_batch(self._ctx),
            n_ubatch=llama_cpp.llama_n_ubatch(self._ctx),
            n_seq_max=llama_cpp.llama_n_seq_max(self._ctx),
            n_threads=threads,
            n_vocab=self.n_vocab,
            n_ctx_train=n_ctx_train,
            model_name=self.metadata("general.name") or config.model_path.stem,
            model_size_bytes=llama_cpp.llama_model_size(self._model),
            kv_layout=shape.kv_layout,
        )
        if self.info.n_seq_max < shape.n_seq_max:
            raise RuntimeError(f"llama.cpp allows only {self.info.n_seq_max} sequences; asked for {shape.n_seq_max} "
                               f"({config.slots} slots + {config.usable_cache_slots} cache slots)")
        self._batch = llama_cpp.llama_batch_init(self.info.n_batch, 0, 1)
        self._tok = np.ctypeslib.as_array(self._batch.token, shape=(self.info.n_batch,))
        self._pos = np.ctypeslib.as_array(self._batch.pos, shape=(self.info.n_batch,))
        self._nseq = np.ctypeslib.as_array(self._batch.n_seq_id, shape=(self.info.n_batch,))
        self._logits = np.ctypeslib.as_array(self._batch.logits, shape=(self.info.n_batch,))
        self._nseq[:] = 1
        self._seq_ptrs = [self._batch.seq_id[i] for i in range(self.info.n_batch)]
        self._adapters: list[ctypes._Pointer[ctypes.c_void_p]] = []
        self._applied: AdapterSet = BASE
        self._closed = False

    def load_adapters(self, specs: Sequence[LoraAdapterSpec]) -> None:
        """Load LoRA adapters (index = place in ``specs``); none applies until :meth:`set_adapters`.
        llama.cpp frees them with the model."""
        for spec in specs:
            adapter = llama_cpp.llama_adapter_lora_init(self._model, str(spec.path).encode())
            if not adapter:
                raise RuntimeError(f"llama.cpp could not load LoRA adapter {spec.name!r} from {spec.path} (not a "
                                   f"LoRA GGUF, or made for another model: SLOTQ_LLAMA_VERBOSE=1 says why)")
            # the bindings' stubs say c_void_p; ctypes gives the POINTER(c_void_p) that llama_set_adapters_lora takes
            self._adapters.append(ctypes.cast(adapter, llama_cpp.llama_adapter_lora_p_ctypes))

    # ------------------------------------------------------------ vocabulary (any thread)
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 16
        while True:
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
            if n >= 0:
                return list(buf[:n])
            if n == -(2**31):
                raise ValueError("prompt too long to tokenize")
            cap = -n

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        """The bytes of one token as it appears in generated text: control tokens render empty
        unless ``special`` (a reply whose tool calls start with one, as Mistral's ``[TOOL_CALLS]``).
        Cached per token id (the vocabulary never changes): at thousands of tokens per second the
        ctypes call was a sizeable share of a decode step's Python time."""
        pieces = self._special_pieces if special else self._pieces
        piece = pieces.get(token)
        if piece is None:
            piece = pieces[token] = self._token_piece(token, special)
        return piece

    def _token_piece(self, token: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def control_tokens(self) -> dict[str, tuple[int, bool, bool]]:
        """Each token llama.cpp reads out of a prompt's text only when told to parse specials (control
        and unknown tokens: a chat template's turn markers), by its text: its id, and whether it
        strips the whitespace on its left and on its right (``LSTRIP`` / ``RSTRIP``)."""
        hidden = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
        found: dict[str, tuple[int, bool, bool]] = {}
        for token in range(self.info.n_vocab):
            attr = int(llama_cpp.llama_vocab_get_attr(self.vocab, token))
            text = self.token_text(token) if attr & hidden else ""
            if text and text not in found:
                found[text] = (token, bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP),
                               bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP))
        return found

    def tokenize_pieces(self, pieces: Sequence[str | int]) -> list[int]:
        """Tokens of a prompt given as plain-text pieces (tokenized with no control token read out of
        them) and control token ids, with BOS / EOS added as :meth:`tokenize` adds them. The same
        tokens as :meth:`tokenize` with ``parse_special`` when the pieces hold no control token's text:
        llama.cpp, too, splits the text at control tokens first and tokenizes each piece alone."""
        tokens = [self.bos_token] if llama_cpp.llama_vocab_get_add_bos(self.vocab) else []
        for piece in pieces:
            if isinstance(piece, int):
                tokens.append(piece)
            elif piece:
                tokens.extend(self.tokenize(piece, add_special=False, parse_special=False))
        if llama_cpp.llama_vocab_get_add_eos(self.vocab):
            tokens.append(self.eos_token)
        return tokens

    def added_specials(self) -> tuple[int | None, int | None, int | None]:
        """The BOS, EOS and SEP tokens the vocabulary asks to add around a text (``add_bos_token``,
        ``add_eos_token``, ``add_sep_token``), each None when not asked; a vocabulary with no EOS ends with
        its SEP instead, as llama-server's rerank prompt does."""
        eos = self.eos_token
        if eos == llama_cpp.LLAMA_TOKEN_NULL:
            eos = int(llama_cpp.llama_vocab_sep(self.vocab))
        return (self.bos_token if llama_cpp.llama_vocab_get_add_bos(self.vocab) else None,
                eos if llama_cpp.llama_vocab_get_add_eos(self.vocab) else None,
                int(llama_cpp.llama_vocab_sep(self.vocab)) if llama_cpp.llama_vocab_get_add_sep(self.vocab) else None)

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    def token_text(self, token: int) -> str:
        raw = llama_cpp.llama_vocab_get_text(self.vocab, token)
        return raw.decode("utf-8", errors="replace") if raw else ""

    @property
    def bos_token(self) -> int:
        return int(llama_cpp.llama_vocab_bos(self.vocab))

    @property
    def eos_token(self) -> int:
        return int(llama_cpp.llama_vocab_eos(self.vocab))

    def metadata(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    def chat_template(self, name: str | None = None) -> str | None:
        """The GGUF's default chat template, or the one called ``name`` (``tokenizer.chat_template.<name>``,
        e.g. a reranker's ``rerank`` prompt); None when it has none."""
        raw = llama_cpp.llama_model_chat_template(self._model, name.encode() if name is not None else None)
        return raw.decode("utf-8", errors="replace") if raw else None

    # ------------------------------------------------------------ context (engine thread only)
    def decode(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int],
               wants_logits: Sequence[bool]) -> int:
        """One llama_decode over the given tokens. Returns llama.cpp's code (0 ok, 1 no KV space,
        2 aborted, <0 error). Never passes more than n_batch tokens: llama.cpp would abort the process."""
        n = len(tokens)
        if n == 0 or n > self.info.n_batch:
            raise ValueError(f"batch of {n} tokens; must be 1..{self.info.n_batch}")
        self._tok[:n] = tokens
        self._pos[:n] = positions
        self._logits[:n] = wants_logits
        ptrs = self._seq_ptrs
        for i, s in enumerate(seq_ids):
            ptrs[i][0] = s
        self._batch.n_tokens = n
        return int(llama_cpp.llama_decode(self._ctx, self._batch))

    def logits_row(self, batch_index: int) -> np.ndarray:
        """The raw logits of ``batch_index`` of the last decode, as a view (n_vocab float32) that is
        valid until the next decode. Sampling with a constraint writes into it (the mask)."""
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx, batch_index), shape=(self.n_vocab,))

    def logits_rows(self, n_outputs: int) -> np.ndarray:
        """The raw logits of the last decode's first ``n_outputs`` rows that asked for them, in batch order, as one
        (n_outputs, n_vocab) float32 view, valid until the next decode: one numpy call can then read them all."""
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits(self._ctx), shape=(n_outputs, self.n_vocab))

    def sample(self, chain: SamplerChain, batch_index: int) -> int:
        """Sample (and accept) a token from the logits row of ``batch_index`` of the last decode."""
        return chain.sample(self._ctx, batch_index)

    def set_adapters(self, adapters: AdapterSet) -> bool:
        """Apply ``adapters`` to the context for the decodes from now on (engine thread only);
        returns whether that changed them. A change makes llama.cpp reserve its compute graph again
        at the next decode, which is what a switch between adapter sets costs."""
        if adapters == self._applied:
            return False
        n = len(adapters)
        handles = (llama_cpp.llama_adapter_lora_p_ctypes * n)(*(self._adapters[i] for i, _ in adapters))
        scales = (ctypes.c_float * n)(*(scale for _, scale in adapters))
        llama_cpp.llama_set_adapters_lora(self._ctx, handles if n else None, n, scales if n else None)
        self._applied = adapters
        return True

    def kv_remove(self, seq_id: int, start: int = -1) -> None:
        """Drop ``seq_id``'s cells from position ``start`` on (-1: all of them)."""
        llama_cpp.llama_memory_seq_rm(self._mem, seq_id, start, -1)

    def kv_copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Give the empty ``dst`` ``src``'s cells for positions [0, n).

        Unified: ``dst`` shares the cells (metadata only, no copy). Split: ``src`` and ``dst`` live
        in different streams, and llama.cpp copies across streams only a whole sequence
        (``p0 = p1 = -1``; a partial range fails a GGML_ASSERT and aborts the process). It marks
        the cells at once and copies the whole stream buffer (K and V of every layer) at the start
        of the next ``llama_decode``; the positions from ``n`` on are then dropped from ``dst``."""
        if self.info.kv_layout == KVLayout.UNIFIED:
            llama_cpp.llama_memory_seq_cp(self._mem, src, dst, 0, n)
            return
        llama_cpp.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
        llama_cpp.llama_memory_seq_rm(self._mem, dst, n, -1)

    def kv_clear(self) -> None:
        llama_cpp.llama_memory_clear(self._mem, True)

    @property
    def n_embd_out(self) -> int:
        """Width of the model's output vectors: an embedding's dimensions."""
        return int(llama_cpp.llama_model_n_embd_out(self._model))

    @property
    def n_pooled_out(self) -> int:
        """Floats per sequence that :meth:`sequence_embedding` returns: a vector of :attr:`n_embd_out`, or under
        rank pooling the classifier's outputs (``n_cls_out``: one relevance score for a reranker)."""
        if self.pooling_type == llama_cpp.LLAMA_POOLING_TYPE_RANK:
            return int(llama_cpp.llama_model_n_cls_out(self._model))
        return self.n_embd_out

    @property
    def pooling_type(self) -> int:
        """The pooling the context applies (llama.cpp's enum; the GGUF's when none was asked for)."""
        return int(llama_cpp.llama_pooling_type(self._ctx))

    def sequence_embedding(self, seq_id: int) -> np.ndarray:
        """The pooled output of ``seq_id`` after the last decode, :attr:`n_pooled_out` floats (a copy: llama.cpp
        reuses the buffer)."""
        pointer = llama_cpp.llama_get_embeddings_seq(self._ctx, seq_id)
        if not pointer:
            raise RuntimeError(f"llama.cpp has no pooled embedding for sequence {seq_id} (pooling type "
                               f"{self.pooling_type})")
        return np.ctypeslib.as_array(pointer, shape=(self.n_pooled_out,)).copy()

    # ------------------------------------------------------------ lifetime
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        llama_cpp.llama_batch_free(self._batch)
        llama_cpp.llama_free(self._ctx)
        llama_cpp.llama_model_free(self._model)
