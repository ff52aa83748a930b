"""A tiny random-weight llama GGUF for tests, written with the ``gguf`` package.

Byte-level SPM vocabulary (every UTF-8 string tokenizes and round-trips), 2 layers, 128-wide:
about 1.4 MB, loads in milliseconds. Weights are deterministic (seeded) and scaled up so greedy
argmax has clear margins and does not flip between batch shapes.

:func:`write_draft_model` writes a random llama of the same recipe that carries another GGUF's
vocabulary (the bundled model's by default): a draft model (SLOTQ_DRAFT_MODEL) for tests and
``slotq bench spec`` (bench/overhead_bench.py's ``write_draft_model`` loads this file by path).

:func:`write_lora` writes a LoRA adapter GGUF for a llama GGUF (this recipe's or the bundled model): SLOTQ_LORA.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np

# The suite's model (tests/conftest.py's tiny_model_path). Larger weights give more decisive logits, so
# greedy argmax does not flip when llama.cpp's accumulation order changes with the batch shape.
TINY_SCALE = 1.0
TINY_SEED = 0
N_HEAD, N_HEAD_KV, N_FF = 2, 1, 256       # the random llamas' shape beyond width and depth
LOUD_PADDING = 100.0    # a padded draft model's padding rows: their logits dwarf every real token's

LETTERS = "abcdefghijklmnopqrstuvwxyz"
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# A template that renders tools as Qwen 2.5's does (shortened): tools in the system message, calls in
# <tool_call> tags, results in <tool_response> tags.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call functions:\n<tools>\n{% for tool in tools %}"
    "{{ tool | tojson }}\n{% endfor %}</tools>\nCall one as <tool_call>\n{\"name\": <name>, \"arguments\": "
    "<args>}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message['content'] }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}{% for call in message.get('tool_calls', []) %}<tool_call>\n{\"name\": "
    "\"{{ call['function']['name'] }}\", \"arguments\": {{ call['function']['arguments'] | tojson }}}\n"
    "</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_llama(path: Path, *, seed: int = 0, scale: float = 1.0, n_embd: int = 128, n_layer: int = 2,
                     n_ctx_train: int = 8192, quant: gguf.GGMLQuantizationType | None = None,
                     chat_template: str = CHATML_TEMPLATE, pooling_type: int | None = None) -> Path:
    """``quant`` (e.g. Q4_0) quantizes the matrices that feed matrix multiplications, so llama.cpp
    has something to repack; the default keeps every weight F32. ``chat_template``: plain ChatML
    (no tools, as the bundled model's) unless a test needs another, e.g. :data:`HERMES_TEMPLATE`.
    ``pooling_type`` (llama.cpp's enum, e.g. 1 = mean) writes ``llama.pooling_type``, as embedding
    fine-tunes of decoder models carry."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581"] + list(LETTERS)
    types = [2, 3, 3] + [6] * 256 + [1] * 27
    scores = [0.0, 0.0, 0.0] + [-1000.0] * 256 + [float(-i) for i in range(27)]

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-random-llama")
    _add_hyperparameters(w, n_embd=n_embd, n_layer=n_layer, n_ctx_train=n_ctx_train, quant=quant)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template(chat_template)
    if pooling_type is not None:
        w.add_pooling_type(gguf.PoolingType(pooling_type))
    _write_random_tensors(w, n_vocab=len(tokens), seed=seed, scale=scale, n_embd=n_embd, n_layer=n_layer, quant=quant)
    return path


def write_draft_model(path: Path, *, vocabulary_of: Path | None = None, seed: int = 1, scale: float = 1.0,
                      n_embd: int = 64, n_layer: int = 2, padded_to: int | None = None,
                      renamed: Mapping[int, str] | None = None) -> Path:
    """A random-weight llama GGUF carrying the tokenizer of ``vocabulary_of`` (default: the bundled
    SmolLM2-135M-Instruct), to draft for that model (``SLOTQ_DRAFT_MODEL``) in tests and ``slotq bench
    spec``. Every ``tokenizer.*`` key is copied as it is (tokens, types, merges, special ids, chat
    template), so llama.cpp reads the same vocabulary; the output matrix is the token embedding
    (tied), so the 49,152-token vocabulary costs one matrix: about 13 MB at the default width. Its
    drafts are random, so few are accepted: that is the point of the benchmark's row (what a draft
    model that misses costs), and tests check drafting against its own greedy continuation.

    ``padded_to``: the vocabulary padded with unused ``[PAD<id>]`` tokens to this size, as conversions
    pad a family's sizes differently. Their embedding rows are :data:`LOUD_PADDING` times larger, so an
    argmax over the whole row lands in the padding: a drafter must draft only ids the served model has.
    ``renamed``: token id -> another text (a vocabulary that differs from the served model's)."""
    if vocabulary_of is None:
        from slotq.engine import bundled_model_path

        vocabulary_of = bundled_model_path()
    tokenizer = _tokenizer_fields(vocabulary_of)
    if "tokenizer.ggml.tokens" not in tokenizer:
        raise ValueError(f"{vocabulary_of}: no tokenizer.ggml.tokens, so no vocabulary to copy")
    n_source = len(tokenizer["tokenizer.ggml.tokens"][0])
    n_vocab = max(padded_to or 0, n_source)
    padding: dict[str, list[object]] = {
        "tokenizer.ggml.tokens": [f"[PAD{i}]" for i in range(n_source, n_vocab)],
        "tokenizer.ggml.token_type": [int(gguf.TokenType.UNUSED)] * (n_vocab - n_source),
        "tokenizer.ggml.scores": [0.0] * (n_vocab - n_source),
    }
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"random draft model with the vocabulary of {vocabulary_of.name}")
    _add_hyperparameters(w, n_embd=n_embd, n_layer=n_layer, n_ctx_train=8192, quant=None)
    for key, (value, types) in tokenizer.items():
        if key in padding:
            value = value + padding[key]
        if key == "tokenizer.ggml.tokens" and renamed:
            value = [renamed.get(token, text) for token, text in enumerate(value)]
        w.add_key_value(key, value, types[0], types[1] if len(types) > 1 else None)
    w.add_vocab_size(n_vocab)
    _write_random_tensors(w, n_vocab=n_vocab, seed=seed, scale=scale, n_embd=n_embd, n_layer=n_layer, quant=None,
                          tied_output=True, loud_rows_from=n_source)
    return path


