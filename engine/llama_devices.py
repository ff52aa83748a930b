"""llama.cpp calls for sizing before a model loads: GPU devices and their free memory (ggml's
backend-device API) and a model's shape from its GGUF header (ggml's gguf reader, metadata only).

Used by ``SLOTQ_GPU_LAYERS=auto`` (see :mod:`slotq.engine.gpu_fit`). Loading the model itself to learn
its shape is not an option: llama.cpp's ``vocab_only`` load aborts in hparams on some builds, and
a full load would already have placed the layers.
"""

from __future__ import annotations

import ctypes
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
from llama_cpp._ggml import libggml

from slotq.engine.config import EngineConfig
from slotq.engine.gpu_fit import ModelShape, fit_gpu_layers

log = logging.getLogger(__name__)

# enum ggml_backend_dev_type: CPU, GPU, IGPU (integrated GPU, shares host memory), ACCEL
_GPU_TYPES = {1: "gpu", 2: "igpu"}
# enum gguf_type
_GGUF_INT_GETTERS = {0: "u8", 1: "i8", 2: "u16", 3: "i16", 4: "u32", 5: "i32", 10: "u64", 11: "i64"}
_GGUF_ARRAY = 9
_LAYER = re.compile(rb"^blk\.(\d+)\.")


@dataclass(frozen=True)
class GpuDevice:
    name: str
    kind: str
    free_bytes: int
    total_bytes: int


def _ggml_base() -> ctypes.CDLL:
    """libggml-base (already loaded by llama-cpp-python, Linux file name): where the gguf_* functions live."""
    return ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))


def gpu_devices() -> list[GpuDevice]:
    """The GPUs this llama.cpp build can offload to, with their free memory now. Empty on a
    CPU-only build (llama-cpp-python from PyPI without ``CMAKE_ARGS="-DGGML_CUDA=on"``)."""
    if not llama_cpp.llama_supports_gpu_offload():
        return []
    lib = libggml
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_name.restype = ctypes.c_char_p
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(ctypes.c_size_t)]
    lib.ggml_backend_dev_memory.restype = None
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        kind = _GPU_TYPES.get(lib.ggml_backend_dev_type(dev))
        if kind is None:
            continue
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append(GpuDevice((lib.ggml_backend_dev_name(dev) or b"?").decode(), kind, free.value, total.value))
    return out


class _GgufInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


def _gguf_lib() -> ctypes.CDLL:
    """libggml-base with the signatures of the gguf_* functions the readers below use."""
    lib = _ggml_base()
    lib.gguf_init_from_file.argtypes = [ctypes.c_char_p, _GgufInitParams]
    lib.gguf_init_from_file.restype = ctypes.c_void_p
    lib.gguf_free.argtypes = [ctypes.c_void_p]
    lib.gguf_find_key.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.gguf_find_key.restype = ctypes.c_int64
    lib.gguf_get_kv_type.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_get_kv_type.restype = ctypes.c_int
    lib.gguf_get_val_str.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_get_val_str.restype = ctypes.c_char_p
    lib.gguf_get_arr_n.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_get_arr_n.restype = ctypes.c_size_t
    lib.gguf_get_n_tensors.argtypes = [ctypes.c_void_p]
    lib.gguf_get_n_tensors.restype = ctypes.c_int64
    lib.gguf_get_tensor_name.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_get_tensor_name.restype = ctypes.c_char_p
    lib.gguf_get_tensor_size.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_get_tensor_size.restype = ctypes.c_size_t
    for width in _GGUF_INT_GETTERS.values():
        getter = getattr(lib, f"gguf_get_val_{width}")
        getter.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        getter.restype = getattr(ctypes, f"c_{'u' if width[0] == 'u' else ''}int{width[1:]}")
    return lib


def _gguf_integer(lib: ctypes.CDLL, ctx: int, key: str) -> int | None:
    """An integer value of the GGUF header; None when absent or not a single integer (per-layer arrays)."""
    kid = lib.gguf_find_key(ctx, key.encode())
    if kid < 0:
        return None
    getter = _GGUF_INT_GETTERS.get(lib.gguf_get_kv_type(ctx, kid))
    return int(getattr(lib, f"gguf_get_val_{getter}")(ctx, kid)) if getter else None


