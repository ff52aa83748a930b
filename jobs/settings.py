"""slotq settings: environment variables with the ``SLOTQ_`` prefix, or a ``.env`` file.

Every process (worker, client, CLI) reads the same settings, so one ``.env`` configures a whole
development setup. ``SENTRY_DSN`` is read by sentry-sdk itself.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine import BatchingMode, EngineConfig, FlashAttention, KVCacheType, resolve_model_path


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SLOTQ_", env_file=".env", extra="ignore")

    # --- Redis and queue
    redis_url: str | None = Field(None, description="redis:// or rediss:// URL; unset = start an embedded Valkey server")
    data_dir: Path = Field(Path.home() / ".local/share/slotq", description="embedded Redis data (append-only file)")
    embedded_redis_port: int = Field(6399, ge=0, le=65535, description="port of the embedded server (0 = any free port)")
    queue_name: str = "slotq:queue"
    max_queue_length: int = Field(10_000, ge=1, description="enqueue raises QueueFull beyond this many waiting jobs")
    poll_delay_s: float = Field(0.05, gt=0, le=5, description="fallback poll interval; enqueues wake workers at once")
    queue_read_limit: int = Field(1000, ge=1, description="must exceed the fleet's total slots (running jobs sit at the queue head)")
    job_timeout_s: int = Field(3600, ge=1, description="hard cap on one attempt")
    lock_ttl_s: int = Field(15, ge=3, description="in-progress lock TTL, renewed by the worker heartbeat")
    max_tries: int = Field(5, ge=1, le=100)
    retry_backoff_s: float = Field(1.0, ge=0, description="first retry delay; doubles each try")
    keep_result_s: int = Field(86_400, ge=1)
    drain_grace_s: int = Field(25, ge=0, description="on SIGTERM, let running jobs finish this long (Heroku allows 30 s)")
    stream_ttl_s: int = Field(3600, ge=1, description="how long a job's output stream lives after its final event")
    stream_maxlen: int = Field(100_000, ge=100, description="cap on entries per output stream")
    stream_flush_ms: float = Field(10.0, gt=0, le=1000, description="coalesce chunks for this long before XADD")
    # --- Engine
    model: str | None = Field(None, description="path to a GGUF file; unset = the bundled SmolLM2-135M-Instruct")
    model_name: str | None = Field(None, description="the name the model is served under (the gateway's `model`); default the GGUF's name")
    slots: int = Field(8, ge=1, le=256)
    ctx: int = Field(4096, ge=64, description="per-sequence context (prompt + output)")
    kv_cells: int | None = Field(None, ge=64, description="total KV cells shared by all slots; default slots * ctx")
    batch: int = Field(512, ge=1, description="max tokens per llama_decode")
    ubatch: int = Field(512, ge=1)
    prefill_chunk: int = Field(256, ge=1)
    threads: int | None = Field(None, ge=1)
    gpu_layers: int = Field(0, ge=-1, description="-1 = offload every layer")
    flash_attention: FlashAttention = FlashAttention.AUTO
    kv_type: KVCacheType = KVCacheType.F16
    batching: BatchingMode = BatchingMode.CONTINUOUS
    prefix_cache: bool = True
    # --- Operations
    metrics_port: int = Field(0, ge=0, le=65535, description="serve Prometheus metrics on this port (0 = off)")
    worker_name: str | None = Field(None, description="shown by `slotq status`; default host:pid")
    log_level: str = "INFO"

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model_path=resolve_model_path(self.model),
            slots=self.slots,
            ctx=self.ctx,
            kv_cells=self.kv_cells,
            n_batch=max(self.batch, self.slots),
            n_ubatch=self.ubatch,
            prefill_chunk=self.prefill_chunk,
            threads=self.threads,
            gpu_layers=self.gpu_layers,
            flash_attention=self.flash_attention,
            kv_type=self.kv_type,
            mode=self.batching,
            prefix_cache=self.prefix_cache,
        )
