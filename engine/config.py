"""Engine configuration: what to load and how to size the llama.cpp context."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.scheduler import BatchingMode


class KVCacheType(StrEnum):
    F16 = "f16"
    Q8_0 = "q8_0"
    Q4_0 = "q4_0"
    F32 = "f32"


class FlashAttention(StrEnum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


class CpuRepack(StrEnum):
    """Whether llama.cpp may repack CPU weights into its faster layouts (see engine/cpu_features.py)."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


class EngineConfig(BaseModel):
    """Sizes follow llama-server's meaning where one exists.

    ``ctx`` is the per-sequence context (prompt + generated tokens of one request). The KV pool is
    ``kv_cells`` cells shared by all slots (llama.cpp's unified KV); it defaults to
    ``slots * ctx`` so every slot can always reach its full context. A smaller pool saves memory:
    admission then waits for room and preemption handles overflow (see the scheduler).
    """

    model_config = ConfigDict(extra="forbid")

    model_path: Path
    slots: int = Field(8, ge=1, le=256)
    ctx: int = Field(4096, ge=64, le=1_048_576, description="per-sequence context in tokens")
    kv_cells: int | None = Field(None, ge=64, description="total KV cells; default slots * ctx")
    n_batch: int = Field(512, ge=1, le=65_536, description="max tokens in one llama_decode")
    n_ubatch: int = Field(512, ge=1, le=65_536)
    prefill_chunk: int = Field(256, ge=1, description="max prompt tokens of one sequence per step")
    threads: int | None = Field(None, ge=1, le=1024, description="None = all cores")
    gpu_layers: int = Field(0, ge=-1, description="-1 = all layers on the GPU")
    flash_attention: FlashAttention = FlashAttention.AUTO
    kv_type: KVCacheType = KVCacheType.F16
    mode: BatchingMode = BatchingMode.CONTINUOUS
    prefix_cache: bool = True
    kv_overcommit: float = Field(1.0, ge=0.1, le=16.0, description="admit while reserved KV <= cells * this")
    cpu_repack: CpuRepack = Field(
        CpuRepack.AUTO,
        description="repack CPU weights into llama.cpp's faster layouts (AVX2/AVX-512, AMX): auto = on unless the "
                    "CPU has AMX, whose repacked kernels crash llama.cpp (llama.cpp #20824); on; off")
    seed: int = Field(0xFFFFFFFF, ge=0, le=0xFFFFFFFF, description="default sampler seed; 0xFFFFFFFF = random")

    @model_validator(mode="after")
    def _sizes(self) -> EngineConfig:
        if not self.model_path.is_file():
            raise ValueError(f"model_path: no such file: {self.model_path}")
        if self.n_batch < self.slots:
            raise ValueError(f"n_batch ({self.n_batch}) must be >= slots ({self.slots}): every slot decodes one token per step")
        if self.kv_cells is not None and self.kv_cells < self.ctx:
            raise ValueError(f"kv_cells ({self.kv_cells}) must be >= ctx ({self.ctx}) so one sequence can reach its full context")
        return self

    @property
    def total_kv_cells(self) -> int:
        return self.kv_cells or self.slots * self.ctx