LORA_TARGETS = ("attn_q", "attn_v", "ffn_up", "ffn_down")      # the matrices the test adapters change


def write_lora(path: Path, base_model: Path, *, seed: int = 7, rank: int = 4, alpha: float = 4.0, scale: float = 1.0,
               targets: tuple[str, ...] = LORA_TARGETS) -> Path:
    """A LoRA adapter GGUF for the llama ``base_model`` (the tiny model, or the bundled one for
    ``slotq bench lora``), as llama.cpp's ``convert_lora_to_gguf.py`` writes one: ``general.type``
    adapter, ``adapter.type`` lora, ``adapter.lora.alpha``, and for each adapted weight ``W`` of
    ``targets`` in every layer (numpy shape out x in) a pair ``<W>.lora_a`` (rank x in) and
    ``<W>.lora_b`` (out x rank), so ``W' = W + scale x alpha / rank x B A``. Seeded random pairs
    at ``scale`` (the default changes the tiny model's greedy tokens within a few steps)."""
    rng = np.random.default_rng(seed)
    suffixes = tuple(f".{target}.weight" for target in targets)
    shapes = {t.name: (int(t.shape[1]), int(t.shape[0]))                # GGUF lists ne (in, out): numpy's reversed
              for t in gguf.GGUFReader(str(base_model)).tensors if t.name.endswith(suffixes)}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for name, (rows, cols) in shapes.items():
        w.add_tensor(f"{name}.lora_a", (rng.standard_normal((rank, cols)) * scale).astype(np.float32))
        w.add_tensor(f"{name}.lora_b", (rng.standard_normal((rows, rank)) * scale).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@functools.cache
def _tokenizer_fields(path: Path) -> dict[str, tuple[Any, list[gguf.GGUFValueType]]]:
    """``path``'s ``tokenizer.*`` keys: value and GGUF types. Cached: reading the bundled GGUF's 150,000 vocabulary
    strings takes seconds, and a test session writes more than one draft model."""
    fields = gguf.GGUFReader(str(path)).fields
    return {key: (field.contents(), field.types) for key, field in fields.items() if key.startswith("tokenizer.")}


def _add_hyperparameters(w: gguf.GGUFWriter, *, n_embd: int, n_layer: int, n_ctx_train: int,
                         quant: gguf.GGMLQuantizationType | None) -> None:
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(n_embd // N_HEAD)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0 if quant is None else gguf.LlamaFileType[f"MOSTLY_{quant.name}"])


def _write_random_tensors(w: gguf.GGUFWriter, *, n_vocab: int, seed: int, scale: float, n_embd: int, n_layer: int,
                          quant: gguf.GGMLQuantizationType | None, tied_output: bool = False,
                          loud_rows_from: int | None = None) -> None:
    """Seeded random tensors of the llama that :func:`_add_hyperparameters` describes into ``w`` (whose vocabulary
    the caller wrote), then the file. ``tied_output``: no ``output.weight`` (llama.cpp then uses the token
    embedding); ``loud_rows_from``: token embedding rows from this id on are :data:`LOUD_PADDING` times larger."""
    rng = np.random.default_rng(seed)
    head_dim = n_embd // N_HEAD

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def matrix(name: str, rows: int, cols: int) -> None:
        data = rand(rows, cols)
        if quant is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, quant), raw_dtype=quant)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, np.float32)

    token_embd = rand(n_vocab, n_embd)
    if loud_rows_from is not None:
        token_embd[loud_rows_from:] *= LOUD_PADDING
    w.add_tensor("token_embd.weight", token_embd)
    w.add_tensor("output_norm.weight", ones(n_embd))
    if not tied_output:
        matrix("output.weight", n_vocab, n_embd)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones(n_embd))
        matrix(f"blk.{i}.attn_q.weight", N_HEAD * head_dim, n_embd)
        matrix(f"blk.{i}.attn_k.weight", N_HEAD_KV * head_dim, n_embd)
        matrix(f"blk.{i}.attn_v.weight", N_HEAD_KV * head_dim, n_embd)
        matrix(f"blk.{i}.attn_output.weight", n_embd, N_HEAD * head_dim)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones(n_embd))
        matrix(f"blk.{i}.ffn_gate.weight", N_FF, n_embd)
        matrix(f"blk.{i}.ffn_up.weight", N_FF, n_embd)
        matrix(f"blk.{i}.ffn_down.weight", n_embd, N_FF)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