def _gguf_architecture(lib: ctypes.CDLL, ctx: int) -> str:
    arch_id = lib.gguf_find_key(ctx, b"general.architecture")
    return lib.gguf_get_val_str(ctx, arch_id).decode() if arch_id >= 0 else "llama"


def _open_gguf(lib: ctypes.CDLL, path: Path) -> int:
    ctx = lib.gguf_init_from_file(str(path).encode(), _GgufInitParams(True, None))
    if not ctx:
        raise ValueError(f"{path}: not a readable GGUF file")
    return int(ctx)


def read_pooling_hint(path: Path) -> tuple[str, int | None]:
    """The GGUF's architecture and its ``<arch>.pooling_type`` (llama.cpp's enum; None when absent):
    what tells an embedding model from a text generator before it loads."""
    lib = _gguf_lib()
    ctx = _open_gguf(lib, path)
    try:
        arch = _gguf_architecture(lib, ctx)
        return arch, _gguf_integer(lib, ctx, f"{arch}.pooling_type")
    finally:
        lib.gguf_free(ctx)


def read_model_shape(path: Path) -> ModelShape:
    """Layer sizes, vocabulary and KV widths from the GGUF header (no tensor data is read)."""
    lib = _gguf_lib()
    ctx = _open_gguf(lib, path)
    try:
        def integer(key: str) -> int | None:
            return _gguf_integer(lib, ctx, key)

        arch = _gguf_architecture(lib, ctx)
        n_layer = integer(f"{arch}.block_count") or 0
        n_embd = integer(f"{arch}.embedding_length") or 0
        n_head = integer(f"{arch}.attention.head_count") or 1
        n_head_kv = integer(f"{arch}.attention.head_count_kv") or n_head
        key_len = integer(f"{arch}.attention.key_length") or n_embd // n_head
        value_len = integer(f"{arch}.attention.value_length") or n_embd // n_head
        tokens_id = lib.gguf_find_key(ctx, b"tokenizer.ggml.tokens")
        n_vocab = int(lib.gguf_get_arr_n(ctx, tokens_id)) if tokens_id >= 0 else 0

        layers = [0] * n_layer
        output = 0
        for t in range(lib.gguf_get_n_tensors(ctx)):
            name = lib.gguf_get_tensor_name(ctx, t)
            size = int(lib.gguf_get_tensor_size(ctx, t))
            match = _LAYER.match(name)
            if match and int(match.group(1)) < n_layer:
                layers[int(match.group(1))] += size
            elif name.startswith(b"output"):
                output += size
    finally:
        lib.gguf_free(ctx)
    return ModelShape(layer_bytes=tuple(layers), output_bytes=output, n_vocab=n_vocab,
                      n_embd_k_gqa=key_len * n_head_kv, n_embd_v_gqa=value_len * n_head_kv)


def resolve_gpu_layers(config: EngineConfig) -> int:
    """``config.gpu_layers`` as llama.cpp's ``n_gpu_layers``: a number as given (-1: all), or for
    ``auto`` the fit of :func:`slotq.engine.gpu_fit.fit_gpu_layers` on the free memory of every GPU, logged."""
    if config.gpu_layers != "auto":
        return 999 if config.gpu_layers < 0 else config.gpu_layers
    devices = gpu_devices()
    if not devices:
        log.info("GPU layers: auto -> 0 (this llama.cpp build has no GPU offload, or no GPU was found); "
                 "see the README for a GPU install")
        return 0
    shape = read_model_shape(config.model_path)
    fit = fit_gpu_layers(free_bytes=sum(d.free_bytes for d in devices), fraction=config.gpu_memory_fraction,
                         shape=shape, kv_cells=config.total_kv_cells, kv_type=config.kv_type,
                         n_ubatch=min(config.ubatch, config.batch))
    names = ", ".join(f"{d.name} ({d.free_bytes / (1 << 30):.1f} of {d.total_bytes / (1 << 30):.1f} GiB free)"
                      for d in devices)
    log.info("GPU layers: auto -> %d on %s: %s", fit.layers, names, fit.reason)
    return fit.layers
