"""SLOTQ_GPU_LAYERS=auto: the fit arithmetic (pure), the GGUF shape reader, and auto on a build
without a GPU (this machine). No test needs a GPU."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import pytest

from slotq.engine import KVCacheType
from slotq.engine.gpu_fit import BASE_RESERVE, MIB, ModelShape, compute_reserve, fit_gpu_layers, kv_bytes_per_layer
from slotq.engine.llama_devices import read_model_shape
from tests.support.engine import greedy, run_one, running_engine

GIB = 1 << 30


def shape(n_layer: int = 10, layer_mib: int = 100) -> ModelShape:
    return ModelShape(layer_bytes=(layer_mib * MIB,) * n_layer, output_bytes=50 * MIB, n_vocab=32_000,
                      n_embd_k_gqa=1024, n_embd_v_gqa=1024)


def test_kv_share_and_reserve() -> None:
    s = shape()
    assert kv_bytes_per_layer(s, 4096, KVCacheType.F16) == 2048 * 4096 * 2            # 16 MiB per layer
    assert kv_bytes_per_layer(s, 4096, KVCacheType.Q8_0) == int(2048 * 4096 * 34 / 32)
    assert compute_reserve(s, 512) == BASE_RESERVE + 512 * 32_000 * 4


def test_fit_counts_layers_with_their_kv_within_the_budget() -> None:
    s = shape()
    per_layer = 100 * MIB + kv_bytes_per_layer(s, 4096, KVCacheType.F16)          # 116 MiB
    free = 2 * GIB
    budget = int(free * 0.5) - compute_reserve(s, 512)
    fit = fit_gpu_layers(free_bytes=free, fraction=0.5, shape=s, kv_cells=4096, kv_type=KVCacheType.F16, n_ubatch=512)
    assert fit.layers == budget // per_layer == 6
    assert fit.used_bytes == 6 * per_layer <= fit.budget_bytes == budget
    assert "6 of 11 layers" in fit.reason


def test_fit_takes_the_output_layer_only_when_every_layer_fits() -> None:
    s = shape()
    everything = fit_gpu_layers(free_bytes=80 * GIB, fraction=0.9, shape=s, kv_cells=4096, kv_type=KVCacheType.F16,
                                n_ubatch=512)
    assert everything.layers == s.n_layer + 1
    more_slots = fit_gpu_layers(free_bytes=80 * GIB, fraction=0.9, shape=s, kv_cells=4096 * 512,
                                kv_type=KVCacheType.F16, n_ubatch=512)
    assert 0 < more_slots.layers < s.n_layer                   # the KV of many slots takes the room


def test_fit_is_zero_when_not_even_the_reserve_fits() -> None:
    fit = fit_gpu_layers(free_bytes=200 * MIB, fraction=0.9, shape=shape(), kv_cells=4096, kv_type=KVCacheType.F16,
                         n_ubatch=512)
    assert fit.layers == 0 and fit.budget_bytes == 0
    with pytest.raises(ValueError, match="fraction"):
        fit_gpu_layers(free_bytes=GIB, fraction=0, shape=shape(), kv_cells=1, kv_type=KVCacheType.F16, n_ubatch=1)


def test_model_shape_from_the_gguf_header(tiny_model_path: Path) -> None:
    s = read_model_shape(tiny_model_path)
    reader = gguf.GGUFReader(str(tiny_model_path))
    per_layer = [sum(int(t.n_bytes) for t in reader.tensors if t.name.startswith(f"blk.{i}.")) for i in range(2)]
    assert s.layer_bytes == tuple(per_layer) and all(b > 0 for b in per_layer)
    assert s.output_bytes == sum(int(t.n_bytes) for t in reader.tensors if t.name.startswith("output"))
    assert s.n_vocab == 3 + 256 + 27
    assert (s.n_embd_k_gqa, s.n_embd_v_gqa) == (64, 64)        # head_dim 64 x 1 KV head


async def test_auto_without_a_gpu_means_zero_and_says_so(tiny_model_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="slotq.engine.llama_devices")
    async with running_engine(tiny_model_path, slots=2, gpu_layers="auto") as engine:
        assert engine.model.gpu_layers == 0
        _text, tokens, finished = await run_one(engine, greedy("abc", 4))
        assert len(tokens) == 4 and finished[0].error is None
    assert "GPU layers: auto -> 0" in caplog.text