RANK_SEP = "[SEP]"      # the tiny reranker's separator token (a control token, after the letters)


def write_tiny_reranker(path: Path, *, seed: int = 3, n_embd: int = 64, n_layer: int = 2, n_ctx_train: int = 512,
                        rerank_template: str | None = None) -> Path:
    """A random-weight BERT cross-encoder with rank pooling (``bert.pooling_type`` = 4, llama.cpp's
    LLAMA_POOLING_TYPE_RANK): llama.cpp pools the first token, runs the classification head (``cls``: a
    dense layer and tanh, ``cls.output``: one logit) and hands that one float per sequence out of
    ``llama_get_embeddings_seq``, as it does for bge-reranker and jina-reranker GGUFs. About 0.5 MB.

    Its vocabulary is :func:`write_tiny_llama`'s byte-level SPM one plus ``[SEP]``, and it asks llama.cpp to add
    BOS, EOS and SEP (``add_bos_token``, ``add_eos_token``, ``add_sep_token``), so llama-server joins a query and a
    document as ``<s> query </s> [SEP] document </s>``. ``rerank_template``: a ``tokenizer.chat_template.rerank``
    (``{query}`` and ``{document}`` replaced) that takes the place of that joining, as Qwen3 rerankers carry."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581"] + list(LETTERS) + [RANK_SEP]
    types = [2, 3, 3] + [6] * 256 + [1] * 27 + [3]
    scores = [0.0, 0.0, 0.0] + [-1000.0] * 256 + [float(-i) for i in range(27)] + [0.0]
    n_vocab, n_ff, n_head = len(tokens), 4 * n_embd, 2

    w = gguf.GGUFWriter(str(path), "bert")
    w.add_name("tiny-random-reranker")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.RANK)
    w.add_file_type(0)
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_token_type_count(2)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_sep_token_id(n_vocab - 1)
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)
    w.add_add_sep_token(True)
    if rerank_template is not None:
        w.add_chat_template([{"name": "rerank", "template": rerank_template}])

    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32) / np.float32(np.sqrt(shape[-1]))

    def norm(name: str, n: int) -> None:
        w.add_tensor(f"{name}.weight", np.ones(n, np.float32))
        w.add_tensor(f"{name}.bias", np.zeros(n, np.float32))

    w.add_tensor("token_embd.weight", rng.standard_normal((n_vocab, n_embd)).astype(np.float32))
    w.add_tensor("token_types.weight", rand(2, n_embd))
    w.add_tensor("position_embd.weight", rand(n_ctx_train, n_embd))
    norm("token_embd_norm", n_embd)
    for i in range(n_layer):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.{i}.{part}.weight", rand(n_embd, n_embd))
            w.add_tensor(f"blk.{i}.{part}.bias", np.zeros(n_embd, np.float32))
        norm(f"blk.{i}.attn_output_norm", n_embd)
        w.add_tensor(f"blk.{i}.ffn_up.weight", rand(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", rand(n_embd, n_ff))
        norm(f"blk.{i}.layer_output_norm", n_embd)
    w.add_tensor("cls.weight", rand(n_embd, n_embd))
    w.add_tensor("cls.bias", np.zeros(n_embd, np.float32))
    w.add_tensor("cls.output.weight", rng.standard_normal((1, n_embd)).astype(np.float32))
    w.add_tensor("cls.output.bias", np.zeros(1, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
