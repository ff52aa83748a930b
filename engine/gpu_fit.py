"""How many layers to offload to the GPU for ``SLOTQ_GPU_LAYERS=auto``: a pure function.

llama.cpp offloads the *last* ``n_gpu_layers`` repeating layers (and the output layer once every
repeating layer is on the GPU); each offloaded layer brings its weights and its share of the KV
cache, which lives with the layer. So the fit walks layers from the last one down and keeps adding
while ``weights + KV of the layer`` stays within the budget: a target fraction of the GPU memory
that is free now, minus a reserve for llama.cpp's compute buffers (the logits of a micro-batch
dominate them for large vocabularies). The KV share is sized for every configured slot
(``kv_cells`` cells), so the layers chosen still fit when all slots are full.

The model's shape comes from the GGUF header (:func:`slotq.engine.llama_devices.read_model_shape`) and
the free memory from llama.cpp's devices (:func:`slotq.engine.llama_devices.gpu_devices`); this module
only does the arithmetic, so it is tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from slotq.engine.config import KVCacheType

MIB = 1 << 20
BASE_RESERVE = 256 * MIB

# Bytes per KV element: f16/f32 plain, q8_0 and q4_0 in blocks of 32 (34 and 18 bytes).
KV_BYTES_PER_ELEMENT = {KVCacheType.F16: 2.0, KVCacheType.F32: 4.0, KVCacheType.Q8_0: 34 / 32,
                        KVCacheType.Q4_0: 18 / 32}


@dataclass(frozen=True)
class ModelShape:
    """What the fit needs to know about a model, read from its GGUF header."""

    layer_bytes: tuple[int, ...]      # weights of each repeating layer (blk.N.*), in file order
    output_bytes: int                 # output.weight (+ output_norm): offloaded after every layer
    n_vocab: int
    n_embd_k_gqa: int                 # K width per token per layer (key_length x n_head_kv)
    n_embd_v_gqa: int

    @property
    def n_layer(self) -> int:
        return len(self.layer_bytes)


@dataclass(frozen=True)
class GpuFit:
    layers: int          # the n_gpu_layers to pass to llama.cpp (n_layer + 1 = everything)
    budget_bytes: int
    used_bytes: int
    reason: str


def kv_bytes_per_layer(shape: ModelShape, kv_cells: int, kv_type: KVCacheType) -> int:
    return int((shape.n_embd_k_gqa + shape.n_embd_v_gqa) * kv_cells * KV_BYTES_PER_ELEMENT[kv_type])


def compute_reserve(shape: ModelShape, n_ubatch: int) -> int:
    """Room left for llama.cpp's compute buffers: a base plus the f32 logits of one micro-batch."""
    return BASE_RESERVE + n_ubatch * shape.n_vocab * 4


def fit_gpu_layers(*, free_bytes: int, fraction: float, shape: ModelShape, kv_cells: int, kv_type: KVCacheType,
                   n_ubatch: int) -> GpuFit:
    """The most layers whose weights and KV fit in ``fraction`` of ``free_bytes`` after the reserve."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], not {fraction}")
    budget = int(free_bytes * fraction) - compute_reserve(shape, n_ubatch)
    kv = kv_bytes_per_layer(shape, kv_cells, kv_type)
    used = 0
    layers = 0
    for weights in reversed(shape.layer_bytes):
        if used + weights + kv > budget:
            break
        used += weights + kv
        layers += 1
    if layers == shape.n_layer and used + shape.output_bytes <= budget:
        used += shape.output_bytes
        layers += 1
    gib = 1 << 30
    reason = (f"{layers} of {shape.n_layer + 1} layers (output included) fit: {used / gib:.2f} GiB of weights and KV "
              f"for {kv_cells} cells within {max(budget, 0) / gib:.2f} GiB ({fraction:.0%} of {free_bytes / gib:.2f} "
              f"GiB free, less {compute_reserve(shape, n_ubatch) / gib:.2f} GiB for compute buffers)")
    return GpuFit(layers=layers, budget_bytes=max(budget, 0), used_bytes=used, reason=reason)
